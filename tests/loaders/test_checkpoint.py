"""Tests for reading Hugging Face checkpoints tensor by tensor."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from mxc.errors import MxcError
from mxc.loaders.checkpoint import open_checkpoint


class NotATensor:
    """A custom class; pickling an instance must be refused by weights_only loading."""


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g).half(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "model.norm.weight": torch.randn(4, generator=g),
        "position_ids": torch.arange(5, dtype=torch.int64),
    }


def _check(ckpt, tensors):
    assert ckpt.names() == sorted(tensors)
    for name, t in tensors.items():
        assert ckpt.shape(name) == tuple(t.shape)
        assert ckpt.dtype(name) == t.dtype
        got = ckpt.get(name)
        assert got.device.type == "cpu"
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _shard(tensors, n=2):
    names = sorted(tensors)
    return [{k: tensors[k] for k in names[i::n]} for i in range(n)]


def _write_index(path, shards, filename):
    weight_map = {name: filename.format(i + 1, len(shards)) for i, s in enumerate(shards) for name in s}
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_single_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / "model.safetensors"]
        _check(ckpt, tensors)


def test_sharded_safetensors_with_index(tmp_path):
    tensors = _tensors()
    shards = _shard(tensors)
    name = "model-{:05d}-of-{:05d}.safetensors"
    for i, shard in enumerate(shards):
        save_file(shard, tmp_path / name.format(i + 1, 2))
    _write_index(tmp_path / "model.safetensors.index.json", shards, name)
    with open_checkpoint(tmp_path) as ckpt:
        assert len(ckpt.files) == 2
        _check(ckpt, tensors)


def test_unindexed_safetensors_glob(tmp_path):
    tensors = _tensors()
    for i, shard in enumerate(_shard(tensors)):
        save_file(shard, tmp_path / f"part{i}.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / "part0.safetensors", tmp_path / "part1.safetensors"]
        _check(ckpt, tensors)


def test_single_bin(tmp_path):
    tensors = _tensors()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with open_checkpoint(tmp_path) as ckpt:
        _check(ckpt, tensors)


def test_single_bin_legacy_format_without_mmap(tmp_path):
    tensors = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int64), "c": torch.ones(2).half()}
    torch.save(tensors, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with open_checkpoint(tmp_path) as ckpt:
        _check(ckpt, tensors)


def test_sharded_bin_with_index(tmp_path):
    tensors = _tensors()
    shards = _shard(tensors)
    name = "pytorch_model-{:05d}-of-{:05d}.bin"
    for i, shard in enumerate(shards):
        torch.save(shard, tmp_path / name.format(i + 1, 2))
    _write_index(tmp_path / "pytorch_model.bin.index.json", shards, name)
    with open_checkpoint(tmp_path) as ckpt:
        assert len(ckpt.files) == 2
        _check(ckpt, tensors)


def test_safetensors_preferred_over_bin(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    torch.save({"b": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.names() == ["a"]


def test_shape_and_dtype_without_loading(tmp_path, monkeypatch):
    save_file({"w": torch.zeros(3, 7, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        handle = ckpt._handles[tmp_path / "model.safetensors"]

        def forbidden(*args):
            raise AssertionError("tensor data was loaded")

        # safe_open handles are Rust objects; wrap the one in use to catch any data read.
        class Guard:
            def __getattr__(self, attr):
                return forbidden if attr == "get_tensor" else getattr(handle, attr)

        ckpt._handles[tmp_path / "model.safetensors"] = Guard()
        assert ckpt.shape("w") == (3, 7)
        assert ckpt.dtype("w") == torch.bfloat16


def test_no_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MxcError, match=r"no checkpoint found; expected one of model\.safetensors"):
        open_checkpoint(tmp_path)


def test_unknown_tensor_name(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        with pytest.raises(MxcError, match=rf"'missing\.weight' not found in checkpoint {tmp_path}"):
            ckpt.get("missing.weight")
        with pytest.raises(MxcError, match=r"'missing\.weight' not found"):
            ckpt.shape("missing.weight")


def test_truncated_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file \(truncated or corrupt"):
        open_checkpoint(tmp_path)


def test_truncated_data_section(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:-100])  # header intact, data cut short
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file"):
        open_checkpoint(tmp_path)


def test_garbage_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 3)
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file"):
        open_checkpoint(tmp_path)


def test_index_points_at_missing_shard(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MxcError, match=r"index\.json: weight_map entry 'b' points at missing file .*model-00002-of-00002"):
        open_checkpoint(tmp_path)


def test_index_names_tensor_absent_from_shard(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00001.safetensors")
    weight_map = {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MxcError, match=r"model-00001-of-00001\.safetensors: tensor 'b' listed in"):
        open_checkpoint(tmp_path)


def test_index_not_json(tmp_path):
    (tmp_path / "pytorch_model.bin.index.json").write_text("{not json")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin\.index\.json: not valid JSON"):
        open_checkpoint(tmp_path)


def test_bin_with_pickled_object_is_refused(tmp_path):
    torch.save({"w": torch.zeros(2), "extra": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: contains non-tensor pickled objects .*refused for safety"):
        open_checkpoint(tmp_path)


class _RunsCode:
    def __reduce__(self):  # what a malicious checkpoint does: call a function while unpickling
        return (os.system, ("touch ran-code",))


def test_bin_calling_a_function_is_refused_without_advice_to_disable_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.zeros(2), "x": _RunsCode()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: contains non-tensor pickled objects .*system") as err:
        open_checkpoint(tmp_path)
    assert "weights_only` set to `False`" not in str(err.value) and not (tmp_path / "ran-code").exists()


def test_sharded_bin_with_pickled_object_is_refused_on_access(tmp_path):
    torch.save({"w": torch.zeros(2), "extra": NotATensor()}, tmp_path / "pytorch_model-00001-of-00001.bin")
    weight_map = {"w": "pytorch_model-00001-of-00001.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_checkpoint(tmp_path) as ckpt:
        with pytest.raises(MxcError, match=r"pytorch_model-00001-of-00001\.bin: contains non-tensor pickled"):
            ckpt.get("w")


def test_garbage_bin(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage bytes")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: not a valid PyTorch checkpoint"):
        open_checkpoint(tmp_path)


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
    """Shards without an index that both hold a tensor: which copy is meant is unknown, so the build stops."""
    save_file({"x": torch.zeros(2), "y": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(MxcError, match="tensor 'x' also appears in"):
        open_checkpoint(tmp_path)
