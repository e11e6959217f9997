"""Reading Hugging Face checkpoints one tensor at a time.

This module owns finding the weight files in a checkpoint directory (sharded
or single-file safetensors, sharded or single-file ``pytorch_model.bin``) and
handing out tensors one by one, with shape and dtype available without reading
any tensor data. Safetensors files are opened (and checked) through ``safe_open``, and a tensor's bytes are read
from the file into its own buffer (``_read_tensor``): the pages a memory map touches stay mapped, counted in the
process's resident memory, until the file's handle closes, so a build that read every tensor through the map held
the whole checkpoint (2.2 GB of a 2.2 GB one) besides the tensor it converts;
``.bin`` files are loaded with ``weights_only=True`` (never plain unpickling),
memory-mapped when possible, and only one ``.bin`` shard is held at a time. Every
problem a user can cause (missing, truncated or unsafe files, bad index, unknown
tensor name) becomes a one-line ``MxcError`` naming the file or tensor.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from mxc.artifact_format import safetensors_header
from mxc.errors import MxcError
from mxc.loaders.buffers import empty
from mxc.loaders.files import check_readable, not_a_file, read_json

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}

_EXPECTED = ("model.safetensors.index.json, model.safetensors, *.safetensors, "
             "pytorch_model.bin.index.json or pytorch_model.bin")


def _short(exc: BaseException) -> str:
    """The first line of an exception message, for embedding in a one-line error."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _open_safetensors(path: Path):
    check_readable(path, "a safetensors file")  # no permission: the OS's reason, not safetensors' guess
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise MxcError(f"{path}: not a valid safetensors file (truncated or corrupt?): {_short(e)}") from None
    except (OSError, ValueError) as e:  # e.g. a file that cannot be memory-mapped (/proc/self/mem)
        raise MxcError(f"{path}: cannot read it as a safetensors file ({_short(e)})") from None


def _tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in the safetensors file ``path`` (one ``safe_open`` has checked): name -> (start,
    end), from the start of the file."""
    try:
        length, header = safetensors_header(path)
        return {name: (8 + length + meta["data_offsets"][0], 8 + length + meta["data_offsets"][1])
                for name, meta in header.items() if name != "__metadata__"}
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:  # changed since opened
        raise MxcError(f"{path}: cannot read its safetensors header ({_short(e)}); was it replaced during the build? "
                       f"build again") from None


def _read_tensor(path: Path, name: str, span: tuple[int, int], dtype: torch.dtype, shape) -> torch.Tensor:
    """The tensor ``name`` whose bytes are ``span`` of ``path``, read (not mapped) into a tensor of its own."""
    start, end = span
    if end - start != dtype.itemsize * math.prod(shape):
        raise MxcError(f"{path}: tensor {name!r} takes {end - start} bytes in its header, not the {list(shape)} "
                       f"{str(dtype).removeprefix('torch.')} it had when the build opened it; was the file replaced "
                       f"during the build? build again")
    out = empty((end - start,), torch.uint8)  # huge pages: faulting 4 KiB pages in cost as much as the read
    view = memoryview(out.numpy())
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            done = 0
            while done < len(view):  # one read returns at most 2 GiB on Linux
                got = f.readinto(view[done:])
                if not got:
                    raise MxcError(f"{path}: cannot read tensor {name!r}: the file ends at byte {start + done}, before "
                                   f"its data does ({end}); was it truncated? download it again")
                done += got
    except OSError as e:
        raise MxcError(f"{path}: cannot read tensor {name!r}: {e.strerror or _short(e)}") from None
    return out.view(dtype).reshape(shape)


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """Load a ``.bin`` state dict with ``weights_only=True``, memory-mapped when possible: dense tensors only."""
    check_readable(path, "a PyTorch checkpoint")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            raise
        except Exception:  # e.g. legacy (non-zip) format, which cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # "Unsupported global: GLOBAL x.Y was not an allowed global" (torch < 2.13) or "unsupported GLOBAL x.y
        # whose module x is blocked." (2.13)
        found = re.search(r"unsupported global.*?(?= was not|\.?$)", str(e), re.IGNORECASE | re.MULTILINE)
        if found:
            raise MxcError(f"{path}: contains non-tensor pickled objects ({found.group(0).strip()}); "
                           "refused for safety (only weights_only loading is allowed)") from None
        reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not|\n|$)", str(e))
        reason = reason.group(1).strip() if reason else _short(e)
        raise MxcError(f"{path}: not a valid PyTorch checkpoint: {reason}") from None
    except Exception as e:  # torch.load reports malformed files with many exception types
        raise MxcError(f"{path}: not a valid PyTorch checkpoint: {_short(e)}") from None
    if not isinstance(state, dict):
        raise MxcError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str):
            raise MxcError(f"{path}: entry {name!r} has a {type(name).__name__} key, expected a tensor name (str)")
        if not isinstance(value, torch.Tensor):
            raise MxcError(f"{path}: entry {name!r} is a {type(value).__name__}, expected a tensor")
        kind = _not_dense(value)
        if kind:
            raise MxcError(f"{path}: entry {name!r} is a {kind} tensor, expected a dense tensor of its values; save "
                           f"the checkpoint again with dense tensors")
    return state


def _not_dense(t: torch.Tensor) -> str | None:
    """What kind of tensor ``t`` is where it is not a plain dense one with its values (weights_only loading gives
    meta, sparse, nested and quantized tensors too), else None."""
    if t.is_meta:
        return "meta (no data)"
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return f"sparse ({str(t.layout).removeprefix('torch.')})"
    if t.is_quantized:
        return f"quantized ({str(t.dtype).removeprefix('torch.')})"
    return None


def _read_index(path: Path) -> dict[str, Path]:
    """Parse a sharded-checkpoint index into name -> shard path, checking every shard is a file of the checkpoint."""
    index = read_json(path, "a shard index", "the checkpoint's index is missing")
    if not isinstance(index, dict) or "weight_map" not in index:
        raise MxcError(f"{path}: expected a JSON object with a 'weight_map' field")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise MxcError(f"{path}: 'weight_map' must map tensor names to file names")
    result = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise MxcError(f"{path}: weight_map entry {name!r} is {file!r}, expected a file name")
        rel = PurePosixPath(file)  # a cache snapshot's shards are symlinks out of it: the name is checked, not them
        if rel.is_absolute() or ".." in rel.parts:
            raise MxcError(f"{path}: weight_map entry {name!r} is {file!r}: it must name a file inside the checkpoint "
                           f"directory")
        shard = path.parent / file
        why = not_a_file(shard)
        if why == "does not exist":
            raise MxcError(f"{path}: weight_map entry {name!r} points at missing file {shard}")
        if why is not None:
            raise MxcError(f"{path}: weight_map entry {name!r} points at {shard}, which {why}")
        result[name] = shard
    return result


class Checkpoint:
    """The tensors of one checkpoint directory, read lazily one at a time."""

    def __init__(self, directory: Path, name_to_file: dict[str, Path]):
        self.directory = directory
        self._where = name_to_file
        self.files: list[Path] = sorted(set(name_to_file.values()))
        self._handles: dict[Path, object] = {}
        self._offsets: dict[Path, dict[str, tuple[int, int]]] = {}
        self._bin: tuple[Path, dict[str, torch.Tensor]] | None = None
        self.unindexed: dict[str, Path] = {}  # tensors in a shard that the index does not list (a stale index)
        self.index: Path | None = None

    # -- internals ---------------------------------------------------------
    def _file(self, name: str) -> Path:
        try:
            return self._where[name]
        except KeyError:
            raise MxcError(f"tensor {name!r} not found in checkpoint {self.directory}") from None

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _open_safetensors(path)
        return self._handles[path]

    def _bin_state(self, path: Path) -> dict[str, torch.Tensor]:
        if self._bin is None or self._bin[0] != path:
            self._bin = None  # drop the previous shard before loading the next
            self._bin = (path, _load_bin(path))
        return self._bin[1]

    def _bin_tensor(self, name: str, path: Path) -> torch.Tensor:
        state = self._bin_state(path)
        if name not in state:
            raise MxcError(f"{path}: tensor {name!r} listed in the index is not in the file")
        return state[name]

    # -- public API --------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        path = self._file(name)
        if path.suffix == ".safetensors":
            return tuple(self._handle(path).get_slice(name).get_shape())
        return tuple(self._bin_tensor(name, path).shape)

    def dtype(self, name: str) -> torch.dtype:
        path = self._file(name)
        if path.suffix == ".safetensors":
            code = self._handle(path).get_slice(name).get_dtype()
            if code not in SAFETENSORS_DTYPES:
                raise MxcError(f"{path}: tensor {name!r} has unsupported dtype {code}")
            return SAFETENSORS_DTYPES[code]
        return self._bin_tensor(name, path).dtype

    def get(self, name: str) -> torch.Tensor:
        path = self._file(name)
        if path.suffix == ".safetensors":
            if path not in self._offsets:
                self._offsets[path] = _tensor_offsets(path)
            span = self._offsets[path].get(name)
            if span is None:
                raise MxcError(f"{path}: tensor {name!r} is no longer in the file; was it replaced during the build? "
                               f"build again")
            return _read_tensor(path, name, span, self.dtype(name), self.shape(name))
        return self._bin_tensor(name, path)

    def close(self) -> None:
        self._handles.clear()
        self._offsets.clear()
        self._bin = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safetensors_checkpoint(directory: Path, files: list[Path], index: Path | None = None) -> Checkpoint:
    """Open every safetensors file up front (header only) so corrupt shards fail early."""
    if index is not None:
        where = _read_index(index)
        handles = {path: _open_safetensors(path) for path in sorted(set(where.values()))}
        present = {path: set(handle.keys()) for path, handle in handles.items()}
        for name, path in where.items():
            if name not in present[path]:
                raise MxcError(f"{path}: tensor {name!r} listed in {index.name} is not in the file")
    else:
        where = {}
        handles = {path: _open_safetensors(path) for path in files}
        for path, handle in handles.items():
            for name in handle.keys():
                if name in where:
                    raise MxcError(f"{path}: tensor {name!r} also appears in {where[name]}")
                where[name] = path
    ckpt = Checkpoint(directory, where)
    ckpt._handles.update(handles)
    if index is not None:
        ckpt.index = index
        ckpt.unindexed = {name: path for path, names in present.items() for name in names if name not in where}
    return ckpt


def _present(path: Path) -> bool:
    """Whether the checkpoint has the file ``path`` names; where the name is something else (a broken symlink, an
    interrupted download's; a directory; a FIFO), a one-line error says what, rather than passing it over."""
    why = not_a_file(path)
    if why is not None and why != "does not exist":
        raise MxcError(f"{path}: {why}; expected the checkpoint's {'index' if path.suffix == '.json' else 'weights'} "
                       f"there (download it again, or remove it)")
    return why is None


def open_checkpoint(directory) -> Checkpoint:
    """Find the weight files in ``directory`` and return a lazily-reading ``Checkpoint``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MxcError(f"{directory}: checkpoint directory does not exist")
    st_index = directory / "model.safetensors.index.json"
    bin_index = directory / "pytorch_model.bin.index.json"
    single_bin = directory / "pytorch_model.bin"
    if _present(st_index):
        return _safetensors_checkpoint(directory, [], index=st_index)
    if _present(directory / "model.safetensors"):
        return _safetensors_checkpoint(directory, [directory / "model.safetensors"])
    others = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if others:
        return _safetensors_checkpoint(directory, others)
    if _present(bin_index):
        return Checkpoint(directory, _read_index(bin_index))
    if _present(single_bin):
        state = _load_bin(single_bin)
        ckpt = Checkpoint(directory, {name: single_bin for name in state})
        ckpt._bin = (single_bin, state)
        return ckpt
    raise MxcError(f"{directory}: no checkpoint found; expected one of {_EXPECTED}")
