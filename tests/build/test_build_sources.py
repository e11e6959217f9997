"""``mxc.build`` from each kind of source: the bundled default, an HF checkpoint directory,
a bundled name or a YAML path plus ``checkpoint=``, and sharded / ``.bin`` checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    assert m["source"] == {"checkpoint": ckpt.name, "weights": "checkpoint"}  # its folder's name, not its path
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


def test_build_does_not_depend_on_checkpoint_location(hf_checkpoint, tmp_path, monkeypatch):
    """Two copies of a checkpoint folder, one given by its absolute path, the other relative to the working
    directory, give the same artifact bytes: the manifest names the folder, not where it is (it recorded the path
    as given, which told where and by whom an artifact was built)."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    moved = tmp_path / "elsewhere" / ckpt.name
    shutil.copytree(ckpt, moved)
    a = _build(ckpt, tmp_path / "a")
    monkeypatch.chdir(moved.parent)
    b = _build(ckpt.name, tmp_path / "b")
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert str(tmp_path).encode() not in (a / "manifest.json").read_bytes()


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


def _tiny_config(tmp_path, name="config.json", **fields) -> Path:
    """llama.yaml's tiny config with ``fields`` overridden, written to tmp_path/name."""
    config = {**json.loads((MODELS_DIR / "configs" / "tiny-llama.json").read_text()), **fields}
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_config_and_checkpoint_together_are_refused(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    with pytest.raises(mxc.MxcError, match="--config is for random weights; a --checkpoint brings its own config.json"):
        _build("llama.yaml", tmp_path / "art", checkpoint=str(ckpt), config=str(_tiny_config(tmp_path)))
    # the checkpoint as the source: --config was left unread, the checkpoint's own config.json built
    with pytest.raises(mxc.MxcError, match=r"--config is for random weights; .*ckpt is a checkpoint directory, which "
                                           r"brings its own config\.json"):
        _build(ckpt, tmp_path / "art", config=str(_tiny_config(tmp_path)))
    assert not (tmp_path / "art").exists()


def test_bundled_name_without_its_suffix(tmp_path):
    """``mxc build llama`` is ``mxc build llama.yaml``."""
    a, b = _build("llama", tmp_path / "a"), _build("llama.yaml", tmp_path / "b")
    assert (a / "graph.yaml").read_text() == (b / "graph.yaml").read_text()
    assert json.loads((a / "manifest.json").read_text())["model_file"] == "llama.yaml"


@pytest.mark.parametrize("source", ["nosuch/llama.yaml", "nosuch/llama"])
def test_a_missing_path_is_not_the_bundled_definition_of_its_name(source, tmp_path):
    """Only a bare name falls back to the bundled definitions: a path in a folder that does not hold the file is a
    typo to report, not ``llama.yaml``."""
    with pytest.raises(mxc.MxcError, match=rf"^{source}: no such file, and not a bundled definition"):
        _build(source, tmp_path / "art")


def test_bundled_definition_with_config_takes_the_registry_settings(hf_checkpoint, tmp_path):
    """``mxc build llama.yaml --config qwen3/config.json`` (random weights at a real configuration) binds as the
    checkpoint itself does: with the registry's settings for Qwen3 (its per-head q/k norms)."""
    ckpt, _ = hf_checkpoint("Qwen3ForCausalLM", head_dim=32)
    from_ckpt = _build(ckpt, tmp_path / "from_ckpt")
    from_config = _build("llama.yaml", tmp_path / "from_config", config=str(ckpt / "config.json"))
    assert (from_config / "graph.yaml").read_text() == (from_ckpt / "graph.yaml").read_text()
    assert json.loads((from_config / "manifest.json").read_text())["source"]["weights"] == "dummy"


def test_own_definition_reads_its_tiny_config_beside_it(tmp_path):
    """A user's definition names its tiny_config relative to itself, not to the bundled definitions' folder."""
    defs = tmp_path / "defs"
    (defs / "configs").mkdir(parents=True)
    shutil.copyfile(MODELS_DIR / "llama.yaml", defs / "mine.yaml")
    _tiny_config(defs / "configs", name="tiny-llama.json", vocab_size=128)
    art = _build(defs / "mine.yaml", tmp_path / "art")
    assert mxc.load(art).vocab_size == 128


def test_own_definition_with_a_config_naming_no_architectures_builds_an_artifact_that_loads(tmp_path, capsys):
    """A user's definition needs no architectures in the config it binds: the manifest records none (null), and the
    artifact loads, generates and is inspected, where it was refused by its own loader as a damaged manifest."""
    from mxc.cli import main

    shutil.copyfile(MODELS_DIR / "llama.yaml", tmp_path / "mine.yaml")
    config = json.loads((MODELS_DIR / "configs" / "tiny-llama.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    art = _build(tmp_path / "mine.yaml", tmp_path / "art", config=str(tmp_path / "config.json"))
    assert json.loads((art / "manifest.json").read_text())["architecture"] is None
    assert mxc.load(art).generate([[1, 2, 3]], max_new_tokens=2).shape[-1] >= 2
    assert main(["inspect", str(art)]) in (0, None)
    assert "(no architectures in config.json) (mine.yaml, family llama)" in capsys.readouterr().out


def test_own_definition_without_tiny_config_or_checkpoint_is_refused(tmp_path):
    text = (MODELS_DIR / "llama.yaml").read_text()
    assert text.count("tiny_config: configs/tiny-llama.json\n") == 1
    (tmp_path / "mine.yaml").write_text(text.replace("tiny_config: configs/tiny-llama.json\n", ""))
    with pytest.raises(mxc.MxcError, match=r"mine\.yaml: no --checkpoint given and the definition names no "
                                           r"tiny_config"):
        _build(tmp_path / "mine.yaml", tmp_path / "art")


def test_own_definition_whose_tiny_config_is_not_beside_it_says_where_it_looked(tmp_path):
    """A copy of llama.yaml in another folder: its tiny_config is read relative to the copy, and is not there."""
    shutil.copyfile(MODELS_DIR / "llama.yaml", tmp_path / "my.yaml")
    with pytest.raises(mxc.MxcError) as e:
        _build(tmp_path / "my.yaml", tmp_path / "art")
    assert str(e.value) == (f"{tmp_path / 'my.yaml'}: tiny_config configs/tiny-llama.json not found (relative to "
                            f"my.yaml's folder); pass --checkpoint or --config")


@pytest.mark.parametrize("name", ["config.json", "tiny.json", "Tiny.JSON"])
def test_a_config_json_as_source_is_refused_as_such(hf_checkpoint, tmp_path, name):
    """``mxc build ckpt/config.json`` read the config as a model definition: 'architectures: unknown section'."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    if name != "config.json":
        shutil.copyfile(ckpt / "config.json", ckpt / name)
    what = "a config.json" if name == "config.json" else "a JSON file"
    for kw in ({}, {"checkpoint": str(ckpt)}):
        with pytest.raises(mxc.MxcError) as e:
            _build(ckpt / name, tmp_path / "art", **kw)
        assert str(e.value) == (f"{ckpt / name}: {what}, not a model definition; pass its folder (mxc build {ckpt}) "
                                f"or use --config")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("eos, ids", [(0, [0]), ([2, 7], [2, 7]), (None, [])])
def test_eos_token_ids_reach_the_manifest(eos, ids, tmp_path):
    """config.json's eos_token_id, one id (0 included), a list or null, is the runtime's list of stop tokens."""
    art = _build("llama.yaml", tmp_path / "art", config=str(_tiny_config(tmp_path, eos_token_id=eos)))
    assert json.loads((art / "manifest.json").read_text())["runtime"]["eos_token_id"] == ids
    assert mxc.load(art).eos_token_ids == ids


@pytest.mark.parametrize("eos", [-1, True, [2, -1], [2, False], 2.0, 256, [2, 999]])
def test_eos_token_ids_that_are_not_token_ids_are_refused(eos, tmp_path):
    with pytest.raises(mxc.MxcError, match=r"config\.json: eos_token_id .*: expected a token id or a list of token "
                                           r"ids") as e:
        _build("llama.yaml", tmp_path / "art", config=str(_tiny_config(tmp_path, eos_token_id=eos)))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("config_eos, gen_eos, ids", [(2, [7, 2], [7, 2]), ([2, 5], 9, [9]), (None, 4, [4]),
                                                   (3, None, [3]), (3, [], [3])])
def test_generation_config_eos_ids_replace_config_jsons(config_eos, gen_eos, ids, hf_checkpoint, tmp_path):
    """transformers' generate stops at generation_config.json's eos_token_id alone, in its order (its first pads):
    the artifact's stop tokens are those, or config.json's where generation_config.json names none."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": config_eos}))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    art = _build(ckpt, tmp_path / "art")
    assert mxc.load(art).eos_token_ids == ids


@pytest.mark.parametrize("text, pattern", [('{"eos_token_id": 300}', r"eos_token_id 300: expected a token id .* below "
                                                                       r"vocab_size 256"),
                                           ("{not json", r"not valid JSON")])
def test_a_bad_generation_config_is_named(text, pattern, hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    (ckpt / "generation_config.json").write_text(text)
    with pytest.raises(mxc.MxcError, match=r"generation_config\.json: " + pattern) as e:
        _build(ckpt, tmp_path / "art")
    assert "\n" not in str(e.value)


def test_a_config_that_is_not_a_json_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(mxc.MxcError, match=r"config\.json: expected a JSON object"):
        _build("llama.yaml", tmp_path / "art", config=str(tmp_path / "config.json"))


def test_progress_off_writes_nothing_to_stderr(tmp_path, capfd):
    """``progress=False`` (and a log of one's own) is a silent build: the weight converter's progress bar too."""
    capfd.readouterr()
    logged = []
    mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=logged.append)
    assert capfd.readouterr().err == ""
    assert logged and logged[-1] == f"wrote {tmp_path / 'art'}"


# a Hugging Face tokenizer's files (its chat template included) and the generation config, as a checkpoint carries
# them
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _tokenizer_json() -> str:
    """A tokenizer.json the ``tokenizers`` library reads (the build refuses one it cannot)."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).to_str()


def test_the_checkpoints_tokenizer_files_are_copied_and_listed(hf_checkpoint, tmp_path):
    """Every tokenizer file the checkpoint holds goes to ``tokenizer/`` unchanged (an HF tokenizer directory), each
    listed in the manifest with its sha256; the checkpoint's other files do not."""
    import hashlib

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    for i, name in enumerate(HF_TOKENIZER_FILES):
        (ckpt / name).write_text(_tokenizer_json() if name == "tokenizer.json" else f'{{"file": {i}}}')
    (ckpt / "README.md").write_text("a model card")
    art = _build(ckpt, tmp_path / "art")
    assert sorted(p.name for p in (art / "tokenizer").iterdir()) == sorted(HF_TOKENIZER_FILES)
    files = json.loads((art / "manifest.json").read_text())["files"]
    for name in HF_TOKENIZER_FILES:
        data = (art / "tokenizer" / name).read_bytes()
        assert data == (ckpt / name).read_bytes()
        assert files[f"tokenizer/{name}"] == hashlib.sha256(data).hexdigest()
    assert not (art / "tokenizer" / "config.json").exists()


def test_a_folder_named_like_a_tokenizer_file_is_left_out(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    (ckpt / "tokenizer.json").write_text(_tokenizer_json())
    (ckpt / "tokenizer.model").mkdir()  # e.g. a sentencepiece model's source folder
    art = _build(ckpt, tmp_path / "art")
    names = {p.name for p in (art / "tokenizer").iterdir()}
    assert "tokenizer.json" in names and "tokenizer.model" not in names
    mxc.load(art)


def test_a_tp_build_writes_a_weight_file_a_rank_and_says_how_many(tmp_path):
    """The manifest's tp is what the runtime reads to load (and check) the ranks' weight files."""
    art = _build("llama.yaml", tmp_path / "art", tp=2)
    assert sorted(p.name for p in (art / "weights").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    assert json.loads((art / "manifest.json").read_text())["tp"] == 2


def _dummy(*weights):
    from mxc.ir import Graph
    from mxc.loaders.dummy import DummyCheckpoint

    return DummyCheckpoint(Graph("t", "float32", {}, {}, {w.name: w for w in weights}, (), ()))


def test_dummy_weights_depend_on_the_name_only_not_the_read_order():
    """Without a checkpoint, every tensor is N(0, 0.02) (norm scales 1 + N(0, 0.02)) drawn from its own name: the same
    values in any read order, different values for different names, and get() in the dtype dtype() reports."""
    from mxc.ir import Weight

    weights = [Weight("a", (64, 32), "float32", ("a.weight",)), Weight("b", (64, 32), "float32", ("b.weight",)),
               Weight("n", (4096,), "float32", ("n.weight",), init="ones")]
    first = _dummy(*weights)
    a, b = first.get("a.weight"), first.get("b.weight")
    second = _dummy(*weights)
    assert torch.equal(second.get("b.weight"), b) and torch.equal(second.get("a.weight"), a)
    assert not torch.equal(a, b) and a.dtype == first.dtype("a.weight") == torch.float32
    assert abs(a.std().item() - 0.02) < 0.002 and abs(a.mean().item()) < 0.002
    n = first.get("n.weight")
    assert abs(n.mean().item() - 1) < 0.002 and abs(n.std().item() - 0.02) < 0.002


def test_large_dummy_tensors_repeat_one_block_to_any_size():
    """A tensor past the 256K-element random block (not a multiple of it) repeats the block to its exact size; one of
    256K elements or fewer repeats nothing."""
    from mxc.ir import Weight

    block = 1 << 18
    ckpt = _dummy(Weight("big", (513, 512), "float32", ("big.weight",)),
                  Weight("whole", (512, 512), "float32", ("whole.weight",)))
    big = ckpt.get("big.weight")
    assert big.shape == (513, 512) and torch.equal(big.flatten()[block:], big.flatten()[:513 * 512 - block])
    whole = ckpt.get("whole.weight").flatten()
    assert whole.shape == (block,) and whole[:block // 2].unique().numel() > block // 4
    assert not torch.equal(whole[:1024], whole[1024:2048])



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dummy_tensors_asked_in_a_dtype_are_the_float32_values_cast(dtype):
    """A build without --quant asks for each dummy tensor in the weight's dtype (``read_full``): the block is cast,
    then repeated, which must give the bytes of the float32 tensor cast as a whole (the artifacts of earlier builds),
    for a ragged size past the block, a whole block, a small tensor and a norm's 1 + N(0, 0.02)."""
    from mxc.ir import Weight

    ckpt = _dummy(Weight("big", (513, 512), "float32", ("big.weight",)),
                  Weight("whole", (512, 512), "float32", ("whole.weight",)),
                  Weight("small", (3, 5), "float32", ("small.weight",)),
                  Weight("n", (300000,), "float32", ("n.weight",), init="ones"))
    for name in ("big.weight", "whole.weight", "small.weight", "n.weight"):
        want = ckpt.get(name).to(dtype)
        got = ckpt.get(name, dtype)
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name

ONE_LAYER = """\
family: one-layer
params:
  hidden_size: {type: int}
  num_attention_heads: {type: int}
  num_key_value_heads: {type: int}
  head_dim: {default: hidden_size // num_attention_heads, type: int}
  vocab_size: {type: int}
  rms_norm_eps: {}
  rope: {resolve: llama_rope}
inputs:
  tokens: {shape: [T], dtype: int64}
  positions: {shape: [T], dtype: int64}
  logit_rows: {shape: [R], dtype: int64}
weights:
  embed:  {shape: [vocab_size, hidden_size], hf: model.embed_tokens.weight}
  ln1:    {shape: [hidden_size], hf: model.layers.0.input_layernorm.weight}
  wq:     {shape: [num_attention_heads*head_dim, hidden_size], hf: model.layers.0.self_attn.q_proj.weight}
  wk:     {shape: [num_key_value_heads*head_dim, hidden_size], hf: model.layers.0.self_attn.k_proj.weight}
  wv:     {shape: [num_key_value_heads*head_dim, hidden_size], hf: model.layers.0.self_attn.v_proj.weight}
  wo:     {shape: [hidden_size, num_attention_heads*head_dim], hf: model.layers.0.self_attn.o_proj.weight}
  ln2:    {shape: [hidden_size], hf: model.layers.0.post_attention_layernorm.weight}
  w_gate: {shape: [intermediate_size, hidden_size], hf: model.layers.0.mlp.gate_proj.weight}
  w_up:   {shape: [intermediate_size, hidden_size], hf: model.layers.0.mlp.up_proj.weight}
  w_down: {shape: [hidden_size, intermediate_size], hf: model.layers.0.mlp.down_proj.weight}
  norm_f: {shape: [hidden_size], hf: model.norm.weight}
  lm_head: {shape: [vocab_size, hidden_size], hf: lm_head.weight}
graph:
  - x = embedding(tokens, embed)
  - q = heads(linear(rms_norm(x, ln1, eps=rms_norm_eps), wq), size=head_dim)
  - k = heads(linear(rms_norm(x, ln1, eps=rms_norm_eps), wk), size=head_dim)
  - v = heads(linear(rms_norm(x, ln1, eps=rms_norm_eps), wv), size=head_dim)
  - q, k = rope(q, k, positions, spec=rope)
  - a = attention(q, k, v, scale=head_dim**-0.5, layer=0)
  - x = add(x, linear(flatten_heads(a), wo))
  - h = rms_norm(x, ln2, eps=rms_norm_eps)
  - x = add(x, linear(mul(silu(linear(h, w_gate)), linear(h, w_up)), w_down))
  - logits = linear(rms_norm(gather_rows(x, logit_rows), norm_f, eps=rms_norm_eps), lm_head)
outputs: [logits]
"""


def test_a_definition_without_a_repeat_block(hf_checkpoint, tmp_path):
    """A model file may write its layers out instead of repeating a block (the runtime then has no per-layer
    weights to split): a one-layer Llama so written matches transformers, logits and cached greedy decoding."""
    ckpt, hf = hf_checkpoint("LlamaForCausalLM", num_hidden_layers=1)
    own = tmp_path / "one-layer.yaml"
    own.write_text(ONE_LAYER.replace("  rms_norm_eps: {}", "  rms_norm_eps: {}\n  intermediate_size: {type: int}"))
    art = _build(own, tmp_path / "art", checkpoint=str(ckpt))
    assert json.loads((art / "manifest.json").read_text())["runtime"]["layers"] is None
    model = mxc.load(art)
    with torch.no_grad():
        ref = hf(IDS).logits
        want = hf.generate(IDS, max_new_tokens=8, do_sample=False, min_new_tokens=8)[:, IDS.shape[1]:]
    assert float((model.logits(IDS) - ref).abs().max() / ref.abs().max()) <= 1e-4
    assert torch.equal(model.generate(IDS, max_new_tokens=8), want)
