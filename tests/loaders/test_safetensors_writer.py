"""Tests for the streaming safetensors writer."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mxc.errors import MxcError
from mxc.loaders.safetensors_writer import SafetensorsWriter

ROOT = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    return {
        "f32": base,
        "f16": base.half(),
        "bf16": base.to(torch.bfloat16),
        "e4m3": base.to(torch.float8_e4m3fn),
        "e5m2": base.to(torch.float8_e5m2),
        "i64": torch.arange(7, dtype=torch.int64),
        "i32": torch.arange(-3, 3, dtype=torch.int32).reshape(2, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _specs(tensors):
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def test_round_trip_all_dtypes_bit_exact(tmp_path):
    tensors = _sample()
    path = tmp_path / "out.safetensors"
    with SafetensorsWriter(path, _specs(tensors), metadata={"format": "pt", "mxc": "1"}) as w:
        for name, t in tensors.items():
            w.write(name, t)
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(_bits(loaded[name]), _bits(t)), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "mxc": "1"}
        assert f.get_slice("bf16").get_dtype() == "BF16"
        assert f.get_slice("e4m3").get_dtype() == "F8_E4M3"
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 8 == 0


def test_out_of_order_writes(tmp_path):
    tensors = _sample()
    path = tmp_path / "out.safetensors"
    with SafetensorsWriter(path, _specs(tensors)) as w:
        for name in reversed(list(tensors)):
            w.write(name, tensors[name])
    loaded = load_file(path)
    for name, t in tensors.items():
        assert torch.equal(_bits(loaded[name]), _bits(t)), name


def test_digest_when_written_in_header_order(tmp_path):
    """In header order (empty tensors included) the file's sha256 comes out of the writing; out of
    order there is none (the builder hashes the file then); none before close."""
    import hashlib

    tensors = _sample()
    path = tmp_path / "in_order.safetensors"
    w = SafetensorsWriter(path, _specs(tensors))
    for name, t in tensors.items():
        w.write(name, t)
    assert w.digest is None  # not closed yet
    w.close()
    assert w.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    w = SafetensorsWriter(tmp_path / "reversed.safetensors", _specs(tensors))
    for name in reversed(list(tensors)):
        w.write(name, tensors[name])
    w.close()
    assert w.digest is None


def test_non_contiguous_input(tmp_path):
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    path = tmp_path / "out.safetensors"
    with SafetensorsWriter(path, {"t": (torch.bfloat16, (4, 3))}) as w:
        w.write("t", t)
    assert torch.equal(load_file(path)["t"], t)


def test_wrong_shape(tmp_path):
    with SafetensorsWriter(tmp_path / "o.safetensors", {"w": (torch.float32, (2, 3))}) as w:
        with pytest.raises(MxcError, match=r"'w'.*expected shape \[2, 3\], got \[3, 2\]"):
            w.write("w", torch.zeros(3, 2))
        w.write("w", torch.zeros(2, 3))


def test_wrong_dtype(tmp_path):
    with SafetensorsWriter(tmp_path / "o.safetensors", {"w": (torch.bfloat16, (2,))}) as w:
        with pytest.raises(MxcError, match=r"'w'.*expected dtype torch.bfloat16, got torch.float32"):
            w.write("w", torch.zeros(2))
        w.write("w", torch.zeros(2, dtype=torch.bfloat16))


def test_unknown_name(tmp_path):
    with SafetensorsWriter(tmp_path / "o.safetensors", {"w": (torch.float32, (1,))}) as w:
        with pytest.raises(MxcError, match=r"o\.safetensors.*'nope' is not in the header"):
            w.write("nope", torch.zeros(1))
        w.write("w", torch.zeros(1))


def test_duplicate_write(tmp_path):
    with SafetensorsWriter(tmp_path / "o.safetensors", {"w": (torch.float32, (1,))}) as w:
        w.write("w", torch.zeros(1))
        with pytest.raises(MxcError, match=r"'w' was already written"):
            w.write("w", torch.ones(1))


def test_missing_tensor_at_close(tmp_path):
    specs = {f"t{i}": (torch.float32, (1,)) for i in range(5)}
    w = SafetensorsWriter(tmp_path / "o.safetensors", specs)
    w.write("t1", torch.zeros(1))
    with pytest.raises(MxcError, match=r"o\.safetensors: 4 tensor\(s\) never written: 't0', 't2', 't3' and 1 more"):
        w.close()


def test_exception_in_context_skips_completeness_check(tmp_path):
    path = tmp_path / "o.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with SafetensorsWriter(path, {"w": (torch.float32, (1,))}):
            raise RuntimeError("boom")
    path.unlink()  # the file was closed, so the caller can delete it


def test_unsupported_dtype(tmp_path):
    with pytest.raises(MxcError, match=r"'c'.*unsupported dtype"):
        SafetensorsWriter(tmp_path / "o.safetensors", {"c": (torch.complex64, (1,))})


def test_round_trip_float64_and_int16(tmp_path):
    tensors = {"f64": torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
               "i16": torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16)}
    path = tmp_path / "out.safetensors"
    with SafetensorsWriter(path, _specs(tensors)) as w:
        for name, t in tensors.items():
            w.write(name, t)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_slice("f64").get_dtype() == "F64" and f.get_slice("i16").get_dtype() == "I16"
    loaded = load_file(path)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_metadata_must_map_str_to_str(tmp_path):
    with pytest.raises(MxcError, match=r"o\.safetensors: safetensors metadata must map str to str"):
        SafetensorsWriter(tmp_path / "o.safetensors", {"w": (torch.float32, (1,))}, metadata={"layers": 2})


def test_missing_tensors_are_named_in_header_order(tmp_path):
    specs = {name: (torch.float32, (1,)) for name in ("zeta", "alpha", "mid")}
    w = SafetensorsWriter(tmp_path / "o.safetensors", specs)
    assert w.missing() == ["zeta", "alpha", "mid"]
    w.write("alpha", torch.zeros(1))
    assert w.missing() == ["zeta", "mid"]
    w.abort()


def test_three_missing_tensors_are_all_named(tmp_path):
    specs = {f"t{i}": (torch.float32, (1,)) for i in range(3)}
    w = SafetensorsWriter(tmp_path / "o.safetensors", specs)
    with pytest.raises(MxcError, match=r"3 tensor\(s\) never written: 't0', 't1', 't2'$"):
        w.close()


def test_no_digest_for_a_file_left_incomplete(tmp_path):
    """Tensors written in header order but not all of them (an aborted build): no digest."""
    specs = {"a": (torch.float32, (2,)), "b": (torch.float32, (2,))}
    w = SafetensorsWriter(tmp_path / "o.safetensors", specs)
    w.write("a", torch.ones(2))
    w.abort()
    assert w.digest is None


def test_close_is_idempotent(tmp_path):
    """A second close (a ``with`` block around an explicit close) neither reopens nor re-raises."""
    w = SafetensorsWriter(tmp_path / "o.safetensors", {"a": (torch.float32, (1,))})
    with pytest.raises(MxcError, match="never written"):
        w.close()
    w.close()
    assert w.digest is None


_PEAK_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from mxc.loaders.safetensors_writer import SafetensorsWriter
    n, numel = 8, 2 * 1024 * 1024          # 8 tensors x 8 MiB float32 = 64 MiB
    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = torch.full((numel,), 1.0); del t    # warm the allocator with one tensor
    base = peak_mib()
    specs = {f"t{i}": (torch.float32, (numel,)) for i in range(n)}
    with SafetensorsWriter(sys.argv[1], specs) as w:
        for i in range(n):
            t = torch.full((numel,), float(i))
            w.write(f"t{i}", t)
            del t
    print(peak_mib() - base)
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs Linux/glibc ru_maxrss and malloc tuning")
def test_peak_memory_is_a_few_tensors(tmp_path):
    # A fixed mmap threshold makes glibc hand freed tensors straight back to the OS,
    # so peak RSS reflects live tensors rather than allocator caching.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    path = tmp_path / "big.safetensors"
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)],
                         capture_output=True, text=True, check=True, env=env)
    growth_mib = float(out.stdout.strip())
    assert growth_mib < 2 * 8, f"peak RSS grew by {growth_mib:.1f} MiB writing 64 MiB"
    assert path.stat().st_size > 64 * 1024 * 1024
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("t7")[0].item() == 7.0


class _FailingClose:
    """A file whose buffered bytes cannot be flushed at close (the disk that failed a write is still full)."""

    closed = False

    def __init__(self, real, code):
        self.real, self.code = real, code

    def close(self):
        import errno

        self.real.close()
        self.closed = True
        raise OSError(getattr(errno, self.code), os.strerror(getattr(errno, self.code)))


def test_abort_never_raises(tmp_path):
    """abort (on the way out of a failed write) swallows the OSError of flushing what the full disk refused: it took
    the place of the error being handled (an MxcError became a traceback) and left the other ranks' files open."""
    w = SafetensorsWriter(tmp_path / "o.safetensors", {"a": (torch.float32, (1,))})
    w._file = _FailingClose(w._file, "ENOSPC")
    w.abort()
    assert w._file.closed


@pytest.mark.parametrize("code", ["EFBIG", "ENOSPC"])
def test_a_file_too_large_at_close_is_one_line(tmp_path, code):
    """EFBIG when close flushes the last bytes (past ``ulimit -f`` or FAT32's 4 GiB) is a one-line MxcError naming the
    file and its size; ENOSPC stays an OSError, which the build turns into its own message with the room needed."""
    w = SafetensorsWriter(tmp_path / "o.safetensors", {"a": (torch.float32, (1,))})
    w.write("a", torch.ones(1))
    w._file = _FailingClose(w._file, code)
    if code == "EFBIG":
        with pytest.raises(MxcError, match=r"o\.safetensors: 0\.1 KiB: larger than its filesystem or the file size "
                                           r"limit \(ulimit -f\) allows \(File too large writing its last bytes\); "
                                           r"write it to another filesystem \(FAT32 holds at most 4 GiB a file\) or "
                                           r"raise the limit$"):
            w.close()
    else:
        with pytest.raises(OSError, match="No space left"):
            w.close()
    assert w.digest is None


def test_hashing_overlaps_only_small_tensors(tmp_path, monkeypatch):
    """A tensor's bytes are hashed beside the next tensor's conversion, but one larger than ``_OVERLAP_BYTES`` is
    hashed before write returns (the writer would hold it: peak memory); the digests are the file's either way."""
    import hashlib

    from mxc.loaders import safetensors_writer

    monkeypatch.setattr(safetensors_writer, "_OVERLAP_BYTES", 1000)
    tensors = {"small": torch.ones(100, dtype=torch.uint8), "large": torch.arange(2000, dtype=torch.int16),
               "last": torch.zeros(10)}
    path = tmp_path / "f.safetensors"
    w = SafetensorsWriter(path, _specs(tensors))
    held = []
    for name, t in tensors.items():
        w.write(name, t)
        held.append(len(w._pending))
    assert held == [2, 0, 2]  # the small ones' two hashes may still run; the large one's are done
    w.close()
    assert w.digest == hashlib.sha256(path.read_bytes()).hexdigest()
