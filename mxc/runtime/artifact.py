"""Loading an artifact: verify the manifest and every file, then build a Model.

``load(path, device)`` refuses, with a one-line message, an artifact whose
schema or mxc version this runtime cannot read, whose manifest names files
outside the artifact, whose files were modified, added or removed (sha256 from
the manifest), or whose rank count does not match; a --target cuda artifact
needs a GPU (``check_target_device``; ``check_generate_device`` checks
``mxc generate --device`` and says so in the command line's words). The
generated program is executed from the verified bytes (an artifact is code
plus data: load only artifacts you trust, as with any model format that
carries code). No compilation happens here.

The files are read one after another, by path: a rebuild in place (``mxc build
--out`` on the same directory swaps the new artifact in by rename) that lands
while they are read is refused in one line (``_same_build``) rather
than pairing one build's program with the other's weights, and the ranks of a
tensor-parallel artifact check that they all loaded the same build
(``_check_ranks_agree``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import posixpath
import types
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open

import mxc
from mxc.artifact_format import (SCHEMA_VERSION, WEIGHT_DTYPES, chunk_count, listed_files, manifest_digest,
                                 sha256_file)
from mxc.errors import MxcError, size_text, typed_line
from mxc.runtime.model import Model, on_device


def _compatible(version: str) -> bool:
    return version.split(".")[:2] == mxc.__version__.split(".")[:2]


def read_manifest(path: Path) -> dict:
    """The checked manifest of the artifact directory ``path``, or a one-line error saying what is wrong."""
    if path.is_file():
        hint = " (give the folder that holds it)" if path.name == "manifest.json" else ""
        raise MxcError(f"{path}: a file, not an artifact directory{hint}")
    if not path.is_dir():
        raise MxcError(f"{path}: no such artifact directory")
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise MxcError(f"{path}: not an mxc artifact (no manifest.json); build one with `mxc build`")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise MxcError(f"{mpath}: corrupt (not valid JSON: {e.msg} at line {e.lineno}); rebuild the artifact") from None
    except UnicodeDecodeError as e:
        raise MxcError(f"{mpath}: corrupt (not UTF-8 text: {e.reason} at byte {e.start}); rebuild the artifact") from None
    except (ValueError, RecursionError) as e:  # JSON the parser gives up on: nested too deep, a number too long
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise MxcError(f"{mpath}: corrupt (not JSON mxc can read: {why}); rebuild the artifact") from None
    if not isinstance(manifest, dict):
        raise MxcError(f"{mpath}: corrupt (expected a JSON object); rebuild the artifact")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise MxcError(f"{mpath}: artifact schema {manifest.get('schema_version')} is not readable by this mxc "
                       f"(schema {SCHEMA_VERSION}); rebuild it with mxc {mxc.__version__}")
    if not isinstance(manifest.get("mxc_version"), str):
        raise MxcError(f"{mpath}: field mxc_version: expected the version string of the mxc that built it; the "
                       f"manifest was edited or damaged, rebuild the artifact")
    if not _compatible(manifest["mxc_version"]):
        raise MxcError(f"{mpath}: built by mxc {manifest.get('mxc_version')}, incompatible with mxc "
                       f"{mxc.__version__}; rebuild it, or load it with mxc {manifest.get('mxc_version')}")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):  # cheap: checked whatever `verify` says
        raise MxcError(f"{mpath}: edited since the build (its contents do not match its manifest_sha256); rebuild "
                       f"the artifact")
    _check_manifest_fields(mpath, manifest)
    return manifest


def _check_manifest_fields(mpath: Path, manifest: dict) -> None:
    """The fields the runtime reads, with their types: a hand-edited manifest fails here, not in a traceback."""
    def bad(field: str, expected: str):
        raise MxcError(f"{mpath}: field {field}: expected {expected}; the manifest was edited or damaged, rebuild "
                       f"the artifact")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    files = manifest.get("files")
    if (not isinstance(files, dict) or "code/forward.py" not in files
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        bad("files", "an object of path -> sha256 holding code/forward.py")
    outside = next((k for k in files if not _inside(k)), None)
    if outside is not None:  # the verifier would hash (and report on) a file that is not the artifact's
        bad("files", f"paths inside the artifact, not {outside!r}")
    chunks = manifest.get("file_chunks", {"chunk_bytes": 1, "sha256": {}})  # optional (artifacts before it lack it)
    if not (isinstance(chunks, dict) and is_int(chunks.get("chunk_bytes")) and chunks["chunk_bytes"] > 0
            and isinstance(chunks.get("sha256"), dict)
            and all(rel in files and isinstance(pieces, list) and pieces and all(isinstance(d, str) for d in pieces)
                    for rel, pieces in chunks["sha256"].items())):
        bad("file_chunks", "an object of chunk_bytes (a positive integer) and sha256 (listed path -> its pieces' "
                           "sha256)")
    tp = manifest.get("tp", 1)
    if not is_int(tp) or tp < 1:
        bad("tp", "a positive integer")
    missing = [f"weights/rank{r}.safetensors" for r in range(tp) if f"weights/rank{r}.safetensors" not in files]
    if missing:
        bad("tp", f"as many ranks as the artifact has weight files (no {missing[0]} for tp={tp})")
    for section in ("runtime", "options"):
        if not isinstance(manifest.get(section), dict):
            bad(section, "an object")
    runtime = manifest["runtime"]
    if not is_int(runtime.get("vocab_size")) or runtime["vocab_size"] < 1:
        bad("runtime.vocab_size", "a positive integer")
    eos = runtime.get("eos_token_id")
    if not isinstance(eos, list) or not all(is_int(t) for t in eos):
        bad("runtime.eos_token_id", "a list of token ids")
    pad = runtime.get("pad_token_id")
    if pad is not None and not (is_int(pad) and 0 <= pad < runtime["vocab_size"]):
        bad("runtime.pad_token_id", "null or a token id below vocab_size")
    if runtime.get("dtype") not in ("float32", "bfloat16", "float16"):
        bad("runtime.dtype", "float32, bfloat16 or float16")
    kv = runtime.get("kv_cache", "absent")
    if kv is not None and not (isinstance(kv, dict) and all(is_int(kv.get(k)) and kv[k] > 0
                                                            for k in ("layers", "kv_heads", "head_dim"))):
        bad("runtime.kv_cache", "null or an object of positive layers, kv_heads and head_dim")
    layers = runtime.get("layers")
    if layers is not None and not (isinstance(layers, dict) and is_int(layers.get("count")) and layers["count"] > 0
                                   and isinstance(layers.get("index"), str) and isinstance(layers.get("prefix"), str)
                                   and "{" + layers["index"] + "}" in layers["prefix"]):
        bad("runtime.layers", "null or an object of a positive count, an index name and a prefix holding {index}")
    target, options = manifest.get("target"), manifest["options"]
    if not isinstance(target, dict) or target.get("name") not in ("cpu", "cuda"):
        bad("target", 'an object whose name is "cpu" or "cuda"')
    if target["name"] == "cuda" and not isinstance(target.get("arch"), str):
        bad("target.arch", 'the GPU architecture the kernels were compiled for, such as "sm_90"')
    if options.get("target") != target["name"]:
        bad("options.target", f"{target['name']!r}, as target.name")
    if options.get("dtype") != runtime["dtype"]:
        bad("options.dtype", f"{runtime['dtype']!r}, as runtime.dtype")
    for name in ("max_batch", "max_seq_len"):  # every build records them; a cuda artifact's cache needs them
        if (target["name"] == "cuda" or name in options) and not (is_int(options.get(name)) and options[name] > 0):
            bad(f"options.{name}", "a positive integer")
    tokens = options.get("prefill_graph_tokens", 0)  # a cuda artifact's prompt graphs (and `mxc inspect`) size by it
    if not (is_int(tokens) and tokens >= 0):
        bad("options.prefill_graph_tokens", "a token count >= 0 (0: no prefill graphs)")
    # what `mxc inspect` shows
    for name in ("model_file", "family", "ir_sha256"):
        if not isinstance(manifest.get(name), str):
            bad(name, "a string")
    if manifest.get("architecture") is not None and not isinstance(manifest["architecture"], str):
        bad("architecture", "a string, or null (a model file built from a config.json naming no architectures)")
    if not isinstance(manifest.get("config"), dict) or not isinstance(manifest["config"].get("rope", {}), dict):
        bad("config", "an object, its rope an object")
    source = manifest.get("source")
    if not isinstance(source, dict) or "weights" not in source or "checkpoint" not in source:
        bad("source", "an object with weights and checkpoint")
    for name in ("cutlass", "mlp_pair"):  # a library the runtime loads: one of the verified files
        library = manifest[name].get("library") if isinstance(manifest.get(name), dict) else None
        if name in manifest and not (isinstance(library, str) and library in files):
            bad(f"{name}.library", "one of the files the manifest lists")

    def is_choice(k) -> bool:  # one kernel name (or none), or [[up to N tokens or null, name], ...]
        return k is None or isinstance(k, str) or isinstance(k, list) and all(
            isinstance(b, list) and len(b) == 2 and (b[0] is None or is_int(b[0])) and isinstance(b[1], str) for b in k)

    kernels = manifest.get("kernels")
    if not isinstance(kernels, list) or not all(isinstance(r, dict) and "kernel" in r and is_choice(r["kernel"])
                                                for r in kernels):
        bad("kernels", "a list of the nodes' kernel choices")


def _inside(rel: str) -> bool:
    """Whether the manifest's file path ``rel`` names a file inside the artifact: relative, and not out of it
    through ``..`` once normalised."""
    norm = posixpath.normpath(rel)
    return bool(rel) and not posixpath.isabs(norm) and norm != ".." and not norm.startswith("../")


def _device(name, flags: bool = False) -> torch.device:
    """``load``'s ``device`` (or, with ``flags``, ``--device``, and the errors say so): cpu, or a CUDA device this
    machine has (``cuda`` is the current one; an integer N is cuda:N, as torch.device(N) is where CUDA is the
    accelerator)."""
    arg = f"--device {name}" if flags else f"device={name!r}" if isinstance(name, str) else f"device={name}"
    if isinstance(name, int) and not isinstance(name, bool):  # True stays as it is: torch.device refuses it below
        name = f"cuda:{name}"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise MxcError(f"{arg}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")  # cpu:0 is the one CPU device
    if device.type != "cuda":
        raise MxcError(f"{arg}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        cpu = "--device cpu" if flags else "device='cpu'"
        raise MxcError(f"{arg}: no CUDA GPU is usable here (torch.cuda.is_available() is false); use {cpu}")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise MxcError(f"{arg}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def check_rank_devices(name: str, world_size: int, path) -> None:
    """Before a tensor-parallel command starts its ranks (one GPU each, ``cuda:0`` to ``cuda:N-1``): ``--device``
    names cpu or cuda, and the machine has the GPUs."""
    device = _device(name, flags=True)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise MxcError(f"{path}: built for --tp {world_size}, whose ranks take one GPU each; this machine has "
                       f"{torch.cuda.device_count()} (use --device cpu, or rebuild with a smaller --tp)")


def check_target_device(path, manifest: dict, device: torch.device, fix: str = "load it with device='cuda'") -> None:
    """A --target cuda artifact runs on a GPU only: a one-line error otherwise, ``fix`` saying how in the caller's
    words (the Python API's, or the command line's)."""
    if manifest["target"]["name"] == "cuda" and device.type != "cuda":
        raise MxcError(f"{path}: built for --target cuda; {fix} (or rebuild with --target cpu)")


def _check_cuda_usable(path, manifest: dict, verb: str) -> None:
    if manifest["target"]["name"] == "cuda" and not torch.cuda.is_available():
        raise MxcError(f"{path}: built for --target cuda, and no CUDA GPU is usable here (torch.cuda.is_available() "
                       f"is false); {verb} it on a machine with one, or rebuild with --target cpu")


def default_device(manifest: dict) -> str:
    """Where an artifact runs unless told otherwise: its target's device (the current GPU for --target cuda)."""
    return "cuda" if manifest["target"]["name"] == "cuda" else "cpu"


def check_generate_device(name: str, manifest: dict, path) -> None:
    """``mxc generate --device NAME``, checked before anything loads (and before a tensor-parallel artifact's
    ranks start): a device this machine has, a GPU for a --target cuda artifact, and one GPU a rank."""
    _check_cuda_usable(path, manifest, "run")  # --device cpu would not do either
    check_target_device(path, manifest, _device(name, flags=True), "run it with --device cuda")
    check_rank_devices(name, manifest.get("tp", 1), path)


HASH_READ_BYTES = 1 << 20


def verify_files(path: Path, manifest: dict, hashes: bool = True, rank: int | None = None,
                 world_size: int = 1) -> None:
    """The artifact's files are the manifest's: none extra, none missing, and (``hashes``) each as built: every file
    by its sha256, or by its pieces' (``file_chunks``), hashed on every core at once. Given ``rank``, of the
    weight files only that rank's is hashed: the process of each rank hashes its own (and they check they loaded
    one build), not all tp of them tp times over, each on its share of the cores (``world_size`` processes)."""
    expected = manifest.get("files", {})
    present = set(listed_files(path))
    extra = sorted(present - set(expected))
    if extra:
        raise MxcError(f"{path}: file {_shown(extra[0])} is not part of the artifact (not in manifest.json); "
                       f"remove it or rebuild")
    for rel in expected:
        if not (path / rel).is_file():
            raise MxcError(f"{path}: {_shown(rel)} is missing; the artifact is incomplete, rebuild it")
    if not hashes:
        return
    chunks = manifest.get("file_chunks", {"chunk_bytes": 1, "sha256": {}})
    size = chunks["chunk_bytes"]
    others = {f"weights/rank{r}.safetensors" for r in range(manifest.get("tp", 1)) if r != rank} if rank is not None \
        else set()
    work = []  # (file, start, length or None: to its end, sha256)
    for rel, digest in expected.items():
        if rel in others:
            continue
        pieces = chunks["sha256"].get(rel)
        if pieces is None:
            work.append((rel, 0, None, digest))
        elif chunk_count((path / rel).stat().st_size, size) != len(pieces):
            _modified(path, rel)
        else:
            work += [(rel, i * size, size, piece) for i, piece in enumerate(pieces)]
    # each thread reads HASH_READ_BYTES at a time: 32 threads reading sha256_file's 16 MiB held 512 MiB, in every
    # rank's process of a tensor-parallel load
    threads = min(32, max(1, (os.cpu_count() or 1) // world_size), max(1, len(work)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        same = list(pool.map(
            lambda w: sha256_file(path / w[0], chunk=HASH_READ_BYTES, start=w[1], length=w[2]) == w[3], work))
    if not all(same):
        _modified(path, work[same.index(False)][0])


def _modified(path: Path, rel: str):
    raise MxcError(f"{path}: {_shown(rel)} was modified since the build (sha256 mismatch); rebuild the artifact")


def _shown(rel: str) -> str:
    """A file's relative path as an error shows it: quoted where it holds a newline or another unprintable
    character, so that the message stays one line."""
    return rel if rel.isprintable() else repr(rel)


def _exec_program(path: Path, digest: str) -> types.ModuleType:
    source = path.read_bytes()
    if hashlib.sha256(source).hexdigest() != digest:  # re-check the bytes we execute
        raise MxcError(f"{path}: does not match the sha256 the manifest records for it (modified since the build); "
                       f"rebuild the artifact")
    try:
        code = compile(source, str(path), "exec")
    except (SyntaxError, ValueError) as e:  # a manifest re-signed over another program (ValueError: null bytes)
        raise MxcError(f"{path}: not a Python program ({typed_line(e)}); the artifact was "
                       f"written by another tool or damaged, rebuild it") from None
    module = types.ModuleType(f"mxc_artifact_{digest[:12]}")
    module.__file__ = str(path)
    exec(code, module.__dict__)
    if not callable(getattr(module, "forward", None)):
        raise MxcError(f"{path}: defines no forward function; the artifact was written by another tool or damaged, "
                       f"rebuild it")
    return module


def _kernel_launcher(path: Path, manifest: dict, device: torch.device, rebuild_kernels: bool):
    """The launcher for a cuda artifact: its precompiled cubins, or Triton's JIT when asked to rebuild."""
    target = manifest["target"]
    if target["name"] != "cuda":
        return None
    check_target_device(path, manifest, device)
    major, minor = torch.cuda.get_device_capability(device)
    here = f"sm_{major}{minor}"
    if rebuild_kernels:
        from mxc.kernels.launch import jit_launch

        return jit_launch
    if here != target["arch"]:
        raise MxcError(f"{path}: kernels were compiled for {target['arch']}, this GPU is {here}; rebuild with "
                       f"`mxc build --target cuda` for it, or load with rebuild_kernels=True to JIT them here")
    from mxc.runtime.cuda_launch import CubinLauncher

    return CubinLauncher(path / "code" / "kernels", pdl=manifest["options"].get("pdl", False))


def load(path, device: str | None = None, rank: int = 0, world_size: int = 1, verify: bool = True,
         rebuild_kernels: bool = False) -> Model:
    """Load the artifact at ``path`` onto ``device``.

    ``device`` is "cpu", "cuda" (the current GPU), "cuda:N", a torch.device, or an
    integer N for cuda:N (as torch.device(N) is on a CUDA machine); None (the default) is
    the artifact's target's: "cuda" for a --target cuda artifact, else "cpu".
    A cuda artifact runs its precompiled kernels (nothing is compiled at load);
    ``rebuild_kernels=True`` JIT-compiles them with the local Triton instead,
    e.g. on a GPU of another architecture. A tensor-parallel artifact (``tp`` > 1)
    loads in each process of an initialised default process group of ``tp`` ranks,
    ``rank`` being the process's own; the ranks check that they loaded the same build. ``verify=False`` skips
    hashing the weights and kernels (seconds for a large model) against the manifest; the manifest itself,
    the program it executes and the names, shapes and dtypes of the weights are checked either way, and a
    damaged weight value then gives wrong results, not an error. An artifact rebuilt in place while it loads
    is refused: load it again.
    """
    path = _artifact_path(path)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise MxcError(f"{name} must be an integer, got {value!r}")
    manifest = read_manifest(path)
    build = _build_id(path, manifest["manifest_sha256"])
    tp = manifest.get("tp", 1)
    if world_size != tp:
        raise MxcError(f"{path}: built for tp={tp}, but loaded with world_size={world_size}")
    if not 0 <= rank < world_size:
        raise MxcError(f"{path}: rank {rank} is out of range for world_size={world_size}")
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise MxcError(f"{path}: a tp={tp} artifact needs torch.distributed initialised with {tp} ranks in "
                           f"every process (or use `mxc generate`, which starts them)")
        if dist.get_rank() != rank:  # another rank's shards: the collectives would sum the wrong slices
            raise MxcError(f"{path}: loaded as rank {rank}, but this process is rank {dist.get_rank()} of the "
                           f"process group; pass rank=torch.distributed.get_rank()")
    if device is None:
        _check_cuda_usable(path, manifest, "load")
        device = default_device(manifest)
    device = _device(device)
    with on_device(device):  # kernels load into, and graphs capture on, the model's GPU, whichever is current
        with _same_build(path, build):  # every file read is this manifest's build's
            program, launcher, weights = _read_files(path, manifest, device, rank, verify, rebuild_kernels)
        if world_size > 1:
            _check_ranks_agree(path, manifest["manifest_sha256"])
        return Model(program.forward, weights, manifest, device, path, launcher, rank=rank, world_size=world_size)


def _artifact_path(path) -> Path:
    """``load``'s ``path`` as a Path: a str or os.PathLike, not empty (Path("") would be the current directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise MxcError(f"path must be an artifact directory (str or Path), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise MxcError(f"path must be an artifact directory (str or Path), got a {type(path).__name__} of bytes")
    if not text.strip():
        raise MxcError(f"path {text!r}: empty; give the artifact directory")
    return Path(text)


def _read_files(path: Path, manifest: dict, device: torch.device, rank: int, verify: bool, rebuild_kernels: bool):
    """Everything ``load`` reads from the artifact after its manifest, by path: its files checked, the program,
    the kernels' launcher, rank ``rank``'s weights and the kernel libraries; (program, launcher, weights)."""
    # verify=False: the files' presence only, no hashing
    verify_files(path, manifest, hashes=verify, rank=rank, world_size=manifest.get("tp", 1))
    program = _exec_program(path / "code" / "forward.py", manifest["files"]["code/forward.py"])
    launcher = _kernel_launcher(path, manifest, device, rebuild_kernels)  # a wrong device or GPU fails first
    weights = _load_weights(path, rank, device, _expected_weights(path, manifest))
    _use_libraries(path, manifest)
    return program, launcher, weights


def _build_id(path: Path, digest) -> tuple | None:
    """Which build is at ``path``: its directory (a rebuild swaps another in by rename, so even a rebuild of the
    same build is told apart) and ``digest``, its manifest's manifest_sha256; None where there is none (mid-swap)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, digest


@contextlib.contextmanager
def _same_build(path: Path, build: tuple | None):
    """The artifact at ``path`` is still ``build`` (``_build_id``, as its manifest was read) when the block ends:
    else the files it read may be another build's, and a one-line error says to load it again, also in place of
    the block's own error (a file of the new build fails as modified, or in a KeyError, and is not)."""
    try:
        yield
    except Exception:
        if _rebuilt(path, build):
            raise MxcError(f"{path}: the artifact was rebuilt while it was being loaded; load it again") from None
        raise
    if _rebuilt(path, build):
        raise MxcError(f"{path}: the artifact was rebuilt while it was being loaded; load it again")


def _rebuilt(path: Path, build: tuple | None) -> bool:
    """Whether the artifact at ``path`` is no longer ``build``: another directory, or another manifest_sha256 (the
    manifest read again: cheap)."""
    try:
        digest = json.loads((path / "manifest.json").read_bytes()).get("manifest_sha256")
    except (OSError, ValueError, AttributeError, RecursionError):  # gone, or half-written, in the middle of a swap
        digest = None
    return build is None or _build_id(path, digest) != build


def _check_ranks_agree(path: Path, digest: str) -> None:
    """Every rank of the default process group loaded the build of manifest_sha256 ``digest``: each reads the
    artifact itself, and a rebuild between them would pair one build's shards with another's. Collective."""
    import torch.distributed as dist

    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)  # gloo or NCCL (on the current device, the model's)
    if len(set(digests)) > 1:
        raise MxcError(f"ranks loaded different artifacts from {path} (it was rebuilt while they started); run again")


def _expected_weights(path: Path, manifest: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of each tensor the program reads from a rank's weight file, by name: the weights of the
    graph the build wrote (graph.yaml, its bytes checked against the manifest's ir_sha256: a small file)."""
    from mxc.ir import load_graph

    file = path / "graph.yaml"
    try:
        text = file.read_bytes()
    except OSError:
        raise MxcError(f"{path}: graph.yaml is missing; the artifact is incomplete, rebuild it") from None
    if hashlib.sha256(text).hexdigest() != manifest["ir_sha256"]:
        raise MxcError(f"{file}: does not match the ir_sha256 the manifest records for it (modified since the build); "
                       f"rebuild the artifact")
    try:  # the build's graph, by its hash; one that is not (a manifest re-signed over it) is named, not a traceback
        return {w.name: (WEIGHT_DTYPES[w.dtype], tuple(w.shape)) for w in load_graph(text.decode()).all_weights()}
    except (yaml.YAMLError, LookupError, TypeError, ValueError, AttributeError, SyntaxError, StopIteration,
            RecursionError) as e:
        raise MxcError(f"{file}: not a graph this mxc can read ({typed_line(e)}); the artifact "
                       f"was written by another tool or damaged, rebuild it") from None


def _load_weights(path: Path, rank: int, device: torch.device,
                  expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights on ``device``, the tensors ``expected`` (``_expected_weights``) by name, dtype and
    shape; on a GPU, a one-line error first if they cannot fit its free memory."""
    file = path / "weights" / f"rank{rank}.safetensors"
    if device.type == "cuda":
        _check_weights_fit(path, rank, file.stat().st_size, device)
    try:
        with safe_open(file, framework="pt", device=str(device)) as f:
            _check_weight_names(file, set(f.keys()), expected)  # before any tensor is read
            weights = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:  # damaged after the build, loaded with verify=False (verify=True says which file)
        raise MxcError(f"{file}: not a readable safetensors file ({e}); the artifact is damaged, rebuild it") from None
    for name, t in weights.items():
        if (t.dtype, tuple(t.shape)) != expected[name]:
            dtype, shape = expected[name]
            raise MxcError(f"{file}: tensor {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, the "
                           f"program expects {str(dtype).removeprefix('torch.')} {list(shape)}; the artifact is "
                           f"damaged, rebuild it")
    return weights


def _check_weight_names(file: Path, names: set[str], expected: dict) -> None:
    """A weight file holds the tensors the program reads, no more, no fewer: else one line names the first missing
    (or unexpected) one, where the program would fail on it in a KeyError."""
    missing = sorted(set(expected) - names)
    if missing:
        raise MxcError(f"{file}: has no tensor {missing[0]}, which the program reads; the artifact is damaged, "
                       f"rebuild it")
    extra = sorted(names - set(expected))
    if extra:
        raise MxcError(f"{file}: tensor {extra[0]} is not one the program reads; the artifact is damaged, rebuild it")


def _check_weights_fit(path: Path, rank: int, nbytes: int, device: torch.device) -> None:
    """``nbytes`` of weights fit the free memory of GPU ``device``, or a one-line error says what would make them."""
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise MxcError(f"{path}: rank {rank}'s weights take {size_text(nbytes)}, more than the {size_text(free)} "
                       f"free on {device}; free the GPU, or rebuild with --quant fp8 or a larger --tp")


def _use_libraries(path: Path, manifest: dict) -> None:
    """Open the kernel libraries the build compiled, if any."""
    if manifest.get("cutlass"):  # the CUTLASS fp8 GEMM the build compiled (mxc.kernels.cutlass_fp8)
        from mxc.kernels import cutlass_fp8

        cutlass_fp8.use(path / manifest["cutlass"]["library"])
    if manifest.get("mlp_pair"):  # the persistent fp8 MLP kernel (--mlp-pair; mxc.kernels.mlp_pair_fp8)
        from mxc.kernels import mlp_pair_fp8

        mlp_pair_fp8.use(path / manifest["mlp_pair"]["library"])
