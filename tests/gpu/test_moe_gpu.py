"""Mixture of experts on the GPU: the fused MoE kernel at real shapes and a tiny Qwen3-MoE end to end vs HF."""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.kernels import moe_ref, triton_moe


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


@pytest.mark.parametrize("arch,overrides", [
    ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=64, norm_topk_prob=True)),
    ("OlmoeForCausalLM", dict(intermediate_size=64)),  # q/k norm over the whole projections
])
def test_moe_cuda_matches_hf(arch, overrides, hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint(arch, hidden_size=128, num_experts=8, num_experts_per_tok=2, **overrides)
    art = mxc.build(str(ckpt), out=tmp_path / "a", target="cuda", dtype="bfloat16", max_batch=4, max_seq_len=64,
                    progress=False, log=lambda m: None)
    model = mxc.load(art, device="cuda")
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits.float().cpu()
    assert _rel(model.logits(ids).cpu(), ref) < 3e-2
