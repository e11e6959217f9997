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


@pytest.mark.parametrize("keep", [0.5, -30], ids=["half", "all-but-the-end"])
def test_truncated_bin(tmp_path, keep):
    """A .bin cut short (an interrupted copy) fails in torch's zip reader, not its unpickler: one line naming the
    file, not torch's multi-line advice or a traceback."""
    path = tmp_path / "pytorch_model.bin"
    torch.save(_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)] if keep > 0 else data[:keep])
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: not a valid PyTorch checkpoint: ") as e:
        open_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
    """Shards without an index that both hold a tensor: which copy is meant is unknown, so the build stops."""
    save_file({"x": torch.zeros(2), "y": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(MxcError, match="tensor 'x' also appears in"):
        open_checkpoint(tmp_path)


def test_legacy_bin_calling_a_function_is_refused(tmp_path, monkeypatch):
    """The legacy (non-zip) format cannot be memory-mapped and is loaded again without mmap: still weights_only, so a
    pickle that would run code is refused, and the code never runs."""
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.zeros(2), "x": _RunsCode()}, tmp_path / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: contains non-tensor pickled objects .*system"):
        open_checkpoint(tmp_path)
    assert not (tmp_path / "ran-code").exists()


def test_bin_of_a_list_is_refused(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: expected a dict of tensors, found list"):
        open_checkpoint(tmp_path)


def test_bin_with_a_non_tensor_entry_is_refused(tmp_path):
    """weights_only loading accepts plain numbers (a training step, say): an entry that is not a tensor is named."""
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: entry 'step' is a int, expected a tensor"):
        open_checkpoint(tmp_path)


def test_bin_with_a_non_string_key_is_refused(tmp_path):
    torch.save({"w": torch.zeros(2), 0: torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: .*0"):
        open_checkpoint(tmp_path).names()


def test_legacy_pickle_the_weights_only_loader_cannot_read_says_why(tmp_path):
    """A plain pickle (protocol 0) that weights_only loading cannot read: the error gives torch's reason in one line,
    not the first line of its advice to disable the check."""
    import pickle

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}, protocol=0))
    with pytest.raises(MxcError) as e:
        open_checkpoint(tmp_path)
    assert str(e.value) == f"{tmp_path / 'pytorch_model.bin'}: not a valid PyTorch checkpoint: Unsupported operand 100"


@pytest.mark.parametrize("content", ["[]", '{"weight_map": ["a", "b"]}', '"weight_map"'])
def test_index_of_the_wrong_shape_is_refused(tmp_path, content):
    (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(MxcError, match=r"model\.safetensors\.index\.json: (expected a JSON object with a 'weight_map' "
                                       r"field|'weight_map' must map tensor names to file names)"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("file, needle", [
    (3, "is 3, expected a file name"), (None, "is None, expected a file name"),
    (["a.safetensors"], r"is \['a\.safetensors'\], expected a file name"), ("", "is '', expected a file name"),
    ("sub", r"points at .*sub, which is a directory"),
    ("/etc/passwd", "is '/etc/passwd': it must name a file inside the checkpoint directory"),
    ("../x.safetensors", r"is '\.\./x\.safetensors': it must name a file inside the checkpoint directory"),
    ("sub/../../x", r"is 'sub/\.\./\.\./x': it must name a file inside the checkpoint directory"),
])
def test_index_entry_not_naming_a_file_is_refused(tmp_path, file, needle):
    """A weight_map value that is no file name (a number, null, a list), names a directory or a file outside the
    checkpoint (an absolute path, one going up with ..): the entry is named, and says which it is."""
    (tmp_path / "sub").mkdir()
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00001.safetensors")
    weight_map = {"a": "model-00001-of-00001.safetensors", "b": file}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MxcError, match=rf"index\.json: weight_map entry 'b' {needle}$"):
        open_checkpoint(tmp_path)


def test_index_entry_in_a_subfolder_or_through_a_symlink_is_read(tmp_path):
    """Names inside the checkpoint are fine, whatever their symlinks point at (an HF cache's blobs are outside)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap" / "sub").mkdir(parents=True)
    save_file({"a": torch.zeros(1)}, tmp_path / "blobs" / "0123")
    (tmp_path / "snap" / "sub" / "m.safetensors").symlink_to(tmp_path / "blobs" / "0123")
    (tmp_path / "snap" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "./sub/m.safetensors"}}))
    with open_checkpoint(tmp_path / "snap") as ckpt:
        assert ckpt.names() == ["a"] and torch.equal(ckpt.get("a"), torch.zeros(1))


@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "sparse_csr", "nested", "quantized"])
def test_bin_with_a_tensor_that_is_not_dense_is_refused(tmp_path, kind):
    """weights_only loading gives meta, sparse and nested tensors too: none holds a weight's values as mxc reads
    them, and each is named, not a traceback later."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors are beta / prototype, quantized deprecated
        t = {"meta": lambda: torch.empty(2, 2, device="meta"), "sparse_coo": lambda: torch.eye(2).to_sparse(),
             "sparse_csr": lambda: torch.eye(2).to_sparse_csr(),
             "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
             "quantized": lambda: torch.quantize_per_tensor(torch.ones(2, 2), 0.1, 0, torch.qint8)}[kind]()
        torch.save({"w": torch.zeros(2), "x": t}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=rf"pytorch_model\.bin: entry 'x' is a .*{kind.split('_')[0]}.* tensor, expected "
                                       rf"a dense tensor of its values"):
        open_checkpoint(tmp_path)


def test_sharded_bin_index_names_tensor_absent_from_shard(tmp_path):
    torch.save({"a": torch.zeros(1)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    weight_map = {"a": "pytorch_model-00001-of-00001.bin", "b": "pytorch_model-00001-of-00001.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_checkpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.get("a"), torch.zeros(1))
        with pytest.raises(MxcError, match=r"pytorch_model-00001-of-00001\.bin: tensor 'b' listed in the index is not"):
            ckpt.shape("b")


def _raw_safetensors(path, dtype_code, nbytes):
    """A one-tensor safetensors file with a dtype code torch or mxc may not know (written by hand)."""
    header = json.dumps({"w": {"dtype": dtype_code, "shape": [4], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(nbytes))


def test_tensor_of_an_unsupported_dtype_is_named(tmp_path):
    """Dtypes safetensors knows but mxc does not import (complex, fp6): one line naming the file and tensor, from
    dtype() and from get()."""
    _raw_safetensors(tmp_path / "model.safetensors", "C64", 32)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.shape("w") == (4,)
        with pytest.raises(MxcError, match=r"model\.safetensors: tensor 'w' has unsupported dtype C64"):
            ckpt.dtype("w")
    (tmp_path / "model.safetensors").unlink()
    _raw_safetensors(tmp_path / "model.safetensors", "F6_E2M3", 3)
    with open_checkpoint(tmp_path) as ckpt:
        with pytest.raises(MxcError, match=r"model\.safetensors: tensor 'w' has unsupported dtype F6_E2M3"):
            ckpt.get("w")


def test_model_safetensors_is_preferred_over_other_safetensors_files(tmp_path):
    """A lone model.safetensors beside other .safetensors files (a consolidated copy, an adapter) is the checkpoint."""
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    save_file({"a": torch.ones(1)}, tmp_path / "consolidated.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / "model.safetensors"] and torch.equal(ckpt.get("a"), torch.zeros(1))


def test_a_safetensors_file_that_cannot_be_mapped_is_one_line(tmp_path):
    """An OS error opening a shard (here /proc/self/mem, which cannot be memory-mapped; a permission error alike) is
    reported with the file, not as a traceback."""
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("needs /proc/self/mem")
    (tmp_path / "model.safetensors").symlink_to("/proc/self/mem")
    with pytest.raises(MxcError, match=r"model\.safetensors: cannot read it as a safetensors file \(No such device"):
        open_checkpoint(tmp_path)


def test_index_files_are_listed_once_in_order(tmp_path):
    """An index listing the second shard's tensors first: each shard is listed once, in name order."""
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(1), "c": torch.ones(1)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
        assert ckpt.names() == ["a", "b", "c"]


def test_safetensors_index_preferred_over_bin_index(tmp_path):
    """Hub repositories often ship both formats, each with its index: the safetensors shards are read."""
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    torch.save({"b": torch.ones(1)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"b": "pytorch_model-00001-of-00001.bin"}}))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.names() == ["a"] and ckpt.index == tmp_path / "model.safetensors.index.json"


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(MxcError, match=r"nope: checkpoint directory does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_a_directory_named_like_a_shard_is_not_read(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "part0.safetensors")
    (tmp_path / "backup.safetensors").mkdir()
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.files == [tmp_path / "part0.safetensors"] and ckpt.names() == ["a"]


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_reading_tensors_does_not_keep_the_checkpoint_mapped(tmp_path):
    """Tensors are read into buffers of their own, not through the shard's memory map: its pages stayed mapped, in
    the process's resident memory, until the handle closed, so a build that read every tensor (of a 2.2 GB
    checkpoint) held the whole checkpoint besides the tensor it converted."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc/self/status")
    save_file({f"w{i}": torch.ones(1 << 20) for i in range(8)}, tmp_path / "model.safetensors")  # 32 MiB
    with open_checkpoint(tmp_path) as ckpt:
        before = _rss_file_kib()
        for i in range(8):
            assert ckpt.get(f"w{i}").sum() == 1 << 20
        assert _rss_file_kib() - before < 8 << 10  # KiB: was 32 MiB more


def test_a_shard_truncated_after_it_was_opened_is_one_line(tmp_path):
    """A shard cut short while the build runs (a sync still writing it): the read names the file and tensor. Read
    through the memory map, the bytes missing in the file's last page read as zeros (a silently wrong weight), and
    past it the process died of SIGBUS, its temporary directory left behind."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, path)
    with open_checkpoint(tmp_path) as ckpt:
        os.truncate(path, path.stat().st_size - 100)
        assert ckpt.get("a").sum() == 1000
        with pytest.raises(MxcError, match=r"model\.safetensors: cannot read tensor 'b': the file ends at byte \d+, "
                                           r"before its data does \(\d+\); was it truncated\? download it again$"):
            ckpt.get("b")


def test_a_shard_replaced_after_it_was_opened_is_one_line(tmp_path):
    """Tensors are read by offsets from the file's header, read at the first tensor: a shard replaced in between (a
    download writing it again) whose tensor moved, changed size or went is named, not read as other bytes."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(10), "b": torch.ones(10)}, path)
    for replacement, says in (({"a": torch.ones(20), "b": torch.ones(10)}, r"tensor 'a' takes 80 bytes in its header, "
                                                                         r"not the \[10\] float32 it had"),
                              ({"b": torch.ones(10)}, r"tensor 'a' is no longer in the file")):
        with open_checkpoint(tmp_path) as ckpt:
            save_file(replacement, path)
            with pytest.raises(MxcError, match=rf"model\.safetensors: {says}.*\? build again$"):
                ckpt.get("a")
        save_file({"a": torch.ones(10), "b": torch.ones(10)}, path)


def test_large_tensors_read_into_huge_page_buffers_hold_the_file_bytes(tmp_path):
    """A tensor of HUGE_BYTES or more is read into a buffer mapped for transparent huge pages
    (``mxc.loaders.buffers``): the same bytes as safetensors reads, for every dtype, and a view of it keeps its memory
    once the tensor it came from is gone."""
    import gc

    from safetensors.torch import load_file

    from mxc.loaders.buffers import HUGE_BYTES

    g = torch.Generator().manual_seed(0)
    rows = HUGE_BYTES // (4 * 256) + 3  # past HUGE_BYTES in float32 and bfloat16, a ragged number of rows
    tensors = {"f32": torch.randn(rows, 256, generator=g), "bf16": torch.randn(2 * rows, 256, generator=g).bfloat16(),
               "e4m3": torch.randn(4 * rows, 256, generator=g).to(torch.float8_e4m3fn), "small": torch.randn(7)}
    save_file(tensors, tmp_path / "model.safetensors")
    want = load_file(tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        for name in tensors:
            got = ckpt.get(name)
            assert got.dtype == want[name].dtype and got.shape == want[name].shape and got.is_contiguous()
            assert torch.equal(got.view(torch.uint8), want[name].view(torch.uint8)), name
        tail = ckpt.get("f32")[-2:]
    gc.collect()
    assert torch.equal(tail, want["f32"][-2:])
