"""A model file written outside mxc/models for a checkpoint that stores projections fused (Phi-3's qkv_proj and
gate_up_proj): parity with transformers, and tensor parallelism over the fused tensors.

A fused tensor sharded as one part would give each rank a contiguous slice of its rows (all of the gate, none of
the up): the shard spec's ``parts`` split each projection on its own, and a fused tensor without them is refused
at --tp > 1 (it was built, and its logits were wrong).
"""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.errors import MxcError
from mxc.runtime.ranks import run_ranks

QKV_PARTS = "[num_attention_heads*head_dim, num_key_value_heads*head_dim, num_key_value_heads*head_dim]"
PHI3 = """\
family: phi3
params:
  hidden_size: {type: int, min: 1}
  num_hidden_layers: {type: int, min: 1}
  num_attention_heads: {type: int, min: 1}
  num_key_value_heads: {default: num_attention_heads, type: int, min: 1}
  head_dim: {default: hidden_size // num_attention_heads, type: int, min: 1}
  intermediate_size: {type: int, min: 1}
  vocab_size: {type: int, min: 1}
  rms_norm_eps: {default: 1e-5}
  hidden_act: {default: "'silu'", one_of: [silu]}
  tie_word_embeddings: {default: false}
  sliding_window: {default: null, type: int, min: 1}
  rope: {resolve: rope}
inputs:
  tokens: {shape: [T], dtype: int64}
  positions: {shape: [T], dtype: int64}
  logit_rows: {shape: [R], dtype: int64}
weights:
  embed:   {shape: [vocab_size, hidden_size], hf: model.embed_tokens.weight, shard: vocab}
  norm_f:  {shape: [hidden_size], hf: model.norm.weight, init: ones}
  lm_head: {shape: [vocab_size, hidden_size], hf: lm_head.weight, shard: vocab, tied_to: embed,
            tied_if: tie_word_embeddings}
graph:
  - x = embedding(tokens, embed)
  - repeat: {count: num_hidden_layers, index: i, name: "layers.{i}.", hf_prefix: "model.layers.{i}."}
    weights:
      ln1:  {shape: [hidden_size], hf: input_layernorm.weight, init: ones}
      wqkv: {shape: [(num_attention_heads + 2*num_key_value_heads)*head_dim, hidden_size],
             hf: self_attn.qkv_proj.weight, shard: QKV_SHARD}
      wo:   {shape: [hidden_size, num_attention_heads*head_dim], hf: self_attn.o_proj.weight,
             shard: {kind: row, unit: head_dim}}
      ln2:  {shape: [hidden_size], hf: post_attention_layernorm.weight, init: ones}
      w_gate_up: {shape: [2*intermediate_size, hidden_size], hf: mlp.gate_up_proj.weight, shard: GATE_UP_SHARD}
      w_down: {shape: [hidden_size, intermediate_size], hf: mlp.down_proj.weight, shard: row}
    body:
      - h = rms_norm(x, ln1, eps=rms_norm_eps)
      - q, k, v = split(linear(h, wqkv), sizes=QKV_PARTS)
      - q, k = rope(heads(q, size=head_dim), heads(k, size=head_dim), positions, spec=rope)
      - a = attention(q, k, heads(v, size=head_dim), scale=head_dim**-0.5, layer=i, sliding_window=sliding_window)
      - x = add(x, linear(flatten_heads(a), wo))
      - x = add(x, linear(silu_mul(linear(rms_norm(x, ln2, eps=rms_norm_eps), w_gate_up)), w_down))
  - logits = linear(rms_norm(gather_rows(x, logit_rows), norm_f, eps=rms_norm_eps), lm_head)
outputs: [logits]
""".replace("QKV_PARTS", QKV_PARTS)
QKV_SHARD = "{kind: column, unit: head_dim, parts: " + QKV_PARTS + "}"
GATE_UP_SHARD = "{kind: column, parts: [intermediate_size, intermediate_size]}"
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _model_file(tmp_path, qkv_shard=QKV_SHARD, gate_up_shard=GATE_UP_SHARD):
    path = tmp_path / "phi3.yaml"
    path.write_text(PHI3.replace("QKV_SHARD", qkv_shard).replace("GATE_UP_SHARD", gate_up_shard))
    return path


def _build(model_file, ckpt, out, tp=1):
    return str(mxc.build(str(model_file), checkpoint=str(ckpt), out=out, tp=tp, progress=False, log=lambda m: None))


def _worker(rank, world_size, device, art, out_path):
    logits = mxc.load(art, rank=rank, world_size=world_size).logits(IDS)
    if rank == 0:
        torch.save(logits, out_path)


def _close(logits, ref):
    return float((logits - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True},
                                       {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5}}],
                         ids=["plain", "tied", "partial-rotary"])
def test_phi3_definition_matches_hf(overrides, hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("Phi3ForCausalLM", **overrides)
    model = mxc.load(_build(_model_file(tmp_path), ckpt, tmp_path / "art"))
    with torch.no_grad():
        ref = hf(IDS).logits.float()
        ref_greedy = hf.generate(IDS, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, IDS.shape[1]:]
    assert _close(model.logits(IDS), ref)
    assert torch.equal(model.generate(IDS, max_new_tokens=8), ref_greedy)


def test_fused_weights_with_parts_shard_at_tp2(hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("Phi3ForCausalLM")
    art = _build(_model_file(tmp_path), ckpt, tmp_path / "art", tp=2)
    run_ranks(_worker, 2, "cpu", art, str(tmp_path / "logits.pt"))
    with torch.no_grad():
        ref = hf(IDS).logits.float()
    assert _close(torch.load(tmp_path / "logits.pt", weights_only=True), ref)


@pytest.mark.parametrize("qkv_shard, gate_up_shard, op, weight", [
    (QKV_SHARD, "column", "silu_mul", "w_gate_up"),
    ("{kind: column, unit: head_dim}", GATE_UP_SHARD, "split", "wqkv"),
], ids=["gate-up", "qkv"])
def test_fused_weight_sharded_as_one_part_is_refused(qkv_shard, gate_up_shard, op, weight, hf_checkpoint,
                                                     tmp_path):
    ckpt, _ = hf_checkpoint("Phi3ForCausalLM")
    with pytest.raises(MxcError, match=rf"--tp 2: the {op} at phi3.yaml:\d+ takes apart layers.{{i}}.{weight}'s "
                                       r"rows .*declare them: shard: {kind: column, parts: \[...\]}"):
        _build(_model_file(tmp_path, qkv_shard, gate_up_shard), ckpt, tmp_path / "art", tp=2)


@pytest.mark.parametrize("gate_up_shard, says", [
    ("{kind: column, parts: [intermediate_size, 2]}", "parts [96, 2] add up to 98, not the 192 rows of the weight"),
    ("{kind: column, parts: [intermediate_size]}", "expected a list of two or more part sizes"),
    ("{kind: column, parts: [intermediate_size, intermediate_size - 96]}",
     "'intermediate_size - 96' evaluates to 0; expected a positive integer"),
    ("{kind: row, parts: [intermediate_size, intermediate_size]}", "parts are for a column-parallel weight"),
], ids=["sum", "one", "zero", "row"])
def test_bad_parts_name_the_line(gate_up_shard, says, hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("Phi3ForCausalLM")
    model_file = _model_file(tmp_path, gate_up_shard=gate_up_shard)
    line = next(i for i, ln in enumerate(model_file.read_text().splitlines(), 1) if "w_gate_up:" in ln)
    with pytest.raises(MxcError, match=rf"phi3.yaml:{line}: repeat.weights.w_gate_up.shard.parts: "):
        _build(model_file, ckpt, tmp_path / "art")
    with pytest.raises(MxcError) as e:
        _build(model_file, ckpt, tmp_path / "art")
    assert says in str(e.value)
