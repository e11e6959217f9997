"""The register-fed mma.sync fp8 GEMV (mxc.kernels.cuda_fp8_gemv) on an sm_90 GPU: against its torch reference
and the Triton fp8 GEMV over token counts, ragged row counts and each epilogue, K split over 1-8 warps, in a CUDA
graph after a kernel launched for programmatic dependent launch, and in place on the residual.

Uses the library $MXC_GEMV_MMA_LIBRARY names, else compiles it here (needs nvcc).
"""

from __future__ import annotations

import os

import pytest
import torch

from mxc.kernels import cuda_fp8_gemv, fp8_ref, launch, nvcc, triton_fp8
from mxc.loaders.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 GPU")


@pytest.fixture(scope="module")
def gemv():
    if not os.environ.get(cuda_fp8_gemv.PREBUILT_ENV) and nvcc.find() is None:
        pytest.skip(f"no ${cuda_fp8_gemv.PREBUILT_ENV} and no nvcc")
    return cuda_fp8_gemv.load()


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _operands(M, N, K, seed, residual=False):
    gen = torch.Generator().manual_seed(seed)
    w, s = quantize_fp8(torch.randn(N, K, generator=gen) * 0.02, "channel")
    x = (torch.randn(M, K, generator=gen) * (1 + torch.rand(M, 1, generator=gen))).to(torch.bfloat16)
    xq, xs = fp8_ref.quantize_rows(x)
    r = (torch.randn(M, N, generator=gen) * 0.1).to(torch.bfloat16).cuda() if residual else None
    return x.cuda(), xq.contiguous().cuda(), xs.contiguous().cuda(), w.cuda(), s.cuda(), r


@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("N, K", [(6144, 4096), (1000, 640), (24, 64), (4096, 14336)])
@pytest.mark.parametrize("epilogue", [None, "residual", "silu_mul"])
def test_matches_reference_and_triton(gemv, M, N, K, epilogue):
    x, xq, xs, w, s, r = _operands(M, N, K, seed=M * 7 + N + K, residual=epilogue == "residual")
    epi = None if epilogue == "residual" else epilogue
    got = gemv(xq, xs, w, s, r, epilogue=epi)
    ref = cuda_fp8_gemv.reference(xq, xs, w, s, r, epi)
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-2  # fp32 summation order and the bf16 rounding of the product
    triton = triton_fp8.qlinear_small_m(x, w, s, residual=r, epilogue=epi)
    # the Triton GEMV sums in another order, and at one token multiplies some shapes' x unquantized (weight-only)
    assert _rel(got, triton) < 5e-2


@pytest.mark.parametrize("ks, u", [(1, 2), (2, 8), (4, 4), (8, 2)])
def test_k_splits_and_depths_agree(gemv, ks, u):
    """K = 14336 over 1-8 warps, 2-8 chunks in flight: the same values within fp32 summation order."""
    _, xq, xs, w, s, _ = _operands(3, 512, 14336, seed=ks * 10 + u)
    ref = cuda_fp8_gemv.reference(xq, xs, w, s)
    assert _rel(gemv(xq, xs, w, s, ks=ks, u=u), ref) < 1e-2


def test_deterministic_in_a_pdl_graph_in_place(gemv):
    """Launched for PDL right after a Triton kernel launched likewise, in a CUDA graph, writing into its residual:
    the eager result, bit for bit, replay after replay."""
    x, xq, xs, w, s, r = _operands(1, 4096, 4096, seed=3, residual=True)
    x2 = x.clone()
    eager = gemv(xq, xs, w, s, r.clone(), out=None)
    out = r.clone()

    def step():
        with launch.using(launch.jit_launch_pdl):
            triton_fp8.qlinear_small_m(x2, w, s)  # a PDL kernel ahead
        out.copy_(r)
        gemv(xq, xs, w, s, out, out=out, pdl=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_refuses_what_it_cannot_run(gemv):
    _, xq, xs, w, s, _ = _operands(9, 64, 128, seed=1)
    with pytest.raises(ValueError, match="1 to 8"):
        gemv(xq, xs, w, s)
    _, xq, xs, w, s, _ = _operands(1, 64, 96, seed=1)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemv(xq, xs, w, s)
