"""Triton small-M linear (``triton_gemv.linear_small_m``) against ``F.linear`` in fp32, then cast.

Runs under TRITON_INTERPRET=1 on the CPU (the interpreter costs ~0.4 ms per Triton op per
program), so the cases pass small explicit configs: ragged N and K (not block multiples),
every kernel version (v1 M = 1, v2 M = 2..8, v3 tl.dot), SPLIT_K 1 and ragged SPLIT_K > 1,
with and without bias, fp32/fp16/bf16. One case writes into a view of a NaN-filled buffer to
catch stores outside y; a meta-device test checks that grids and constexprs depend only on
the M bucket. The fused prologue (``silu_mul`` of x [M, 2K]) and residual epilogue are checked
against the unfused ``torch_ref`` composition and, to the ulp, against the unfused kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mxc.kernels import launch as launch_mod
from mxc.kernels import torch_ref
from mxc.kernels import triton_gemv as tg
from mxc.kernels.triton_gemv import GemvConfig

# bf16 needs the interpreter's float conversions fixed (tests/kernels/conftest.py) off the GPU
_BF16_OK = torch.cuda.is_available() or Path(__file__).with_name("conftest.py").exists()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(M, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _check(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert not y.isnan().any()
    torch.testing.assert_close(y.cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _run(M, N, K, dtype, bias, cfg, seed=0):
    x, w, b = _inputs(M, N, K, dtype, bias, seed)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y = tg.linear_small_m(dev(x), dev(w), dev(b), config=cfg)
    _check(y, _reference(x, w, b), dtype)


FMA = GemvConfig(BLOCK_N=16, BLOCK_K=32)
DOT = GemvConfig(BLOCK_N=16, BLOCK_K=32, USE_DOT=True)
# (N, K, bias, SPLIT_K): N=40, K=72 -> 3 N tiles (last ragged), 3 K steps (last ragged);
# N=96, K=200, SPLIT_K=3 -> slices of 96: 0-96, 96-192, 192-200 (partial).
SHAPES = [(40, 72, False, 1), (96, 200, True, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K,bias,split", SHAPES, ids=["40x72", "96x200-bias-split3"])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 16, 17])
def test_linear_small_m(M, N, K, bias, split, dtype):
    base = DOT if tg.bucket(M) >= 16 else FMA  # v1 at M=1, v2 at 2..8, v3 at 16, 32
    _run(M, N, K, dtype, bias, replace(base, SPLIT_K=split), seed=M)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,split,bias", [(1, 2, True), (3, 1, True), (5, 2, False)])
def test_dot_on_small_buckets(M, split, bias, dtype):
    """v3 padded to a 16-row tile for buckets below 16 (tune may pick it)."""
    _run(M, 40, 72, dtype, bias, GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, USE_DOT=True), seed=7)


@pytest.mark.parametrize("M", [1, 4, 32])
def test_default_config(M):
    """config_for's choice runs (its large tiles), with the split K it picks for a small N."""
    cfg = tg.config_for(tg.bucket(M), 24, 4200, torch.float16)
    assert cfg == tg.config_for(tg.bucket(M), 24, 4200, torch.float16) and cfg.SPLIT_K > 1
    _run(M, 24, 4200, torch.float16, True, None, seed=3)


def test_writes_only_inside_out():
    """Through ``out=``: a contiguous view inside a NaN buffer; nothing around it is touched."""
    M, N, K, dtype = 3, 40, 72, torch.float16
    x, w, b = _inputs(M, N, K, dtype, bias=True, seed=11)
    for split in (1, 2):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        out = buf[32:32 + M * N].view(M, N)
        y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), out=out,
                              config=GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split))
        assert y.data_ptr() == out.data_ptr()
        _check(y, _reference(x, w, b), dtype)
        assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


def test_config_table():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mb in tg.M_BUCKETS:
            for n, k in tg.LLAMA3_8B_SHAPES.values():
                cfg = tg.config_for(mb, n, k, dtype)
                assert cfg.BLOCK_K * torch.empty((), dtype=dtype).element_size() % 512 == 0  # whole warps of 16 B
                assert cfg.USE_DOT == (mb > 1)  # v1 at M = 1, tensor cores from 2 (measured on H200)
                assert cfg.SPLIT_K == 1  # 4096+ rows fill 132 SMs without splitting K
    small = tg.config_for(1, 512, 4096, torch.bfloat16)  # a TP shard: 32 tiles -> split K
    assert small.BLOCK_N == 8 and small.SPLIT_K > 1
    assert -(-512 // small.BLOCK_N) * small.SPLIT_K >= tg.NUM_SMS // 2
    assert [tg.bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        tg.bucket(33)
    assert all(c.USE_DOT for c in tg.candidates(32, torch.bfloat16))
    assert {c.USE_DOT for c in tg.candidates(4, torch.bfloat16)} == {False, True}


def test_rejects_bad_inputs():
    x, w, b = _inputs(2, 8, 16, torch.float16, bias=True)
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w.float())
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w[:, :8])
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b[:4])
    with pytest.raises(ValueError):
        tg.linear_small_m(torch.randn(40, 16).half(), w)
    with pytest.raises(ValueError):
        tg.linear_small_m(x.t().contiguous().t(), w)


def test_meta_recording():
    """On meta tensors: nothing runs; grids depend on the bucket only; M=3 and M=4 share bucket 4's
    binary (same constexprs, M passed as a dynamic argument)."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    N, K, dtype = 4096, 4096, torch.bfloat16
    w = torch.empty(N, K, dtype=dtype, device="meta")
    b = torch.empty(N, dtype=dtype, device="meta")
    seen = {}
    with launch_mod.using(record):
        for M in (1, 2, 3, 4, 5, 8, 17, 32):
            launches.clear()
            y = tg.linear_small_m(torch.empty(M, K, dtype=dtype, device="meta"), w, b)
            assert y.shape == (M, N) and y.device.type == "meta"
            (kernel, grid, args, consts, nw, ns), = launches
            assert args[-1] == M and consts["BLOCK_M"] >= tg.bucket(M)
            seen[M] = (grid, consts, nw, ns)
        # split K (a small N): two launches, same grids for every M of a bucket
        w_small = torch.empty(256, K, dtype=dtype, device="meta")
        grids = []
        for M in (3, 4):
            launches.clear()
            tg.linear_small_m(torch.empty(M, K, dtype=dtype, device="meta"), w_small)
            assert len(launches) == 2
            grids.append([(grid, consts) for _, grid, _, consts, _, _ in launches])
    assert seen[3] == seen[4] and seen[5] == seen[8] and seen[17] == seen[32]
    assert seen[1] != seen[2]
    assert grids[0] == grids[1]


# ----------------------------------------------------------------------------------------------
# fused prologue (silu_mul) and residual epilogue

_MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def _ulps(a, b, dtype):
    """Largest |a - b| in units in the last place of ``dtype`` (at the larger magnitude)."""
    a, b = a.cpu().float(), b.cpu().float()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(dtype).tiny)
    return ((a - b).abs() / torch.exp2(torch.floor(torch.log2(mag)) - _MANTISSA[dtype])).max().item()


def _fused_inputs(M, N, K, dtype, bias, prologue, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = _inputs(M, N, K, dtype, bias, seed)
    if prologue:  # gate half then up half; gates spread over silu's curved range
        x = torch.cat([torch.randn(M, K, generator=g) * 3, torch.randn(M, K, generator=g)], dim=1).to(dtype)
    r = torch.randn(M, N, generator=g).to(dtype) if residual else None
    return x, w, b, r


def _unfused(linear, x, w, b, r, prologue):
    """The unfused composition the fusion replaces: silu_mul, linear, add (each rounded to the dtype)."""
    y = linear(torch_ref.silu_mul(x) if prologue else x, w, b)
    return y if r is None else torch_ref.add(r, y)


FMA_V2 = GemvConfig(BLOCK_N=16, BLOCK_K=32)  # v2 at buckets 2..8 (v1 at M = 1)
# (M, K, config, split, bias, prologue, residual): N = 40 (3 tiles, last ragged); K = 72 is
# ragged for every split (2: slices 0-64, 64-72; 3: 0-32, 32-64, 64-72), K = 64 is EVEN_K.
FUSED = [
    (1, 72, FMA, 1, True, True, True),
    (1, 64, FMA, 2, False, True, False),
    (1, 72, FMA, 3, False, False, True),
    (1, 72, DOT, 2, True, False, True),
    (3, 64, FMA_V2, 1, True, True, False),
    (3, 72, FMA_V2, 2, True, True, True),
    (3, 72, DOT, 1, False, False, True),
    (3, 72, DOT, 3, True, True, True),
    (17, 64, DOT, 1, True, True, True),
    (17, 72, DOT, 3, False, False, True),
    (17, 72, DOT, 2, True, True, False),
]


def _fused_id(case):
    M, K, cfg, split, bias, prologue, residual = case
    version = "v3" if cfg.USE_DOT else "v1" if M == 1 else "v2"
    return "-".join([f"M{M}", f"K{K}", version, f"split{split}"] + ["bias"] * bias + ["silu_mul"] * prologue
                    + ["residual"] * residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,cfg,split,bias,prologue,residual", FUSED, ids=[_fused_id(c) for c in FUSED])
def test_fused_prologue_residual(M, K, cfg, split, bias, prologue, residual, dtype):
    N = 40
    cfg = replace(cfg, SPLIT_K=split)
    x, w, b, r = _fused_inputs(M, N, K, dtype, bias, prologue, residual, seed=M + K + split)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    kernel = lambda x_, w_, b_: tg.linear_small_m(x_, w_, b_, config=cfg)  # noqa: E731
    y = tg.linear_small_m(dev(x), dev(w), dev(b), dev(r), prologue="silu_mul" if prologue else None, config=cfg)
    # against the torch reference composition (linear in fp32, then cast, as the other tests)
    _check(y, _unfused(_reference, x, w, b, r, prologue), dtype)
    # against the same kernel unfused around torch_ref's silu_mul and add: the residual rounds
    # exactly as torch_ref.add; silu's exp may differ by an fp32 ulp, so <= 1 ulp of the result
    ref = _unfused(kernel, dev(x), dev(w), dev(b), dev(r), prologue).cpu()
    if not prologue:
        assert torch.equal(y.cpu(), ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-5)
    else:
        assert _ulps(y, ref, dtype) <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,cfg", [(1, FMA), (3, FMA_V2), (3, DOT)], ids=["v1", "v2", "v3"])
def test_silu_mul_prologue_rounding(M, cfg, dtype):
    """With w = I the output is the kernel's input row itself: torch_ref.silu_mul's rounding."""
    K = 40
    x, _, _, _ = _fused_inputs(M, K, K, dtype, False, True, False, seed=5)
    w = torch.eye(K, dtype=dtype)
    y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), prologue="silu_mul", config=cfg).cpu()
    ref = torch_ref.silu_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    else:
        assert _ulps(y, ref, dtype) <= 1  # an fp32 exp ulp may flip a rounding (none seen on the CPU)


def test_residual_in_place():
    """``out=residual`` (each element is read, then written, by one program) and nothing is
    written outside it, with and without split K."""
    M, N, K, dtype = 3, 40, 72, torch.float16
    x, w, b, r = _fused_inputs(M, N, K, dtype, True, True, True, seed=13)
    ref = _unfused(_reference, x, w, b, r, True)
    for split in (1, 2):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        res = buf[32:32 + M * N].view(M, N)
        res.copy_(r)
        y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), res, prologue="silu_mul", out=res,
                              config=replace(FMA_V2, SPLIT_K=split))
        assert y.data_ptr() == res.data_ptr()
        _check(y, ref, dtype)
        assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


def test_fused_rejects_bad_inputs():
    x, w, b, r = _fused_inputs(2, 8, 16, torch.float16, True, True, True, seed=1)
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b, r)  # x is [M, 2K] without the prologue
    with pytest.raises(ValueError):
        tg.linear_small_m(x[:, :16].contiguous(), w, b, r, prologue="silu_mul")  # x is [M, K]
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b, r, prologue="gelu_mul")
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b, r[:1], prologue="silu_mul")
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b, r.float(), prologue="silu_mul")
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b, r.t().contiguous().t(), prologue="silu_mul")


# --- RMSNorm prologue (fuse_norm_linear): one row, v1, one K slice ----------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,bias", [(72, True), (64, False), (200, True)], ids=["K72-bias", "K64", "K200-bias"])
def test_rms_norm_prologue(K, bias, dtype):
    """y = rms_norm(x, g) @ w^T (+ b) for one row, N = 40 (ragged tiles), ragged and EVEN K, against
    the reference composition ``torch_ref.rms_norm_linear``: the fused kernel keeps the normed row in
    fp32 where the reference rounds it to the dtype, so the two differ by about one such rounding."""
    N, eps = 40, 1e-5
    x, w, b = _inputs(1, N, K, dtype, bias, seed=K)
    x = x * 3
    g = (1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(K + 1))).to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    for cfg in (replace(FMA, BLOCK_K=256), FMA):  # one K step / several, the last ragged where K is
        y = tg.linear_small_m(dev(x), dev(w), dev(b), prologue="rms_norm", norm_weight=dev(g), eps=eps, config=cfg)
        ref = torch_ref.rms_norm_linear(x.float(), g.float(), w.float(), None if b is None else b.float(), eps)
        _check(y, ref.to(dtype), dtype)
        if dtype != torch.float32:  # and close to the dtype reference, within its own rounding
            torch.testing.assert_close(y.cpu(), torch_ref.rms_norm_linear(x, g, w, b, eps), atol=4 * TOL[dtype],
                                       rtol=4 * TOL[dtype])


def test_rms_norm_prologue_rejects():
    x, w, _ = _inputs(2, 16, 32, torch.float16, False)
    g = torch.ones(32, dtype=torch.float16)
    with pytest.raises(ValueError, match="one row"):
        tg.linear_small_m(x, w, prologue="rms_norm", norm_weight=g)  # two rows
    with pytest.raises(ValueError, match="one row"):
        tg.linear_small_m(x[:1], w, prologue="rms_norm", norm_weight=g, config=replace(FMA, SPLIT_K=2))
    with pytest.raises(ValueError, match="norm_weight"):
        tg.linear_small_m(x[:1], w, prologue="rms_norm", norm_weight=g[:16], config=FMA)
    with pytest.raises(ValueError, match="norm_weight"):
        tg.linear_small_m(x[:1], w, prologue="rms_norm", config=FMA)


@pytest.mark.parametrize("M", [1, 3])
def test_rms_norm_linear_adapter(M):
    """cuda_ops.rms_norm_linear_small_m: the fused GEMV at one row where the default config allows it,
    else the RMSNorm kernel and the GEMV; both against the reference composition."""
    from mxc.kernels import cuda_ops

    N, K, dtype = 24, 64, torch.float16
    x, w, b = _inputs(M, N, K, dtype, True, seed=M)
    g = (1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(3))).to(dtype)
    launches = []
    real = launch_mod._launcher

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append(kernel)
        return real(kernel, grid, args, constexprs, num_warps, num_stages)

    with launch_mod.using(record):
        y = cuda_ops.rms_norm_linear_small_m(x.to(DEVICE), g.to(DEVICE), w.to(DEVICE), b.to(DEVICE), eps=1e-6)
    assert (tg._gemv_kernel in launches) and (len(launches) == 1) == tg.fuses_rms_norm(M, N, K, dtype)
    torch.testing.assert_close(y.cpu(), torch_ref.rms_norm_linear(x, g, w, b, 1e-6), atol=8e-3, rtol=8e-3)


def test_meta_recording_fused():
    """The fusion is in the constexprs (PROLOGUE_SILU_MUL, HAS_RESIDUAL) and the residual pointer;
    grids are those of the unfused linear (x [M, 2K] under the prologue); with split K the
    reduce kernel adds the residual."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    K, dtype = 4096, torch.bfloat16
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(record):
        for M in (1, 3, 17):
            for N in (4096, 256):  # 256 rows: split K
                w, b, r = meta(N, K), meta(N), meta(M, N)
                launches.clear()
                tg.linear_small_m(meta(M, K), w, b)
                plain = list(launches)
                launches.clear()
                y = tg.linear_small_m(meta(M, 2 * K), w, b, r, prologue="silu_mul")
                fused = list(launches)
                assert y.shape == (M, N) and y.device.type == "meta"
                assert [grid for _, grid, *_ in fused] == [grid for _, grid, *_ in plain]
                for (kernel, _, args, consts, nw, ns), (_, _, _, pconsts, _, _) in zip(fused, plain):
                    assert args[-1] == M
                    spec = launch_mod.spec_of(kernel, args, consts, nw, ns)
                    assert spec["signature"]["r_ptr"] in ("*bf16", "constexpr")
                    assert pconsts["HAS_RESIDUAL"] is False
                    assert {k: v for k, v in consts.items() if k not in ("PROLOGUE_SILU_MUL", "HAS_RESIDUAL")} \
                        == {k: v for k, v in pconsts.items() if k not in ("PROLOGUE_SILU_MUL", "HAS_RESIDUAL")}
                gemv = fused[0]
                assert gemv[0] is tg._gemv_kernel and gemv[3]["PROLOGUE_SILU_MUL"] is True
                assert plain[0][3]["PROLOGUE_SILU_MUL"] is False
                if N == 4096:
                    assert len(fused) == 1 and gemv[3]["HAS_RESIDUAL"] is True and gemv[2][3] is r
                else:
                    assert len(fused) == 2 and gemv[3]["SPLIT_K"] > 1
                    assert gemv[3]["HAS_RESIDUAL"] is False and gemv[2][3] is None
                    kernel, _, args, consts, _, _ = fused[1]
                    assert kernel is tg._splitk_reduce_kernel and consts["HAS_RESIDUAL"] is True
                    assert args[2] is r and "PROLOGUE_SILU_MUL" not in consts


_COMPILE_SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mxc.kernels import launch as L, triton_gemv as tg

    specs = []
    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        specs.append((kernel, L.spec_of(kernel, args, constexprs, num_warps, num_stages)))
    with L.using(record):
        for M, dtype in [(1, torch.bfloat16), (2, torch.bfloat16), (8, torch.bfloat16),
                         (32, torch.bfloat16), (32, torch.float32)]:
            x = torch.empty(M, 4096, dtype=dtype, device="meta")
            w = torch.empty(4096, 4096, dtype=dtype, device="meta")
            tg.linear_small_m(x, w, torch.empty(4096, dtype=dtype, device="meta"))
        x = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
        tg.linear_small_m(x, torch.empty(512, 4096, dtype=torch.bfloat16, device="meta"))  # split K
        # fused silu_mul prologue + residual: v1, v3, v2 (a tune config) and split K (+ reduce)
        for M, N, cfg in [(1, 4096, None), (32, 4096, None), (4, 4096, tg.GemvConfig(32, 256)),
                          (1, 512, None)]:
            meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")
            tg.linear_small_m(meta(M, 2 * 4096), meta(N, 4096), meta(N), meta(M, N), prologue="silu_mul",
                              config=cfg)
    for fn, spec in specs:
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n, t in spec["signature"].items() if t.startswith("*")}
        src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
        ptx = k.asm["ptx"]
        assert "ld.global.v4" in ptx or "cp.async.cg.shared.global" in ptx, "no 16-byte weight loads"
        print(fn.__name__, spec["constexprs"].get("BLOCK_M"), "smem", k.metadata.shared, "ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    """The default configs, fused or not, compile for Hopper (sm_90) and load weights 16 bytes at a time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok") == 12, r.stdout
