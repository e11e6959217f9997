"""The fp8 activation-quantize kernels (``triton_fp8_quant._prequantize``) against ``fp8_ref.quantize_rows``.

Under TRITON_INTERPRET=1 on the CPU (tests/triton_interpreter.py makes the interpreter's fp8/bf16 conversions
round and saturate as the GPU does): the one-program-a-row and tiled kernels bit for bit against the
reference and each other (ragged K, zero, tiny, signed-zero, inf and NaN rows), the RMSNorm and
SiLU-and-mul prologues (gate and up in halves, or interleaved in blocks), the rule choosing the kernel, and
``quantize_max`` (rows whose maxima a GEMM epilogue found). The GEMVs and GEMMs that read their output:
test_fp8_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxc.kernels import fp8_ref, torch_ref
from mxc.kernels import launch as launch_mod
from mxc.kernels import triton_fp8_quant as tfq
from tests.triton_interpreter import bf16_ok

_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _activations(M, k, dtype, silu, seed):
    """x [M, k] (silu: [M, 2k], gate half then up half, gates spread over silu's curved range), a few
    outliers a row, as activations have."""
    g = torch.Generator().manual_seed(seed)
    if silu:
        x = torch.cat([torch.randn(M, k, generator=g) * 3, torch.randn(M, k, generator=g)], dim=1)
    else:
        x = torch.randn(M, k, generator=g)
    x[:, :7] *= 8
    return x.to(dtype)


def _dev(t):
    return None if t is None else t.to(DEVICE)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", [False, True], ids=["plain", "silu_mul"])
def test_quantize_rows_exact(dtype, prologue):
    """The quantize kernels' xq and xs equal ``fp8_ref.quantize_rows`` bit for bit (IEEE divisions,
    round-to-nearest-even saturating e4m3), including a zero row, a tiny row and ragged K: by the default
    rule (at 6 rows: the SiLU-and-mul kernel first, then the tiled kernel), one program a row, tiled."""
    M, k = 6, 200
    x = _activations(M, k, dtype, prologue, seed=9)
    x[1] = 0
    x[2] *= 1e-30 if dtype == torch.float32 else 1e-3
    x = x.to(dtype)
    a = F.silu(x[:, :k]) * x[:, k:] if prologue else x
    ref_q, ref_s = fp8_ref.quantize_rows(a)
    for block, tiled in ((64, None), (256, None), (64, False), (256, False), (256, True)):
        xq, xs = tfq._prequantize(_dev(x), M, k, prologue, block, tiled=tiled)
        assert torch.equal(xs.cpu(), ref_s)
        assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [256, 64], ids=["one-pass", "two-pass"])
def test_quantize_rows_rms_norm(dtype, block):
    """With the rms_norm prologue the quantize kernel quantizes ``torch_ref.rms_norm(x, g, eps)``: in the
    kernel when the row fits one pass, after the RMSNorm kernel otherwise. The sum of squares may round
    differently from torch's, so a few codes may differ by one e4m3 step; scales agree to fp32 rounding."""
    M, k, eps = 6, 200, 1e-5
    x = _activations(M, k, dtype, False, seed=11)
    g = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(12))).to(dtype)
    ref_q, ref_s = fp8_ref.quantize_rows(torch_ref.rms_norm(x, g, eps))
    xq, xs = tfq._prequantize(_dev(x), M, k, False, block, _dev(g), eps)
    torch.testing.assert_close(xs.cpu(), ref_s, rtol=1e-5, atol=0)
    codes = xq.cpu().view(torch.uint8) != ref_q.view(torch.uint8)
    assert codes.float().mean() < 0.02
    torch.testing.assert_close(xq.cpu().float(), ref_q.float(), rtol=0.13, atol=0.0)


@pytest.mark.parametrize("tiled", [False, True], ids=["rows-kernel", "tile-kernel"])
def test_quantize_rms_norm_uses_the_models_eps(tiled):
    """Both kernels' RMSNorm prologue adds the eps they are given (rms_norm_eps differs between models): at 1e-2,
    against rows whose mean square is 1e-4 to 1, a kernel adding any other eps gets other scales."""
    M, k, eps = 6, 200, 1e-2
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(11)) * torch.logspace(-2, 0, M)[:, None]
    g = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(12))
    ref_q, ref_s = fp8_ref.quantize_rows(torch_ref.rms_norm(x, g, eps))
    xq, xs = tfq._prequantize(_dev(x), M, k, False, 256, _dev(g), eps, tiled=tiled)
    torch.testing.assert_close(xs.cpu(), ref_s, rtol=1e-5, atol=0)
    assert (xq.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).float().mean() < 0.02


def _bits(xq, xs):
    return xq.cpu().view(torch.uint8), xs.cpu().view(torch.int32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the inf and NaN rows
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", [None, "silu_mul", "rms_norm"], ids=["plain", "silu_mul", "rms_norm"])
def test_quantize_tiled_bit_identical(dtype, prologue):
    """The large-M kernel (``_quant_tile_kernel``: BLOCK_M rows a program, K in power-of-two pieces, rows
    held in x's dtype, a reciprocal and two fma corrections instead of a division per element) writes
    the one-program-a-row kernel's xq and xs bit for bit: ragged M (37 rows; BLOCK_M 32, 8, 4 at
    K = 96, 320, 1000: two pieces, two, three with the last one padded), a zero row, a tiny row,
    signed zeros, rows with inf and NaN (inf scale; NaN ignored by the amax, quantized to -448);
    where defined (finite rows, no norm) both equal ``fp8_ref.quantize_rows``."""
    silu, rms = prologue == "silu_mul", prologue == "rms_norm"
    for k in (96, 320, 1000):
        M = 5 if rms else 37  # RMSNorm: one row a program (the rows kernel's layout)
        x = _activations(M, k, dtype, silu, seed=k)
        x = x.float()
        x[1] = 0
        x[2] *= 1e-30 if dtype == torch.float32 else 1e-3
        x[0, 3:5] = -0.0
        x[3, 5], x[4, 6], x[4, 9] = float("inf"), float("nan"), -float("inf")
        x = x.to(dtype)
        g = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(k))).to(dtype) if rms else None
        block = tfq._quant_block(k)
        rows = tfq._prequantize(_dev(x), M, k, silu, block, _dev(g), 1e-5, tiled=False)
        tiled = tfq._prequantize(_dev(x), M, k, silu, block, _dev(g), 1e-5, tiled=True)
        (rq, rs), (tq, ts) = _bits(*rows), _bits(*tiled)
        assert torch.equal(ts, rs) and torch.equal(tq, rq), (k, (tq != rq).nonzero()[:5].tolist())
        if not rms:
            a = (F.silu(x[:3, :k]) * x[:3, k:] if silu else x[:3]).to(dtype)
            ref_q, ref_s = _bits(*fp8_ref.quantize_rows(a))
            assert torch.equal(ts[:3], ref_s) and torch.equal(tq[:3], ref_q)


def test_prequantize_kernel_choice():
    """``_prequantize``'s rule: the tiled kernel from one row, one binary for every M (grid cdiv(M, BLOCK_M));
    up to 32 rows SiLU-and-mul runs first as its own kernel, then the plain quantize; one program a row
    for K > 16K and for an RMSNorm of two passes; the Llama-3-8B prefill shapes' configs."""
    launches = []
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: launches.append((kernel, grid, consts, nw))):
        for M in (1, 32, 33, 64, 65, 2048):
            tfq._prequantize(meta(M, 2 * 14336), M, 14336, True, tfq._quant_block(14336))
        tfq._prequantize(meta(2048, 20000), 2048, 20000, False, tfq._quant_block(20000))  # K > 16K
        tfq._prequantize(meta(2048, 200), 2048, 200, False, 64, meta(200), 1e-5)  # RMSNorm in two passes
        with pytest.raises(ValueError, match="K <= 16384"):
            tfq._prequantize(meta(64, 20000), 64, 20000, False, 16384, tiled=True)
        tfq._prequantize(meta(4, 2 * 14336), 4, 14336, True, tfq._quant_block(14336), tiled=False)  # as asked
    decode, tiled = launches[:4], launches[4:8]
    for ((silu, sg, _, _), (kn, grid, c, nw)), M in zip((decode[:2], decode[2:]), (1, 32)):
        assert silu.__name__ == "silu_mul_kernel" and sg == (M, 14)  # 1024 columns a program
        assert kn is tfq._quant_tile_kernel and grid == (M,) and nw == 16 and c["PROLOGUE_SILU_MUL"] is False
    assert all(kn is tfq._quant_tile_kernel and grid == (M,) and nw == 16 for (kn, grid, _, nw), M in
               zip(tiled, (33, 64, 65, 2048)))
    assert all(c == tiled[0][2] and c["PROLOGUE_SILU_MUL"] for _, _, c, _ in tiled)
    assert (tiled[0][2]["BLOCK_M"], tiled[0][2]["P0"], tiled[0][2]["P1"], tiled[0][2]["P2"]) == (1, 8192, 4096, 2048)
    assert {k: v for k, v in decode[1][2].items() if k != "PROLOGUE_SILU_MUL"} == \
        {k: v for k, v in tiled[0][2].items() if k != "PROLOGUE_SILU_MUL"}
    assert launches[8][0] is tfq._quant_rows_kernel and launches[8][2]["BLOCK_K"] == 16384
    assert launches[-2][0] is tfq._quant_rows_kernel and launches[-2][2]["PROLOGUE_RMS_NORM"] is False
    assert launches[-3][0] is not tfq._quant_rows_kernel  # the RMSNorm kernel first
    last = launches[-1]
    assert last[0] is tfq._quant_rows_kernel and last[1] == (4,) and last[2]["PROLOGUE_SILU_MUL"]
    # the other prefill shapes: RMSNorm as the rows kernel lays a row out (4 warps at 4096); 96 -> 32 rows
    assert tfq._tile_config(4096, False, True) == (1, (4096, 0, 0), 4) == tfq._tile_config(4096, False, False)
    assert tfq._tile_config(96, True, False) == (32, (64, 32, 0), 8)



def _interleaved(x, b):
    """x [M, 2K] = [gate | up] with its columns in blocks of b gate then b up columns (a contiguous copy)."""
    m, n = x.shape
    return x.reshape(m, 2, n // (2 * b), b).transpose(1, 2).reshape(m, n)


def test_interleaved_layout():
    """The tests' layout: gate column j at (j // B) * 2B + j % B, its up column B further (I = 6, B = 2)."""
    assert _interleaved(torch.arange(12).view(1, 12), 2).tolist() == [[0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, b", [(192, 64), (208, 16)])
def test_quantize_silu_mul_interleaved(dtype, k, b):
    """The SiLU-and-mul prologue with ``interleave`` B (x's columns in blocks of B gate then B up) gives, bit for
    bit, the halves layout's xq and xs on the same rows de-interleaved: the tiled kernel (37 rows; K in pieces,
    the last one padded), one program a row in one pass and in chunks of B columns, and the default route (at 5
    rows the SiLU kernel first, then the plain quantize)."""
    for M, block, tiled in ((37, 256, True), (6, 256, False), (3, b, False), (5, 256, None)):
        x = _activations(M, k, dtype, True, seed=k + M)
        xi = _interleaved(x, b)
        assert not torch.equal(xi, x)  # K > B: the layouts differ
        want = _bits(*tfq._prequantize(_dev(x), M, k, True, block, tiled=tiled))
        got = _bits(*tfq._prequantize(_dev(xi), M, k, True, block, tiled=tiled, interleave=b))
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (M, block, tiled)


def test_quantize_interleave_launches():
    """PAIR_BLOCK reaches the kernels (the SiLU kernel's rendering at M <= 32) only with an interleave: the halves
    layout's launches carry no new constexpr."""
    launches = []
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: launches.append((kernel, consts))):
        for interleave in (0, 64):
            for M, tiled in ((64, None), (64, False), (4, None)):
                tfq._prequantize(_meta(M, 2 * 14336), M, 14336, True, 16384, tiled=tiled, interleave=interleave)
    halves, pairs = launches[:4], launches[4:]
    assert all("PAIR_BLOCK" not in c for _, c in halves)
    assert [k for k, _ in pairs[:2]] == [tfq._quant_tile_kernel, tfq._quant_rows_kernel]
    assert all(c["PAIR_BLOCK"] == 64 and c["PROLOGUE_SILU_MUL"] for _, c in pairs[:2])
    (silu, c_silu), (quant, c_quant) = pairs[2:]
    assert silu.fn.__name__ == "silu_mul_kernel" and silu is not halves[2][0] and c_silu == {}
    assert quant is tfq._quant_tile_kernel and c_quant == halves[3][1]  # the plain quantize after it, as before


@pytest.mark.parametrize("kwargs, message", [
    (dict(silu_mul=False, interleave=64), "no prologue"),
    (dict(interleave=48), "power of two"),
    (dict(interleave=128), "power of two dividing"),
    (dict(interleave=-64), "interleave must be 0"),
    (dict(interleave=64, block_k=32, tiled=False), "multiple of interleave"),
])
def test_quantize_rejects_bad_interleave(kwargs, message):
    kw = {"silu_mul": True, "block_k": 256, "tiled": None, **kwargs}
    x = _meta(4, 2 * 192)
    with launch_mod.using(lambda *a: None), pytest.raises(ValueError, match=message):
        tfq._prequantize(x, 4, 192, kw.pop("silu_mul"), kw.pop("block_k"), **kw)


def _partial_maxima(h, p):
    """Per-row maxima of |h| over p column tiles of unequal widths, [M, p] fp32 (a GEMM epilogue's)."""
    return torch.stack([t.float().abs().amax(dim=1) for t in h.tensor_split(p, dim=1)], dim=1).contiguous()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the inf row
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1000, 3000])
def test_quantize_max_bit_identical(dtype, k):
    """``quantize_max`` from partial row maxima writes ``_prequantize``'s xq and xs bit for bit: ragged K (one
    column block of 2048, or two, the last masked; or 256-column blocks), P = 1 to 7 maxima a row, a zero row,
    a tiny row, an inf row (inf scale)."""
    M = 5
    h = _activations(M, k, dtype, False, seed=k).float()
    h[1] = 0
    h[2] *= 1e-30 if dtype == torch.float32 else 1e-3
    h[3, 11] = float("inf")
    h = h.to(dtype)
    want = _bits(*tfq._prequantize(_dev(h), M, k, False, tfq._quant_block(k)))
    for p, block_k in ((1, 2048), (3, 2048), (7, 256)):
        got = _bits(*tfq.quantize_max(_dev(h), _dev(_partial_maxima(h, p)), block_k=block_k))
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (p, block_k)


def test_quantize_max_records_one_launch():
    """One launch through ``launch`` (a build's recorder sees it): grid (M, column blocks), K and P constexprs."""
    launches = []
    h, pmax = _meta(2048, 14336), _meta(2048, 224, dtype=torch.float32)
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: launches.append((kernel, grid, consts, nw))):
        xq, xs = tfq.quantize_max(h, pmax)
    assert launches == [(tfq._quant_max_kernel, (2048, 7), dict(K=14336, P=224, BLOCK_P=256, BLOCK_K=2048), 4)]
    assert xq.shape == (2048, 14336) and xq.dtype == tfq.FP8 and xs.shape == (2048,) and xs.dtype == torch.float32


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("call, message", [
    (lambda: tfq.quantize_max(_meta(4, 100), _meta(5, 2, dtype=torch.float32)), "expected h"),
    (lambda: tfq.quantize_max(_meta(4, 100), _meta(4, dtype=torch.float32)), "expected h"),
    (lambda: tfq.quantize_max(_meta(4, 0), _meta(4, 2, dtype=torch.float32)), "empty"),
    (lambda: tfq.quantize_max(_meta(4, 100, dtype=torch.int32), _meta(4, 2, dtype=torch.float32)), "one of"),
    (lambda: tfq.quantize_max(_meta(4, 100), _meta(4, 2)), "pmax float32"),
    (lambda: tfq.quantize_max(_meta(100, 4).t(), _meta(4, 2, dtype=torch.float32)), "contiguous"),
    (lambda: tfq.quantize_max(_meta(4, 100), torch.zeros(4, 2)), "pmax on cpu"),
    (lambda: tfq.quantize_max(_meta(4, 100), _meta(4, 2, dtype=torch.float32), block_k=1000), "power of two"),
])
def test_quantize_max_rejects_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()
