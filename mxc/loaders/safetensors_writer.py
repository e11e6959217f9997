"""A streaming safetensors writer whose peak memory is one tensor (and the one written before it, where that is at most
``_OVERLAP_BYTES``, while its hashing finishes).

The model builder knows the final dtype and shape of every output tensor before
it reads any weight data, so this module owns writing the safetensors header
first (offsets laid out in the order the specs are given, data starting 8-byte
aligned) and then each tensor's bytes at its precomputed offset, one tensor at
a time and in any order. It checks every tensor against its spec and refuses to
close a file with tensors missing, raising one-line ``MxcError``s that name the
file and tensor. Written in header order, the file's sha256 (and each 64 MiB piece's: ``chunk_digests``) is
computed as it is written (``digest``), which spares the build a second pass over tens of GB.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import math
import struct
from pathlib import Path

import torch

from mxc.artifact_format import ChunkHasher
from mxc.errors import MxcError, size_text

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def tensor_bytes(dtype: torch.dtype, shape) -> int:
    """Bytes of a tensor's data in the file (what the header's data_offsets span)."""
    return dtype.itemsize * math.prod(int(d) for d in shape)


# A tensor up to this size may still be hashed after ``write`` returns (beside the next tensor's conversion): the writer
# then holds it, so a build's peak memory grows by at most this much
_OVERLAP_BYTES = 256 << 20


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor against a header fixed up front."""

    def __init__(self, path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._offsets: dict[str, int] = {}
        header: dict[str, object] = {}
        if metadata:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise MxcError(f"{self.path}: safetensors metadata must map str to str")
            header["__metadata__"] = dict(metadata)
        offset = 0
        for name, (dtype, shape) in specs.items():
            if dtype not in DTYPE_CODES:
                raise MxcError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            shape = tuple(int(d) for d in shape)
            size = tensor_bytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._specs[name] = (dtype, shape)
            self._offsets[name] = offset
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-(8 + len(encoded)) % 8)  # tensor data starts 8-byte aligned
        self._data_start = 8 + len(encoded)
        self._written: set[str] = set()
        self._size = offset
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)
        self._hash = hashlib.sha256(struct.pack("<Q", len(encoded)) + encoded)  # None once out of order
        # the whole file's sha256 and each piece's (``chunk_digests``) on two threads of their own: hashlib lets go of
        # the GIL, so a tensor's hashing overlaps the next one's conversion (``_OVERLAP_BYTES``)
        self._pieces = ChunkHasher()
        self._pieces.update(struct.pack("<Q", len(encoded)) + encoded)
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mxc-hash") for _ in range(2)]
        self._pending: list[concurrent.futures.Future] = []
        self._hashed = 0  # data bytes hashed so far

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes at its offset; it must match its spec exactly. A tensor of at most
        ``_OVERLAP_BYTES`` may still be hashed once this returns: leave it unmodified until the next write or close."""
        if name not in self._specs:
            raise MxcError(f"{self.path}: tensor {name!r} is not in the header specs")
        if name in self._written:
            raise MxcError(f"{self.path}: tensor {name!r} was already written")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype:
            raise MxcError(f"{self.path}: tensor {name!r} expected dtype {dtype}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise MxcError(f"{self.path}: tensor {name!r} expected shape {list(shape)}, "
                           f"got {list(tensor.shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        try:
            self._file.seek(self._data_start + self._offsets[name])  # flushes what earlier writes left buffered
            if data.numel():
                self._file.write(memoryview(data.numpy()))
        except OSError as e:
            self._too_large(e, f"at tensor {name!r}")
            raise
        if self._hash is not None and self._offsets[name] == self._hashed:
            if data.numel():
                self._drain()  # the tensor before: its hashing ran beside this one's conversion
                view = data.numpy()  # holds the tensor alive until hashed
                self._pending = [self._pools[0].submit(self._hash.update, view),
                                 self._pools[1].submit(self._pieces.update, view)]
                if data.numel() > _OVERLAP_BYTES:  # a large tensor is not held past write: peak memory stays one
                    self._drain()
            self._hashed += data.numel()
        else:
            self._hash = None
        self._written.add(name)

    def _too_large(self, e: OSError, where: str) -> None:
        """EFBIG (a file past its filesystem's largest or ``ulimit -f``) as a one-line ``MxcError``; ENOSPC and EDQUOT
        stay OSErrors: the build says how much room its weights take."""
        if e.errno == errno.EFBIG:
            size = size_text(self._data_start + self._size)
            raise MxcError(f"{self.path}: {size}: larger than its filesystem or the file size limit (ulimit -f) "
                           f"allows (File too large {where}); write it to another filesystem (FAT32 holds at most "
                           f"4 GiB a file) or raise the limit") from None

    @property
    def digest(self) -> str | None:
        """sha256 of the whole file once every tensor was written in header order, else None."""
        return self._hash.hexdigest() if self._hashed_whole() else None

    @property
    def chunk_digests(self) -> list[str] | None:
        """sha256 of each ``artifact_format.CHUNK_BYTES`` piece of the file, as ``digest`` (else None)."""
        return self._pieces.pieces() if self._hashed_whole() else None

    def _drain(self) -> None:
        """Wait for the hashing of the tensor written last."""
        for f in self._pending:
            f.result()
        self._pending = []

    def _shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(cancel_futures=True)

    def _hashed_whole(self) -> bool:
        return self._hash is not None and self._hashed == self._size and self._file.closed

    def missing(self) -> list[str]:
        """Names from the specs not yet written, in header order."""
        return [name for name in self._specs if name not in self._written]

    def close(self) -> None:
        """Close the file; raise if any tensor was never written."""
        if self._file.closed:
            return
        try:
            self._drain()
        finally:
            self._shutdown()
        try:
            self._file.close()
        except OSError as e:
            self._hash = None  # its last bytes are not in the file
            self._too_large(e, "writing its last bytes")
            raise
        missing = self.missing()
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise MxcError(f"{self.path}: {len(missing)} tensor(s) never written: {shown}{more}")

    def abort(self) -> None:
        """Close the file without the completeness check (the caller deletes it). Never raises: the buffered bytes it
        cannot flush (the disk that failed the write is still full) are of a file that goes, and an OSError here
        took the place of the error being handled (an ``MxcError`` became a traceback) and left the other ranks'
        files open."""
        self._shutdown()
        try:
            self._file.close()
        except OSError:
            pass

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
