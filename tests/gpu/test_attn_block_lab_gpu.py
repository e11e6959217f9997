"""The persistent attention block lab kernel (bench/csrc/attn_block_fp8.cu, bench/attn_block_lab.py) on an
sm_90 GPU with at least 128 SMs: one layer against the Triton kernel chain it would replace, and three launches in
a row (the counters, tags and fp32 sums each launch leaves behind must not leak into the next).

The block quantizes the o projection's input per token (the cluster build: one scale a kv group's 512 inputs),
where the chain's one-token o GEMV is weight-only, so the two agree to that rounding, not bit for bit. Compiles the
lab variants here, or takes them from build/attn_block (``bench/attn_block_lab.py --compile-variants``) on a
machine without nvcc.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import attn_block_lab as lab  # noqa: E402

from mxc.kernels import launch, nvcc  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 GPU")


@pytest.fixture(scope="module", params=["attn_block_fp8", "cluster"])
def block(request, tmp_path_factory):
    if torch.cuda.get_device_properties(0).multi_processor_count < 128:
        pytest.skip("the lab kernel runs 128 CTAs, one an SM")
    built = Path(__file__).resolve().parents[2] / "build" / "attn_block" / f"{request.param}.so"
    if nvcc.find() is not None:
        so = lab.compile_library(str(tmp_path_factory.mktemp("attn_block") / f"{request.param}.so"),
                                 lab.LAB_VARIANTS[request.param])
    elif built.is_file():
        so = built
    else:
        pytest.skip(f"no nvcc and no {built}")
    return lab.Block(str(so))


@pytest.mark.parametrize("context", [1, 150])
def test_block_matches_the_chain_and_replays(block, context):
    L = 300
    gen = torch.Generator(device="cuda").manual_seed(context)
    layer = lab.make_layer(gen, L, context, mlp=False)
    step = lab.make_step(context, L)
    x0 = torch.randn(1, lab.H, device="cuda", generator=gen).to(torch.bfloat16)
    k0, v0 = layer["k_cache"].clone(), layer["v_cache"].clone()
    with launch.using(launch.jit_launch_pdl):
        xc = lab.chain_attn(x0.clone(), layer, step)
        kc, vc = layer["k_cache"].clone(), layer["v_cache"].clone()
        layer["k_cache"].copy_(k0)
        layer["v_cache"].copy_(v0)
        outs = [block(x0.clone(), layer, step, pdl=True) for _ in range(3)]
    torch.cuda.synchronize()
    dc = xc.float() - x0.float()
    pos = context - 1
    for xb in outs:
        db = xb.float() - x0.float()
        assert float((db - dc).abs().max() / dc.abs().max()) < 0.06
    # the new k row is rotated in fp32 by both, from qkv values that differ by the GEMVs' summation order
    for name, want, got in (("k", kc, layer["k_cache"]), ("v", vc, layer["v_cache"])):
        row = float((want[0, pos].float() - got[0, pos].float()).abs().max() / want[0, pos].float().abs().max())
        assert row < 0.03, f"new {name} row"
        assert torch.equal(want[0, :pos], got[0, :pos]) and torch.equal(want[0, pos + 1:], got[0, pos + 1:])
    if not block.cluster:  # fixed summation orders: the same bits every launch (the cluster build sums by atomics)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    else:
        assert float((outs[0].float() - outs[2].float()).abs().max() / dc.abs().max()) < 0.01
    assert int(block.ws["sync"][0]) == 0  # the exit count reset by the last CTA
    assert float(block.ws["acc"].abs().max()) == 0.0  # the cluster build's sums zeroed for the next launch
