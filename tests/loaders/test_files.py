"""A checkpoint's small JSON files (config.json, generation_config.json, the shard indexes) and the files named like
its weights: whatever stands under those names (a FIFO, /dev/zero, a huge or deeply nested file, one without read
permission, a broken symlink) is a one-line error naming the file, never a hang, an endless read or a traceback."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file

from mxc.errors import MxcError
from mxc.loaders.checkpoint import open_checkpoint
from mxc.loaders.files import MAX_JSON_BYTES, read_json
from mxc.source import eos_ids, resolve_source

JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
DEEP = '{"a":' + "[" * 100000 + "]" * 100000 + "}"


@pytest.fixture(autouse=True)
def _no_hang():
    """A regression would block on a FIFO: fail after 20 s instead of hanging the suite."""
    def expired(*_):
        raise TimeoutError("read_json blocked")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _read(directory, name):
    """Read ``name`` in ``directory`` the way a build does."""
    if name == "config.json":
        return resolve_source(str(directory), None)
    if name == "generation_config.json":
        (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        return eos_ids(resolve_source(str(directory), None))
    return open_checkpoint(directory)


def _deny(monkeypatch, path):
    """``path`` unreadable: its mode 0 where that stops this process (not root), and os.open refusing it always."""
    path.chmod(0)
    real = os.open

    def refusing(p, *args, **kw):
        if os.fspath(p) == os.fspath(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(p))
        return real(p, *args, **kw)

    monkeypatch.setattr(os, "open", refusing)


@pytest.mark.parametrize("name", JSON_FILES)
@pytest.mark.parametrize("kind, needle", [
    ("fifo", r"(cannot read it as a .*: it )?is not a regular file \(a FIFO\)"),  # an index: named as weights are
    ("dev-zero", r"(cannot read it as a .*: it )?is not a regular file \(a device\)"),
    ("huge", r"64\.0 MiB, past the 64\.0 MiB mxc reads of JSON metadata; is it a "),
    ("deep", r"not valid JSON \(nested too deeply\)"),
    ("denied", r"cannot read it as a .*\(Permission denied\)"),
])
def test_a_json_file_that_cannot_be_json_metadata_is_refused_in_one_line(name, kind, needle, tmp_path, monkeypatch):
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":  # sparse: the size is refused before anything is read
        with open(path, "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)
    elif kind == "deep":
        path.write_text(DEEP)
    else:
        path.write_text("{}")
        _deny(monkeypatch, path)
    if name != "config.json":
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(MxcError, match=rf"^{tmp_path / name}: {needle}") as e:
        _read(tmp_path, name)
    assert "\n" not in str(e.value)


def test_read_json_reads_what_the_files_hold(tmp_path):
    (tmp_path / "a.json").write_text('{"x": [1, 2]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")  # a cache snapshot's files are symlinks
    assert read_json(tmp_path / "link.json", "a config.json", "") == {"x": [1, 2]}
    (tmp_path / "big.json").write_text("1" * 5000)  # past Python's int digits limit
    with pytest.raises(MxcError, match=r"big\.json: not valid JSON \(Exceeds the limit"):
        read_json(tmp_path / "big.json", "a config.json", "")


def test_a_broken_generation_config_is_named_not_skipped(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 2}))
    src = resolve_source(str(tmp_path), None)
    assert eos_ids(src) == [2]  # none: config.json's alone
    (tmp_path / "generation_config.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(MxcError, match=r"generation_config\.json: a broken symlink \(an interrupted download\?\)"):
        eos_ids(src)


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind, needle", [("dangling", "is a broken symlink"), ("dir", "is a directory"),
                                          ("fifo", r"is not a regular file \(a FIFO\)"),
                                          ("loop", r"cannot be read \(Too many levels of symbolic links\)")])
def test_a_weights_name_that_is_not_a_file_says_what_it_is(name, kind, needle, tmp_path):
    """An interrupted download leaves a dangling symlink in the HF cache: named, not "no checkpoint found"; a
    symlink loop, with the OS's reason."""
    path = tmp_path / name
    if kind == "dangling":
        path.symlink_to(tmp_path / "blobs" / "0123abcd")
    elif kind == "loop":  # a symlink to itself: stat fails with ELOOP, not FileNotFoundError
        path.symlink_to(path.name)
    elif kind == "dir":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(MxcError, match=rf"^{path}: {needle}; expected the checkpoint's (weights|index) there"):
        open_checkpoint(tmp_path)


def test_an_unreadable_safetensors_file_says_why(tmp_path, monkeypatch):
    """No permission: the OS's reason, not "truncated or corrupt ... No such file or directory"."""
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    _deny(monkeypatch, tmp_path / "model.safetensors")
    with pytest.raises(MxcError) as e:
        open_checkpoint(tmp_path)
    assert str(e.value) == f"{tmp_path / 'model.safetensors'}: cannot read it as a safetensors file (Permission denied)"


def test_an_unreadable_bin_file_says_why(tmp_path, monkeypatch):
    torch.save({"a": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    _deny(monkeypatch, tmp_path / "pytorch_model.bin")
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: cannot read it as a PyTorch checkpoint \(Permission "
                                       r"denied\)$"):
        open_checkpoint(tmp_path)
