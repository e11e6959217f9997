"""Mixture of experts on the GPU: the fused MoE kernel at real shapes and a tiny Qwen3-MoE end to end vs HF; a tiny
Mixtral's float32 routing weights end to end."""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.kernels import moe_ref, triton_moe, triton_moe_decode, triton_route


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_fused_moe_qwen3_30b_shapes(t):
    e, h, i, k = 128, 2048, 768, 8
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    w, ids = moe_ref.route(torch.randn(t, e, device="cuda", dtype=torch.bfloat16), k, renormalize=True)
    assert _rel(triton_moe.fused_moe(x, w, ids, w1, w2), moe_ref.fused_moe(x, w, ids, w1, w2)) < 2e-2


@pytest.mark.parametrize("t", [1, 4])
def test_pair_moe_qwen3_30b_shapes(t):
    """The per-pair decode kernels, expert-by-expert and tiled down, against the reference; the two
    down kernels give equal bits."""
    e, h, i, k = 128, 2048, 768, 8
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    w, ids = moe_ref.route(torch.randn(t, e, device="cuda", dtype=torch.bfloat16), k, renormalize=True)
    up, _ = triton_moe_decode.config_for(h, i, x.dtype)
    ys = [triton_moe_decode.fused_moe(x, w, ids, w1, w2, configs=(up, triton_moe_decode.PairConfig(
        BLOCK_N=bn, BLOCK_K=256, TILE=tile))) for bn, tile in ((16, False), (8, True))]
    assert _rel(ys[0], moe_ref.fused_moe(x, w, ids, w1, w2)) < 2e-2
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_qwen3_30b_shapes(t, scoring, renormalize):
    """The one-kernel router against the torch composition: 128 experts, top 8, bf16 logits."""
    logits = torch.randn(t, 128, device="cuda", dtype=torch.bfloat16) * 2
    w, ids = triton_route.route(logits, 8, scoring, renormalize)
    ref_w, ref_ids = moe_ref.route(logits, 8, scoring, renormalize)
    # bf16 logits tie often; torch.topk orders ties freely: compare the chosen sets, sorted by expert
    # id, on the rows without a tie between the 8th and 9th scores (where the set itself is free)
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    top = scores.topk(9, dim=-1).values
    clear = top[:, 7] > top[:, 8]
    ids_s, order = ids.sort(dim=1)
    ref_s, ref_order = ref_ids.sort(dim=1)
    assert clear.float().mean() > 0.5 and torch.equal(ids_s[clear], ref_s[clear])
    assert _rel(w.gather(1, order)[clear], ref_w.gather(1, ref_order)[clear]) < 1e-2


@pytest.mark.parametrize("arch,overrides", [
    ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=64, norm_topk_prob=True)),
    ("OlmoeForCausalLM", dict(intermediate_size=64)),  # q/k norm over the whole projections
])
def test_moe_cuda_matches_hf(arch, overrides, hf_checkpoint, greedy_check, tmp_path):
    ckpt, hf = hf_checkpoint(arch, hidden_size=128, num_experts=8, num_experts_per_tok=2, **overrides)
    _cuda_build_matches_hf(ckpt, hf, greedy_check, tmp_path)


def _cuda_build_matches_hf(ckpt, hf, greedy_check, tmp_path):
    """A bf16 cuda build of ``ckpt`` against transformers (``hf``, moved to the GPU in bf16): the prefill's logits
    within 3%, then the decode path (the per-pair expert kernels, the fused norm + router) at every greedy step.
    A router near-tie can move a token's logits by more than the dense models' bf16 noise, so a flip counts as a tie
    within what the prefill's own measured error explains (two sides of it), at least the default 2%. Returns the
    artifact's path and transformers' model."""
    art = mxc.build(str(ckpt), out=tmp_path / "a", target="cuda", dtype="bfloat16", max_batch=4, max_seq_len=64,
                    progress=False, log=lambda m: None)
    model = mxc.load(art, device="cuda")
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits.float().cpu()
    err = _rel(model.logits(ids).cpu(), ref)
    assert err < 3e-2
    greedy_check(ids, model.generate(ids, max_new_tokens=12), lambda seq: hf(seq.cuda()).logits,
                 tol=max(2e-2, 2.5 * err))
    return art, hf


def test_mixtral_fp32_routing_weights_cuda_matches_hf(hf_checkpoint, greedy_check, tmp_path):
    """A bf16 Mixtral keeps its routing weights in float32, as transformers' MixtralTopKRouter does (the others cast
    them to the logits' dtype): the compiled routers store fp32 weights and the fused MoE kernels read them (the
    sorted path's products stay fp32 until the k-sum); logits and greedy tokens against transformers in bf16, and
    the kernels' MoE block against transformers' on the GPU."""
    import json

    ckpt, hf = hf_checkpoint("MixtralForCausalLM", hidden_size=128, intermediate_size=64, num_local_experts=8,
                             num_experts_per_tok=2)
    art, hf = _cuda_build_matches_hf(ckpt, hf, greedy_check, tmp_path)
    index = json.loads((art / "code" / "kernels" / "index.json").read_text())
    routing = {e["kernel"].split(":")[1]: e["args"] for e in index.values()
               if e["kernel"].split(":")[1] in ("route_kernel", "norm_route_kernel", "_moe_gemm2_kernel")}
    assert set(routing) == {"route_kernel", "norm_route_kernel", "_moe_gemm2_kernel"}
    assert routing["route_kernel"] == ["*bf16", "*fp32", "*i64"] and routing["norm_route_kernel"][7] == "*fp32"
    assert "*fp32" in routing["_moe_gemm2_kernel"]
    # one MoE block, the kernels against transformers' (its default experts path) on the same bf16 input
    block = hf.model.layers[0].mlp
    for t in (3, 64):  # the per-pair decode kernels, the sorted path
        x = torch.randn(t, 128, device="cuda", dtype=torch.bfloat16)
        moe = triton_moe_decode if t <= 4 else triton_moe
        with torch.no_grad():
            w, e = triton_route.route(x @ block.gate.weight.t(), 2, renormalize=True, fp32_weights=True)
            want = block(x[None])[0]
            got = moe.fused_moe(x, w, e, block.experts.gate_up_proj.contiguous(),
                                block.experts.down_proj.contiguous())
        assert w.dtype == torch.float32 and got.dtype == torch.bfloat16
        assert _rel(got, want) < 2e-2, (t, _rel(got, want))


@pytest.mark.parametrize("t", [1, 4, 64, 1024])
def test_block_scaled_fp8_experts_qwen3_30b_shapes(t):
    """fp8 experts with 128x128 block scales (an already-fp8 checkpoint's), each block at its own magnitude: the
    pair kernels (1 and 4 tokens, tiled and looped down) and the sorted kernels against the reference on the
    dequantized weights."""
    from mxc.kernels.fp8_ref import dequantize_experts
    from mxc.loaders.quantize import quantize_fp8

    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator().manual_seed(t)
    stacks = []
    for shape in ((e, 2 * i, h), (e, h, i)):
        w = torch.randn(shape, generator=g).cuda() * 0.02
        w *= torch.rand(e, shape[1] // 128, shape[2] // 128, generator=g).cuda().mul(4).exp2().repeat_interleave(
            128, 1).repeat_interleave(128, 2)
        stacks.append(quantize_fp8(w, "block128"))
    (q1, s1), (q2, s2) = stacks
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_ref.route(torch.randn(t, e, device="cuda", dtype=torch.bfloat16), k, renormalize=True)
    ref = moe_ref.fused_moe(x, w, ids, dequantize_experts(q1, s1, x.dtype), dequantize_experts(q2, s2, x.dtype))
    kw = dict(s_gate_up=s1, s_down=s2)
    if t <= 4:
        up, _ = triton_moe_decode.config_for(h, i, x.dtype)
        ys = [triton_moe_decode.fused_moe(x, w, ids, q1, q2, **kw, configs=(up, triton_moe_decode.PairConfig(
            BLOCK_N=bn, BLOCK_K=256, TILE=tile))) for bn, tile in ((16, False), (8, True))]
        ys.append(triton_moe_decode.fused_moe(x, w, ids, q1, q2, **kw))
    else:
        ys = [triton_moe.fused_moe(x, w, ids, q1, q2, **kw)]
    for y in ys:
        assert _rel(y, ref) < 2e-2
