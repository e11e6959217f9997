"""Loading refuses tampered, incomplete, foreign or incompatible artifacts with a one-line MxcError."""

from __future__ import annotations

import json
import shutil

import pytest

import mxc
from mxc.errors import MxcError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return mxc.build("llama.yaml", out=tmp_path_factory.mktemp("pristine") / "art", progress=False,
                     log=lambda m: None)


@pytest.fixture
def art(pristine, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(pristine, copy)
    return copy


def _refused(path, pattern, **kw):
    with pytest.raises(MxcError, match=pattern) as e:
        mxc.load(path, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def _edit_manifest(art, **changes):
    path = art / "manifest.json"
    m = json.loads(path.read_text())
    m.update(changes)
    path.write_text(json.dumps(m))


def test_pristine_copy_loads(art):
    assert mxc.load(art).logits([[1, 2]]).shape == (1, 2, 256)


def test_flipped_weight_byte(art):
    path = art / "weights" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    _refused(art, r"weights/rank0\.safetensors was modified")


def test_edited_forward_py(art):
    path = art / "code" / "forward.py"
    path.write_text(path.read_text() + "\nimport os  # sneaky\n")
    _refused(art, r"code/forward\.py was modified")


def test_edited_graph_yaml(art):
    path = art / "graph.yaml"
    path.write_text(path.read_text().replace("dtype: float32", "dtype: float16", 1))
    _refused(art, r"graph\.yaml was modified")


def test_missing_graph_yaml(art):
    (art / "graph.yaml").unlink()
    _refused(art, r"graph\.yaml is missing")


def test_missing_weights(art):
    (art / "weights" / "rank0.safetensors").unlink()
    _refused(art, r"weights/rank0\.safetensors is missing")


def test_stray_file(art):
    (art / "weights" / "extra.safetensors").write_bytes(b"x")
    _refused(art, r"file weights/extra\.safetensors is not part of the artifact")


def test_stray_file_named_manifest_in_subdir(art):
    (art / "code" / "manifest.json").write_text("{}")
    _refused(art, r"code/manifest\.json is not part of the artifact")


def test_newer_mxc_version(art):
    _edit_manifest(art, mxc_version="9.9.0")
    msg = _refused(art, r"built by mxc 9\.9\.0, incompatible with mxc")
    assert mxc.__version__ in msg


def test_another_minor_version_is_refused_and_another_patch_loads(pristine, tmp_path):
    """Compatibility is major.minor: an artifact of the next minor version is refused, one of another patch loads."""
    major, minor, *_ = mxc.__version__.split(".")
    newer_minor = tmp_path / "minor"
    shutil.copytree(pristine, newer_minor)
    _edit_manifest(newer_minor, mxc_version=f"{major}.{int(minor) + 1}.0")
    _refused(newer_minor, "incompatible with mxc")
    other_patch = tmp_path / "patch"
    shutil.copytree(pristine, other_patch)
    _edit_manifest(other_patch, mxc_version=f"{major}.{minor}.99")
    mxc.load(other_patch)


def test_file_digests_cover_every_chunk(tmp_path):
    """A file longer than the hash's read size is hashed whole (weights are GBs; the artifacts in tests are not)."""
    import hashlib

    import torch

    from mxc.artifact_format import sha256_file

    path = tmp_path / "blob"
    path.write_bytes(torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha256_file(path, chunk=1024) == want
    assert sha256_file(path) == want


def test_schema_version(art):
    _edit_manifest(art, schema_version=99)
    _refused(art, r"artifact schema 99 is not readable")


def test_corrupt_manifest(art):
    (art / "manifest.json").write_text("{not json")
    _refused(art, r"manifest\.json: corrupt")


def test_manifest_not_utf8(art):
    from mxc.inspect import summary

    path = art / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"llama"', b'"ll\xffama"', 1))
    _refused(art, r"manifest\.json: corrupt \(not UTF-8 text: invalid start byte at byte \d+\); rebuild")
    with pytest.raises(MxcError, match=r"manifest\.json: corrupt \(not UTF-8 text"):
        summary(art)


def test_not_an_artifact(tmp_path):
    (tmp_path / "plain").mkdir()
    _refused(tmp_path / "plain", r"not an mxc artifact \(no manifest\.json\)")
    _refused(tmp_path / "missing", r"no such artifact directory")
    (tmp_path / "plain" / "manifest.json").write_text("{}")
    _refused(tmp_path / "plain" / "manifest.json", r"a file, not an artifact directory \(give the folder that holds it\)")


def test_world_size_must_match_tp(art):
    _refused(art, r"built for tp=1, but loaded with world_size=2", world_size=2)


def test_rank_out_of_range(art):
    _refused(art, r"rank", rank=1)


def test_weights_larger_than_the_gpus_free_memory_are_refused_before_loading(pristine, monkeypatch):
    """On a GPU whose free memory is under the rank's weight file, load stops with one line naming the artifact, the
    sizes and what would make them fit, before it allocates anything there (here a CPU-target artifact loaded as if
    onto a GPU with 1 KiB free: the refusal comes before any CUDA call but the free-memory query)."""
    import contextlib
    import re

    import torch

    from mxc.errors import size_text
    from mxc.runtime import artifact

    queried = []

    def mem_get_info(device):
        queried.append(device)
        return 1024, 80 << 30

    def no_cuda(*args, **kwargs):
        raise AssertionError("loaded onto the GPU after the refusal should have come")

    monkeypatch.setattr(artifact, "_device", lambda name: torch.device("cuda:0"))
    monkeypatch.setattr(artifact, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(artifact, "safe_open", no_cuda)
    size = re.escape(size_text((pristine / "weights" / "rank0.safetensors").stat().st_size))
    msg = _refused(pristine, rf"{pristine.name}: rank 0's weights take {size}, more than the 1\.0 KiB free on cuda:0; "
                             r"free the GPU, or rebuild with --quant fp8 or a larger --tp", device="cuda")
    assert queried == [torch.device("cuda:0")], msg
