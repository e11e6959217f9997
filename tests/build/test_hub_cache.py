"""A Hugging Face Hub model id as the build's source or --checkpoint: its snapshot in the local cache (where
``hf download`` or transformers put it: blobs behind symlinks, ``refs/main`` naming the commit), else a one-line error
saying how to download it. mxc itself does not download."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import mxc
from mxc.errors import MxcError
from tests.cli.helpers import user_error

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_from(ckpt: Path, hub: Path, repo: str) -> Path:
    """``ckpt``'s files as the Hub cache lays out ``repo``: each file a symlink to its blob; returns the snapshot."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in ckpt.iterdir():
        blob = root / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no folder named like the model id here
    return tmp_path / "hub"


def test_a_model_id_in_the_cache_builds_its_snapshot(hf_checkpoint, hub, tmp_path):
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM")
    snapshot = _cache_from(ckpt, hub, "someorg/tiny-qwen2")
    by_id = mxc.build("someorg/tiny-qwen2", out=tmp_path / "by-id", progress=False, log=lambda m: None)
    with_def = mxc.build("llama.yaml", checkpoint="someorg/tiny-qwen2", out=tmp_path / "with-def", progress=False,
                         log=lambda m: None)
    by_path = mxc.build(str(snapshot), out=tmp_path / "by-path", progress=False, log=lambda m: None)
    ids = [[1, 2, 3]]
    want = mxc.load(by_path).logits(ids)
    for art in (by_id, with_def):
        assert torch.equal(mxc.load(art).logits(ids), want)
        source = json.loads((art / "manifest.json").read_text())["source"]
        assert source == {"checkpoint": f"someorg/tiny-qwen2@{COMMIT}", "weights": "checkpoint"}


def test_a_model_id_not_in_the_cache_says_how_to_download_it(hub, capsys):
    hint = ("to build the Hugging Face Hub model someorg/absent, download it first (hf download someorg/absent, which "
            "mxc then finds in the cache, or hf download someorg/absent --local-dir absent and mxc build absent)")
    with pytest.raises(MxcError, match=r"^someorg/absent: no such file, and not a bundled definition \(llama\.yaml\); "
                                       + hint.replace("(", r"\(").replace(")", r"\)") + "$"):
        mxc.build("someorg/absent", progress=False, log=lambda m: None)
    user_error(capsys, ["build", "llama.yaml", "--checkpoint", "someorg/absent"],
               "--checkpoint someorg/absent: not a directory; to build the Hugging Face Hub model someorg/absent, "
               "download it first (hf download someorg/absent, which mxc then finds in the cache, or hf download "
               "someorg/absent --local-dir absent and pass --checkpoint absent)")
    # not a model id: no hint
    with pytest.raises(MxcError, match=r"^missing\.yaml: no such file, and not a bundled definition \(llama\.yaml\)$"):
        mxc.build("missing.yaml", progress=False, log=lambda m: None)


def test_a_local_folder_named_like_a_model_id_comes_first(hf_checkpoint, hub, tmp_path):
    """``someorg/tiny`` relative to the working directory is that folder, whatever the cache holds."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    other, _ = hf_checkpoint("Qwen2ForCausalLM", name="other")
    _cache_from(other, hub, "someorg/tiny")
    (tmp_path / "someorg").mkdir()
    ckpt.rename(tmp_path / "someorg" / "tiny")
    art = mxc.build("someorg/tiny", out=tmp_path / "art", progress=False, log=lambda m: None)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["architecture"] == "LlamaForCausalLM" and manifest["source"]["checkpoint"] == "tiny"


def test_the_cache_is_where_huggingface_hub_finds_it(hf_checkpoint, tmp_path, monkeypatch):
    """HF_HOME (and HF_HUB_CACHE) with a ``$VAR`` in it, or the legacy HUGGINGFACE_HUB_CACHE, name the cache
    huggingface_hub and transformers read: the build finds the model there too."""
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("MXC_TEST_ROOT", str(tmp_path))
    monkeypatch.setenv("HF_HOME", "$MXC_TEST_ROOT/hf-home")
    _cache_from(ckpt, tmp_path / "hf-home" / "hub", "someorg/tiny")
    assert mxc.build("someorg/tiny", out=tmp_path / "a", progress=False, log=lambda m: None).is_dir()
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))  # before HF_HOME, as huggingface_hub has it
    _cache_from(ckpt, tmp_path / "legacy", "someorg/other")
    assert mxc.build("someorg/other", out=tmp_path / "b", progress=False, log=lambda m: None).is_dir()


def test_a_snapshot_of_config_json_alone_says_to_download_the_rest(hf_checkpoint, hub):
    """What transformers' AutoConfig or AutoTokenizer leaves in the cache: config.json, no weights."""
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM")
    snapshot = _cache_from(ckpt, hub, "someorg/tiny")
    for f in snapshot.iterdir():
        if f.name != "config.json":
            f.unlink()
    for args in (("someorg/tiny",), ("llama.yaml", "someorg/tiny")):
        with pytest.raises(MxcError, match=r"^someorg/tiny: the Hugging Face cache's snapshot of it \(.*\) holds no "
                                           r"weights, only config\.json and the like; download the rest: "
                                           r"hf download someorg/tiny$"):
            mxc.build(args[0], checkpoint=args[1] if len(args) > 1 else None, progress=False, log=lambda m: None)


def test_a_broken_tokenizer_symlink_in_the_snapshot_is_named(hf_checkpoint, hub, tmp_path):
    """A tokenizer file whose blob is gone was left out of the artifact without a word (it had a tokenizer_config.json
    and no tokenizer.json); the tokenizer files that are there are copied as files, not symlinks."""
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM")
    (ckpt / "tokenizer_config.json").write_text("{}")
    (ckpt / "special_tokens_map.json").write_text("{}")
    snapshot = _cache_from(ckpt, hub, "someorg/tiny")
    art = mxc.build("someorg/tiny", out=tmp_path / "ok", progress=False, log=lambda m: None)
    copied = art / "tokenizer" / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_text() == "{}"
    os.unlink(os.path.realpath(snapshot / "special_tokens_map.json"))
    with pytest.raises(MxcError, match=r"/special_tokens_map\.json: is a broken symlink; expected the checkpoint's "
                                       r"special_tokens_map\.json there \(download it again, or remove it"):
        mxc.build("someorg/tiny", out=tmp_path / "broken", progress=False, log=lambda m: None)


def test_a_mistyped_definition_path_gets_no_download_hint(hub):
    """``models/mine.yaml`` is shaped like a Hub id, but a missing definition is not a model to download."""
    for name in ("models/mine.yaml", "models/mine.yml", "configs/config.json"):
        with pytest.raises(MxcError, match=rf"^{name}: no such file, and not a bundled definition \(llama\.yaml\)$"):
            mxc.build(name, progress=False, log=lambda m: None)


def test_nothing_reaches_the_network_even_online(hf_checkpoint, hub, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=0: a cached id builds, and an absent one fails, without a connection being opened."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network use: {args}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM")
    _cache_from(ckpt, hub, "someorg/tiny")
    assert mxc.build("someorg/tiny", out=tmp_path / "a", progress=False, log=lambda m: None).is_dir()
    with pytest.raises(MxcError, match=r"download it first"):
        mxc.build("someorg/absent", progress=False, log=lambda m: None)
