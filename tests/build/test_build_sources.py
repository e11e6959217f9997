"""``mxc.build`` from each kind of source: the bundled default, an HF checkpoint directory,
a bundled name or a YAML path plus ``checkpoint=``, and sharded / ``.bin`` checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import mxc
from mxc.models import MODELS_DIR

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _build(source, out, **kw):
    return mxc.build(str(source), out=out, progress=False, log=lambda m: None, **kw)


def _logits(art):
    return mxc.load(art).logits(IDS)


def test_default_build_is_deterministic(tmp_path):
    a = _build("llama.yaml", tmp_path / "a")
    b = _build("llama.yaml", tmp_path / "b")
    assert (a / "weights" / "rank0.safetensors").read_bytes() == (b / "weights" / "rank0.safetensors").read_bytes()
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma["files"] == mb["files"]
    assert ma["ir_sha256"] == mb["ir_sha256"]
    assert ma["source"] == {"checkpoint": None, "weights": "dummy"}
    assert ma["architecture"] == "LlamaForCausalLM"
    assert torch.equal(_logits(a), _logits(b))


def test_checkpoint_dir_as_source(hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("LlamaForCausalLM")
    art = _build(ckpt, tmp_path / "art")
    m = json.loads((art / "manifest.json").read_text())
    assert m["source"] == {"checkpoint": str(ckpt), "weights": "checkpoint"}
    with torch.no_grad():
        ref = hf(IDS).logits
    assert float((_logits(art) - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_bundled_name_and_yaml_path_with_checkpoint(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    from_dir = _build(ckpt, tmp_path / "from_dir")
    named = _build("llama.yaml", tmp_path / "named", checkpoint=str(ckpt))
    own_yaml = tmp_path / "defs" / "my-llama.yaml"
    own_yaml.parent.mkdir()
    shutil.copyfile(MODELS_DIR / "llama.yaml", own_yaml)
    from_path = _build(own_yaml, tmp_path / "from_path", checkpoint=str(ckpt))

    ref = _logits(from_dir)
    weights = (from_dir / "weights" / "rank0.safetensors").read_bytes()
    for art in (named, from_path):
        assert (art / "weights" / "rank0.safetensors").read_bytes() == weights
        assert torch.equal(_logits(art), ref)
    assert json.loads((from_path / "manifest.json").read_text())["model_file"] == "my-llama.yaml"
    assert "my-llama.yaml:" in (from_path / "code" / "forward.py").read_text()


def test_path_to_the_bundled_definition_takes_the_registry_settings(hf_checkpoint, tmp_path):
    """``mxc build mxc/models/llama.yaml --checkpoint QWEN3`` (the file itself, as typed in a checkout) builds what
    ``llama.yaml`` by name does: the registry's settings for Qwen3 (its per-head q/k norms). It was taken as a
    user's own definition, bound as a plain Llama, and refused the checkpoint's q/k norm tensors."""
    ckpt, _ = hf_checkpoint("Qwen3ForCausalLM", head_dim=32)
    named = _build("llama.yaml", tmp_path / "named", checkpoint=str(ckpt))
    by_path = _build(MODELS_DIR / "llama.yaml", tmp_path / "by_path", checkpoint=str(ckpt))
    assert (by_path / "graph.yaml").read_text() == (named / "graph.yaml").read_text()
    assert torch.equal(_logits(by_path), _logits(named))


def test_checkpoint_dir_plus_checkpoint_refused(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    with pytest.raises(mxc.MxcError, match="do not also pass --checkpoint"):
        _build(ckpt, tmp_path / "art", checkpoint=str(ckpt))


def test_sharded_and_bin_checkpoints_match_single_file(hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("LlamaForCausalLM")
    ref = _logits(_build(ckpt, tmp_path / "single"))

    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1

    # transformers >= 5 ignores safe_serialization=False and always writes safetensors,
    # so write the legacy pytorch_model.bin format directly.
    binary = tmp_path / "binary"
    binary.mkdir()
    shutil.copyfile(ckpt / "config.json", binary / "config.json")
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, binary / "pytorch_model.bin")
    assert (binary / "pytorch_model.bin").is_file()
    assert not list(binary.glob("*.safetensors"))

    for source in (sharded, binary):
        assert torch.equal(_logits(_build(source, tmp_path / f"art-{source.name}")), ref), source.name


def test_rebuild_into_existing_artifact_replaces_it(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    out = tmp_path / "art"
    _build("llama.yaml", out)
    _build(ckpt, out)
    assert json.loads((out / "manifest.json").read_text())["source"]["weights"] == "checkpoint"
    mxc.load(out)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_build_does_not_depend_on_checkpoint_location(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(ckpt, moved)
    a, b = _build(ckpt, tmp_path / "a"), _build(moved, tmp_path / "b")
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma["ir_sha256"] == mb["ir_sha256"]
    assert ma["files"] == mb["files"]


def test_bfloat16_build(hf_checkpoint, tmp_path):
    from safetensors import safe_open

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    ref = _logits(_build(ckpt, tmp_path / "f32"))
    art = _build(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((art / "manifest.json").read_text())["options"]["dtype"] == "bfloat16"
    with safe_open(art / "weights" / "rank0.safetensors", framework="pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}
    got = _logits(art)
    assert got.dtype == torch.float32
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05
