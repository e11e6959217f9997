"""Routing weights in float32 where transformers keeps them so: Mixtral.

transformers' ``MixtralTopKRouter`` takes the softmax in float32 and does not cast the top-k weights back to the
logits' dtype (Qwen2-MoE's, Qwen3-MoE's and OLMoE's routers do); each expert's 16-bit output times its float32
weight is then a float32 product, and transformers' default experts path (``grouped_mm``; ``batched_mm`` alike)
sums a token's products in float32 and rounds once. mxc rounded the weights to the model dtype for every family:
a bf16 Mixtral's MoE block came out one ulp apart from transformers' on about half of its elements. Its ``route``
now carries ``fp32_weights`` (registry.yaml sets ``moe_fp32_weights`` for Mixtral), and the experts take float32
weights. (transformers' eager experts loop instead rounds each product to the model dtype before its
``index_add_``: that path and its default ones disagree with each other on about a third of the elements.)
"""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.ir import Repeat, verify
from mxc.ir.serialize import load_graph
from mxc.kernels import moe_ref, torch_ref

T = 48  # tokens into the block


def _block_and_input(hf):
    """The first layer's sparse MoE block and a random input in the model's dtype."""
    x = torch.randn(T, hf.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(hf.dtype)
    return hf.model.layers[0].mlp, x


def _mxc_block(block, x, k, fp32_weights):
    """The block as mxc's graph computes it: route(linear(h, w_router), fp32_weights=...), then the experts over
    the stacks (the fused op's merged gate/up stack and the unfused op's gate and up stacks)."""
    w, ids = torch_ref.route(torch_ref.linear(x, block.gate.weight), k, "softmax", True, fp32_weights=fp32_weights)
    w_gate_up, w_down = block.experts.gate_up_proj, block.experts.down_proj  # [E, 2I, H] (gate rows, up), [E, H, I]
    w_gate, w_up = w_gate_up.chunk(2, dim=1)
    fused = torch_ref.fused_moe(x, w, ids, w_gate_up, w_down)
    assert torch.equal(fused, moe_ref.experts(x, w, ids, w_gate.contiguous(), w_up.contiguous(), w_down))
    return w, fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("experts,k", [(4, 2), (8, 3)])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_mixtral_moe_block_bit_for_bit(dtype, experts, k, impl, hf_checkpoint):
    """A 16-bit Mixtral's sparse MoE block (transformers, its default experts path and the batched one) equals
    mxc's reference route + experts with float32 routing weights bit for bit; with the weights rounded to the
    model dtype (as before, and as the other families do) it does not.

    The batched path's float16 products are torch's float16 ``bmm``, whose sums on a CPU without AVX-512 (an
    AVX2 EPYC, 2026-12-06) are not float32 sums rounded once: there transformers' two paths themselves differ on
    0.3% of these elements, and mxc is held to the batched path where they agree."""
    _, hf = hf_checkpoint("MixtralForCausalLM", dtype=dtype, num_local_experts=experts, num_experts_per_tok=k)
    block, x = _block_and_input(hf)
    assert hf.config._experts_implementation == "grouped_mm"  # transformers' default: what a user's model runs
    with torch.no_grad():
        default = block(x[None])[0]
        hf.set_experts_implementation(impl)
        want = block(x[None])[0]
        w, got = _mxc_block(block, x, k, fp32_weights=True)
        _, rounded = _mxc_block(block, x, k, fp32_weights=False)
    assert w.dtype == torch.float32 and got.dtype == want.dtype == dtype
    assert torch.equal(got, default), float((got.float() - default.float()).abs().max())
    agree = want == default  # transformers' two paths agree: everywhere where torch's float16 bmm sums in float32
    assert (~agree).float().mean() < 0.02 and torch.equal(got[agree], want[agree])
    assert (rounded != want).float().mean() > 0.1  # the bf16 weights' output: about half the elements an ulp off


def test_other_families_round_their_routing_weights(hf_checkpoint):
    """Qwen3-MoE's router casts the weights back to the logits' dtype: mxc's default route (no fp32_weights)
    reproduces its block bit for bit, and float32 weights would not."""
    _, hf = hf_checkpoint("Qwen3MoeForCausalLM", dtype=torch.bfloat16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=40, norm_topk_prob=True)
    block, x = _block_and_input(hf)
    with torch.no_grad():
        want = block(x[None])[0]
        for fp32, same in ((False, True), (True, False)):
            w, ids = torch_ref.route(torch_ref.linear(x, block.gate.weight), 2, "softmax", True, fp32_weights=fp32)
            got = torch_ref.fused_moe(x, w, ids, block.experts.gate_up_proj, block.experts.down_proj)
            assert torch.equal(got, want) is same


def _route(art):
    """The artifact's first MoE router node (the fused add + RMSNorm + router at tp 1) and its weights' type."""
    graph = load_graph((art / "graph.yaml").read_text())
    types = verify(graph)
    (rep,) = [it for it in graph.body if isinstance(it, Repeat)]
    node = next(n for n in rep.body if n.op in ("route", "add_rms_norm_route"))
    return node, types[node.outs[-2]]


@pytest.mark.parametrize("arch,fields,fp32", [
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), True),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40), False),
], ids=["mixtral", "qwen3-moe"])
def test_built_graph_types_the_routing_weights(arch, fields, fp32, hf_checkpoint, tmp_path):
    """The built bf16 artifact's graph: Mixtral's router carries fp32_weights and its weights are float32, which
    its experts read; Qwen3-MoE's stay bfloat16. The artifact runs (its logits close to transformers')."""
    ckpt, hf = hf_checkpoint(arch, dtype=torch.bfloat16, **fields)
    art = mxc.build(str(ckpt), out=tmp_path / "art", dtype="bfloat16", progress=False, log=lambda m: None)
    node, weights = _route(art)
    assert node.op == "add_rms_norm_route" and node.attrs["fp32_weights"] is fp32
    assert weights.dtype == ("float32" if fp32 else "bfloat16")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    got = mxc.load(art).logits(ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 3e-2
