"""The fp8 gate/up GEMM with SiLU-and-mul in its epilogue and the quantize from its row maxima
(``triton_fp8_silu_gemm``) against the unfused nodes' reference: the merged gate/up linear rounded to the dtype,
``torch_ref.silu_mul``, ``fp8_ref.quantize_rows``.

Under TRITON_INTERPRET=1 on the CPU (tests/kernels/conftest.py makes its conversions round as the GPU's), with
small tiles on ragged shapes: M = 37 (the last row tile partial), I = 150 (the last column tile partial), K = 200
(the last K step partial). The GEMM's fp32 sums run in another order than the reference's, so h is compared
relative to its scale; the quantize is checked bit for bit on the kernel's own h, and the partial maxima exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxc.kernels import fp8_ref, torch_ref
from mxc.kernels import launch as launch_mod
from mxc.kernels import triton_fp8_silu_gemm as sg
from mxc.loaders.quantize import quantize_fp8

_BF16_OK = torch.cuda.is_available() or Path(__file__).with_name("conftest.py").exists()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, I, K = 37, 150, 200
CFG = sg.SiluGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2,
                        QUANT_BLOCK_K=64, QUANT_WARPS=2)


def _operands(dtype, granularity="channel", seed=0):
    """x [M, K] of ``dtype`` and its per-token e4m3 (xq, xs); the merged gate/up weight [2I, K] as e4m3 with row
    scales; gates spread over the SiLU's curved range."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype)
    x[5] = 0  # a zero row: h = 0, xs = 1e-12
    w = torch.randn(2 * I, K, generator=g) / K ** 0.5
    w[:I] *= 3
    wq, ws = quantize_fp8(w, granularity)
    xq, xs = fp8_ref.quantize_rows(x)
    return x, xq, xs, wq, ws.float().contiguous()


def _reference_h(xq, xs, wq, ws, dtype):
    gate_up = ((xq.float() * xs[:, None]) @ fp8_ref.dequantize_weight(wq, ws, "channel").t()).to(dtype)
    return torch_ref.silu_mul(gate_up)


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_gemm_matches_the_unfused_nodes(dtype):
    """h within the GEMM's summation order of the merged linear, then silu_mul; pmax is each tile's row maxima of
    the kernel's own |h|, exactly."""
    x, xq, xs, wq, ws = _operands(dtype)
    h, pmax = sg.silu_gemm(*_dev(xq, xs, wq, ws), dtype=dtype, config=CFG)
    h = h.cpu().float()
    ref = _reference_h(xq, xs, wq, ws, dtype).float()
    assert h.shape == (M, I) and pmax.shape == (M, -(-I // CFG.BLOCK_N))
    err = (h - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], f"{dtype}: {err:.2e}"
    assert torch.all(h[5] == 0)
    tiles = torch.nn.functional.pad(h.abs(), (0, pmax.shape[1] * CFG.BLOCK_N - I)).view(M, -1, CFG.BLOCK_N)
    assert torch.equal(pmax.cpu(), tiles.amax(dim=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_k", [64, 256], ids=["blocks", "one-block"])
def test_quantize_max_is_the_quantize_kernels_result(dtype, block_k):
    """xq and xs from the partial maxima equal ``fp8_ref.quantize_rows`` of h bit for bit (zero row, tiny row,
    ragged K), whichever column block size."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(M, K, generator=g) * 4
    h[:, :5] *= 30
    h[2] = 0
    h[3] *= 1e-30 if dtype == torch.float32 else 1e-3
    h = h.to(dtype)
    width = 48  # partial maxima of 48-column tiles, the last partial
    tiles = torch.nn.functional.pad(h.float().abs(), (0, 5 * width - K)).view(M, 5, width)
    pmax = tiles.amax(dim=2).contiguous()
    xq, xs = sg.quantize_max(*_dev(h, pmax), block_k=block_k, num_warps=2)
    ref_q, ref_s = fp8_ref.quantize_rows(h)
    assert torch.equal(xs.cpu(), ref_s)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_chain_gives_the_down_projections_input(dtype, granularity):
    """``silu_mul_quantized``: the down linear on its (hq, hs) is the reference MLP's within the fp8 error."""
    x, xq, xs, wq, ws = _operands(dtype, granularity, seed=1)
    hq, hs = sg.silu_mul_quantized(*_dev(xq, xs, wq, ws), dtype=dtype, config=CFG)
    h_ref = _reference_h(xq, xs, wq, ws, dtype)
    ref_q, ref_s = fp8_ref.quantize_rows(h_ref)
    got = hq.cpu().float() * hs.cpu()[:, None]
    want = ref_q.float() * ref_s[:, None]
    assert (got - want).abs().max() / want.abs().max() < 0.07  # one e4m3 step (2^-3) at most, where h moved
    codes = hq.cpu().view(torch.uint8) != ref_q.view(torch.uint8)
    assert codes.float().mean() < (0.002 if dtype == torch.float32 else 0.05)
    torch.testing.assert_close(hs.cpu(), ref_s, rtol=TOL[dtype], atol=0)


def test_default_config_and_meta_recording():
    """The default tiles record the two launches on ``meta`` tensors (grids from the shapes only)."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid, constexprs))

    xq = torch.empty(2048, 4096, dtype=torch.float8_e4m3fn, device="meta")
    xs = torch.empty(2048, dtype=torch.float32, device="meta")
    w = torch.empty(2 * 14336, 4096, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(2 * 14336, dtype=torch.float32, device="meta")
    with launch_mod.using(record):
        hq, hs = sg.silu_mul_quantized(xq, xs, w, s)
    cfg = sg.config_for(14336, 4096)
    assert hq.shape == (2048, 14336) and hq.dtype == torch.float8_e4m3fn and hs.shape == (2048,)
    (gemm, grid_g, cg), (quant, grid_q, cq) = launches
    assert gemm == "_silu_gemm_kernel" and grid_g == ((2048 // cfg.BLOCK_M) * (14336 // cfg.BLOCK_N),)
    assert cg["I"] == 14336 and cg["K"] == 4096
    assert quant == "_quant_max_kernel" and grid_q == (2048, 7) and cq["P"] == 14336 // cfg.BLOCK_N


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, w=a["w"][:-1]), "merged gate/up weight"),
    (lambda a: dict(a, xs=a["xs"].double()), "xs must be float32"),
    (lambda a: dict(a, scale=a["scale"][:10]), "scale must be float32"),
    (lambda a: dict(a, xq=a["xq"].float()), "must be torch.float8_e4m3fn"),
])
def test_bad_operands_are_refused(change, message):
    _, xq, xs, wq, ws = _operands(torch.float32)
    args = change(dict(xq=xq, xs=xs, w=wq, scale=ws))
    with pytest.raises(ValueError, match=message):
        sg.silu_gemm(args["xq"], args["xs"], args["w"], args["scale"], config=CFG)
