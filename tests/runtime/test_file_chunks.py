"""The weights' sha256 a piece (the manifest's ``file_chunks``): written by the build as it writes, checked by
``mxc.load`` on every core at once, each piece's bytes against its digest; artifacts without it (built before it)
check each file's whole sha256. Pieces here are 4 KiB (``CHUNK_BYTES`` patched) so that a tiny model's weights
span several, a tensor straddling each boundary."""

from __future__ import annotations

import hashlib
import json

import pytest

import mxc
from mxc import artifact_format
from tests.cli.helpers import signed
from tests.runtime.helpers import refused

PIECE = 4096


@pytest.fixture
def art(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact_format, "CHUNK_BYTES", PIECE)
    return mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=lambda m: None)


def _pieces(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i:i + PIECE]).hexdigest() for i in range(0, max(len(data), 1), PIECE)]


def _manifest(art):
    return json.loads((art / "manifest.json").read_text())


def test_the_build_records_each_weight_piece_s_sha256(art):
    m = _manifest(art)
    data = (art / "weights" / "rank0.safetensors").read_bytes()
    assert len(data) > 10 * PIECE and len(data) % PIECE  # several pieces, the last one partial
    assert m["file_chunks"] == {"chunk_bytes": PIECE, "sha256": {"weights/rank0.safetensors": _pieces(data)}}
    assert m["files"]["weights/rank0.safetensors"] == hashlib.sha256(data).hexdigest()  # the whole one stays


def test_load_hashes_the_pieces_in_parallel_and_each_once(art, monkeypatch):
    from mxc.runtime import artifact

    asked = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda path, **kw: asked.append((path.name, kw)) or real(path, **kw))
    mxc.load(art)
    size = (art / "weights" / "rank0.safetensors").stat().st_size
    starts = sorted(kw["start"] for name, kw in asked if name == "rank0.safetensors")
    assert starts == list(range(0, size, PIECE))
    assert all(kw["length"] == PIECE for name, kw in asked if name == "rank0.safetensors")
    assert sum(name == "forward.py" for name, _ in asked) == 1  # small files: their whole sha256, once


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "truncate_at_a_boundary"])
def test_a_weight_file_changed_anywhere_is_refused(art, damage):
    path = art / "weights" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[7 * PIECE + 123] ^= 1  # a byte in the middle of the file, in one piece only
    elif damage == "truncate":
        del data[-5:]
    elif damage == "append":
        data += b"\0"
    else:
        del data[(len(data) // PIECE) * PIECE:]  # one piece fewer, the rest intact
    path.write_bytes(bytes(data))
    refused(art, r"weights/rank0\.safetensors was modified since the build \(sha256 mismatch\); rebuild the artifact$")
    if damage == "flip":  # not hashed, a changed byte loads (its names, shapes and dtypes are still checked)
        mxc.load(art, verify=False)


def test_an_artifact_without_pieces_checks_whole_files(art):
    """As built before ``file_chunks``: the whole file's sha256, which still catches a changed byte."""
    m = _manifest(art)
    del m["file_chunks"]
    (art / "manifest.json").write_text(json.dumps(signed(m)))
    assert mxc.load(art).logits([[1, 2]]).shape == (1, 2, 256)
    path = art / "weights" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[7 * PIECE + 123] ^= 1
    path.write_bytes(bytes(data))
    refused(art, r"weights/rank0\.safetensors was modified since the build")


@pytest.mark.parametrize("value", [None, [], {"chunk_bytes": 0, "sha256": {}}, {"chunk_bytes": PIECE},
                                   {"chunk_bytes": PIECE, "sha256": {"weights/rank9.safetensors": ["0" * 64]}},
                                   {"chunk_bytes": PIECE, "sha256": {"weights/rank0.safetensors": []}},
                                   {"chunk_bytes": True, "sha256": {}}])
def test_a_damaged_file_chunks_field_is_one_line(art, value):
    m = _manifest(art)
    m["file_chunks"] = value
    (art / "manifest.json").write_text(json.dumps(signed(m)))
    refused(art, r"field file_chunks: expected an object of chunk_bytes \(a positive integer\) and sha256")


def test_sha256_file_of_a_range():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f"
        data = bytes(range(256)) * 100
        path.write_bytes(data)
        for start, length in [(0, None), (0, 10), (300, 7000), (25000, 600), (25600, 10), (3, 0)]:
            want = data[start:] if length is None else data[start:start + length]
            assert artifact_format.sha256_file(path, chunk=512, start=start, length=length) == \
                hashlib.sha256(want).hexdigest(), (start, length)


def test_chunk_hasher_matches_slicing_whatever_the_updates():
    import random

    rng = random.Random(0)
    for size in [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE, 5 * PIECE + 17]:
        data = rng.randbytes(size)
        h, at = artifact_format.ChunkHasher(PIECE), 0
        while at < size:
            step = rng.choice([1, 100, PIECE, 3 * PIECE])
            h.update(data[at:at + step])
            at += step
        assert h.pieces() == _pieces(data), size
        assert len(h.pieces()) == artifact_format.chunk_count(size, PIECE)


def test_each_hashing_thread_holds_a_small_read_not_a_piece(tmp_path):
    """Pieces are hashed a small read at a time: at the 16 MiB reads of ``sha256_file``'s default, the threads of one
    load held up to 512 MiB at once (and each rank of a tensor-parallel load as much again)."""
    import tracemalloc

    from mxc.runtime.artifact import verify_files

    piece = 8 << 20
    data = bytes(range(256)) * (2 * piece // 256)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "rank0.safetensors").write_bytes(data)
    manifest = {"files": {"weights/rank0.safetensors": hashlib.sha256(data).hexdigest()},
                "file_chunks": {"chunk_bytes": piece, "sha256": {"weights/rank0.safetensors": [
                    hashlib.sha256(data[:piece]).hexdigest(), hashlib.sha256(data[piece:]).hexdigest()]}}}
    del data
    tracemalloc.start()
    try:
        verify_files(tmp_path, manifest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < piece, peak  # 16 MiB reads: a whole 8 MiB piece a thread, two at once


def test_each_rank_hashes_its_own_weights_and_the_shared_files(tmp_path):
    """A tensor-parallel load: rank r's process hashes weights/rank{r} and the files every rank reads, not the other
    ranks' weights (each rank hashes its own; they check they loaded one build): tp times less hashing a process."""
    from mxc.runtime.artifact import verify_files

    art = mxc.build("llama.yaml", out=tmp_path / "tp2", tp=2, progress=False, log=lambda m: None)
    manifest = _manifest(art)
    path = art / "weights" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    verify_files(art, manifest, rank=1)  # rank 0's file is rank 0's to hash
    for rank in (0, None):  # rank 0, and a check of the whole artifact
        with pytest.raises(mxc.MxcError, match=r"weights/rank0\.safetensors was modified since the build"):
            verify_files(art, manifest, rank=rank)
    (art / "code" / "forward.py").write_text("# edited\n")
    with pytest.raises(mxc.MxcError, match=r"code/forward\.py was modified since the build"):
        verify_files(art, manifest, rank=1)  # a file every rank reads: every rank hashes it
    path.unlink()
    with pytest.raises(mxc.MxcError, match=r"weights/rank0\.safetensors is missing"):
        verify_files(art, manifest, rank=1, hashes=False)  # every file's presence, whatever the rank


def test_each_rank_hashes_on_its_share_of_the_cores(art, monkeypatch):
    """tp processes on one machine each take cpu_count / tp hashing threads (at most 32, at least 1)."""
    import concurrent.futures

    from mxc.runtime import artifact

    made = []
    real = concurrent.futures.ThreadPoolExecutor
    monkeypatch.setattr(artifact.concurrent.futures, "ThreadPoolExecutor", lambda n: made.append(n) or real(n))
    manifest = _manifest(art)
    for cpus, world, want in [(16, 4, 4), (128, 1, 32), (2, 8, 1), (None, 1, 1)]:
        monkeypatch.setattr(artifact.os, "cpu_count", lambda c=cpus: c)
        artifact.verify_files(art, manifest, world_size=world)
        assert made.pop() == want, (cpus, world)
