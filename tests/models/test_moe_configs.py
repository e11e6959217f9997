"""Mixtures of experts under valid but unusual configs, against transformers on tiny random checkpoints.

Routing at its edges (one expert a token, every expert a token, a single expert), ``norm_topk_prob`` both ways
where transformers reads it and the other way where it does not (Mixtral always renormalises), expert widths that
are no multiple of 8 or 16 and hidden sizes that are no power of two, many experts with fewer tokens than experts,
a shared expert narrower than the routed ones: float32 logits within 1e-4 of the logits' scale and the same 16
greedy tokens as HF ``generate``. Then what mxc refuses rather than builds wrong: a Qwen2-MoE shared expert of
width 0, and an expert width that ``--tp 2`` cannot halve (a width it can halve, to 11 rows a rank, runs on two
gloo ranks against HF).
"""

from __future__ import annotations

import json

import pytest
import torch

import mxc
from mxc.runtime.ranks import run_ranks

MIXTRAL, QWEN2, QWEN3, OLMOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
ODD = dict(hidden_size=80, num_attention_heads=5, head_dim=16)  # 80 wide: no power of two; heads of 16 for RoPE
CASES = {
    "mixtral-top1": (MIXTRAL, dict(num_local_experts=4, num_experts_per_tok=1)),
    "mixtral-one-expert": (MIXTRAL, dict(num_local_experts=1, num_experts_per_tok=1, intermediate_size=33)),
    # transformers' Mixtral router renormalises whatever the config says
    "mixtral-all-experts-stray-norm-false": (MIXTRAL, dict(num_local_experts=3, num_experts_per_tok=3,
                                                           norm_topk_prob=False)),
    "qwen2-moe-top1-renorm-tiny-shared": (QWEN2, dict(num_experts=5, num_experts_per_tok=1, norm_topk_prob=True,
                                                      moe_intermediate_size=13, shared_expert_intermediate_size=1)),
    "qwen2-moe-all-experts-odd": (QWEN2, dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=13,
                                              shared_expert_intermediate_size=7, num_key_value_heads=1, **ODD)),
    "qwen3-moe-64-experts-odd": (QWEN3, dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=11,
                                             norm_topk_prob=True, num_key_value_heads=1, **ODD)),
    "qwen3-moe-one-expert": (QWEN3, dict(num_experts=1, num_experts_per_tok=1, moe_intermediate_size=24)),
    "olmoe-renorm-odd": (OLMOE, dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, intermediate_size=19,
                                     num_key_value_heads=5, **ODD)),
}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _eager_experts_where_needed(hf) -> None:
    """transformers' default experts path (grouped_mm) refuses on the CPU weights whose rows are not 16-byte aligned
    (an expert width of 13 in float32); its eager loop is the same computation, one expert at a time."""
    c = hf.config
    widths = (c.hidden_size, getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    if any(w * 4 % 16 for w in widths):
        hf.config._experts_implementation = "eager"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf(case, hf_checkpoint, tmp_path):
    arch, overrides = CASES[case]
    ckpt, hf = hf_checkpoint(arch, **overrides)
    _eager_experts_where_needed(hf)
    _matches_hf(ckpt, hf, tmp_path, seed=1, new=16)


def _matches_hf(ckpt, hf, tmp_path, seed, new):
    """``ckpt`` built for the CPU against transformers: logits within 1e-4 of their scale, the same greedy tokens."""
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        ref_tokens = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)[:, ids.shape[1]:]
    assert _rel_err(model.logits(ids), ref) <= 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=new), ref_tokens)


def test_a_qwen2_moe_shared_expert_of_width_zero_is_refused_naming_the_field(hf_checkpoint, tmp_path):
    """transformers builds and runs a shared expert 0 rows wide (its zero-size tensors in the checkpoint); mxc has
    no shared expert of width 0 and says so in one line naming the field, not the tensors it did not expect."""
    ckpt, hf = hf_checkpoint(QWEN2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=0)
    with torch.no_grad():
        assert torch.isfinite(hf(torch.tensor([[1, 2, 3]])).logits).all()
    with pytest.raises(mxc.MxcError, match=r"config\.json: `shared_expert_intermediate_size == 0` is true, which is "
                                           r"not supported for Qwen2MoeForCausalLM") as e:
        mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()


@pytest.mark.parametrize("arch", [QWEN2, QWEN3])
def test_mlp_only_layers_naming_no_layer_builds_and_one_naming_a_layer_is_refused(arch, hf_checkpoint, tmp_path):
    """transformers makes layer i dense where ``i in mlp_only_layers``: indices past the last layer, or negative,
    make none, so such a list is the model of the empty one and builds, matching HF (registry.yaml layer_lists).
    A list naming a real layer (0) is still refused in one line naming the field."""
    layers = 3
    sizes = dict(num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == QWEN2:
        sizes["shared_expert_intermediate_size"] = 48
    ckpt, hf = hf_checkpoint(arch, name="past", mlp_only_layers=[layers + 3, -1], **sizes)
    assert hf.config.mlp_only_layers == [layers + 3, -1]  # kept as given, in config.json too
    assert json.loads((ckpt / "config.json").read_text())["mlp_only_layers"] == [layers + 3, -1]
    assert all("Sparse" in type(layer.mlp).__name__ for layer in hf.model.layers)  # every layer has experts
    _eager_experts_where_needed(hf)
    _matches_hf(ckpt, hf, tmp_path, seed=3, new=8)

    ckpt, hf = hf_checkpoint(arch, name="first", mlp_only_layers=[layers + 3, 0], **sizes)
    assert "Sparse" not in type(hf.model.layers[0].mlp).__name__  # layer 0 dense: a model mxc does not build
    with pytest.raises(mxc.MxcError, match=rf"/config\.json: `mlp_only_layers` is true, which is not supported for "
                                           rf"{arch} \(registry\.yaml refuse_if\)$") as e:
        mxc.build(str(ckpt), out=tmp_path / "refused", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()


IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))


def _tp_worker(rank, world_size, device, path: str, out_path: str):
    model = mxc.load(path, rank=rank, world_size=world_size)
    result = (model.logits(IDS), model.generate(IDS, max_new_tokens=8))
    if rank == 0:
        torch.save(result, out_path)


def test_tp2_expert_widths(hf_checkpoint, tmp_path):
    """--tp 2 over experts 13 wide (and a shared expert 13 wide) is refused in one line naming the field; experts 22
    wide with a shared expert 2 wide split into 11 and 1 rows a rank and match HF on two gloo ranks."""
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        sizes = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, field: 13}
        ckpt, _ = hf_checkpoint(QWEN2, name=field, num_experts=4, num_experts_per_tok=2, **sizes)
        with pytest.raises(mxc.MxcError, match=rf"`{field}` = 13 gives 13 parts, neither divisible by tp=2") as e:
            mxc.build(str(ckpt), out=tmp_path / f"{field}-tp2", tp=2, progress=False, log=lambda m: None)
        assert "\n" not in str(e.value)

    ckpt, hf = hf_checkpoint(QWEN2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=22,
                             shared_expert_intermediate_size=2)
    _eager_experts_where_needed(hf)
    art = mxc.build(str(ckpt), out=tmp_path / "tp2", tp=2, progress=False, log=lambda m: None)
    out = tmp_path / "result.pt"
    run_ranks(_tp_worker, 2, "cpu", str(art), str(out))
    logits, tokens = torch.load(out, weights_only=True)
    with torch.no_grad():
        ref = hf(IDS).logits.float()
        ref_tokens = hf.generate(IDS, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, IDS.shape[1]:]
    assert _rel_err(logits, ref) <= 1e-4
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch,count,alias,experts", [(MIXTRAL, "num_local_experts", "num_experts", 4),
                                                      (QWEN3, "num_local_experts", "num_experts", 4),
                                                      (OLMOE, "num_experts", "num_local_experts", 4)])
def test_expert_count_under_transformers_other_name(arch, count, alias, experts, hf_checkpoint, tmp_path):
    """transformers' config classes read one expert-count field under two names (``attribute_map``: Mixtral's
    num_experts is its num_local_experts, OLMoE's num_local_experts its num_experts). A config.json giving only the
    other name took the registry's default count (8, 64, 128) and failed on the weights' shapes; both names with
    different counts are refused, naming the two."""
    import json

    ckpt, hf = hf_checkpoint(arch, **{count: experts}, num_experts_per_tok=2)
    config = json.loads((ckpt / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):
        config.pop(key, None)
    (ckpt / "config.json").write_text(json.dumps({**config, alias: experts}))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert _rel_err(mxc.load(art).logits(ids), ref) <= 1e-4
    (ckpt / "config.json").write_text(json.dumps({**config, alias: experts, count: experts + 1}))
    with pytest.raises(mxc.MxcError, match=rf"config\.json: {alias} \({experts}\) and {count} \({experts + 1}\) are "
                                           rf"one field for {arch} \(transformers reads {alias} as {count}\)"):
        mxc.build(str(ckpt), out=tmp_path / "both", progress=False, log=lambda m: None)
