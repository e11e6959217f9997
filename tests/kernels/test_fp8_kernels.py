"""Triton fp8-weight linears (``triton_fp8.qlinear_small_m`` / ``qlinear_gemm``) against ``fp8_ref.qlinear``.

Runs under TRITON_INTERPRET=1 on the CPU (tests/triton_interpreter.py makes the interpreter's
fp8/bf16 conversions round and saturate as the GPU does), with small explicit configs on ragged
shapes: N = 150 (two 128-row scale blocks, the last tile partial), K = 200 (two 128-wide scale
blocks, the last K step partial). Every small-M version (v1 M = 1, v2 M = 2..8, v3 tl.dot),
fused and prequantized activations, split K, the GEMM with ragged M; channel/tensor/block128
scales; bias, residual, silu_mul prologue; fp32/fp16/bf16 (the silu_mul epilogue: test_fp8_silu_epilogue.py;
the shared cases: fp8_cases.py). Tolerance: relative to the output's
largest magnitude, 1e-3 (fp32) and 1e-2 (fp16/bf16); the activation-quantize kernels themselves are
checked bit for bit in test_fp8_quant_kernels.py. Also: no stores outside y, meta-device
recording (grids and binaries from shapes only). The sm_90 compile of every kernel: test_fp8_compile.py; the
GEMV's config rules: test_fp8_gemv_rules.py.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mxc.kernels import fp8_ref, torch_ref
from mxc.kernels import launch as launch_mod
from mxc.kernels import triton_fp8 as tf
from mxc.kernels import triton_fp8_gemm as tfm
from mxc.kernels import triton_fp8_gemv as tfv
from mxc.kernels import triton_fp8_quant as tfq
from mxc.kernels.triton_fp8 import QGemmConfig, QGemvConfig
from mxc.loaders.quantize import quantize_fp8

sys.path.insert(0, str(Path(__file__).parent))  # fp8_cases.py (pytest imports in importlib mode)
from fp8_cases import (DEVICE, DOT, DTYPES, FUSIONS, GRANS, K, N, SMALL_M, SWAP, V1, V2, _check, _dev,  # noqa: E402
                       _fusion_id, _inputs, _launching, _run, _variant_id)

# ----------------------------------------------------------------------------------------------
# qlinear_small_m



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", sorted(SMALL_M))
@pytest.mark.parametrize("gran", GRANS)
def test_small_m(gran, M, dtype):
    fusion = FUSIONS[(GRANS.index(gran) + sorted(SMALL_M).index(M) + DTYPES.index(dtype)) % len(FUSIONS)]
    _run(tf.qlinear_small_m, M, dtype, gran, fusion, SMALL_M[M], seed=M)


# (M, config, granularity, dtype, fusion, K): split K (ragged slices), prequantized x, v3 at
# small buckets, v1 with BLOCK_K spanning two scale blocks, full buckets (8, 32)
VARIANTS = [
    (1, replace(V1, SPLIT_K=3), "block128", torch.float16, (True, True, True), K),
    (1, QGemvConfig(BLOCK_N=16, BLOCK_K=256), "block128", torch.float32, (False, False, True), 300),
    (1, replace(V1, SPLIT_K=2, PREQUANT=True, QUANT_BLOCK_K=64), "channel", torch.float32, (True, True, False), K),
    (3, replace(DOT, SPLIT_K=2), "tensor", torch.float16, (True, True, False), K),
    (3, replace(V2, SPLIT_K=2, PREQUANT=True, QUANT_BLOCK_K=256), "block128", torch.float32, (False, True, True), K),
    (5, replace(DOT, PREQUANT=True, QUANT_BLOCK_K=128), "channel", torch.float16, (False, False, True), K),
    (8, V2, "tensor", torch.float32, (True, False, False), K),
    (17, replace(DOT, SPLIT_K=3, PREQUANT=True, QUANT_BLOCK_K=64), "block128", torch.float32, (True, True, True), K),
    (32, replace(DOT, BLOCK_K=128), "block128", torch.float16, (True, True, False), K),
    # w @ x^T (SWAP_AB): one row, a split ragged K, block scales, a full bucket
    (1, SWAP, "channel", torch.float16, (True, True, True), K),
    (5, replace(SWAP, SPLIT_K=2), "block128", torch.float32, (True, False, True), K),
    (17, SWAP, "tensor", torch.float16, (False, True, False), 300),
    (32, replace(SWAP, BLOCK_N=128, BLOCK_K=128), "block128", torch.float16, (True, True, False), K),
    # one row in v2's loop (REDUCE_STEPS): fused and prequantized x, a split ragged K
    (1, replace(V1, REDUCE_STEPS=True, SPLIT_K=2), "block128", torch.float32, (True, True, True), K),
    (1, replace(V1, REDUCE_STEPS=True, PREQUANT=True, QUANT_BLOCK_K=64), "tensor", torch.float16, (False, True, False),
     300),
]



@pytest.mark.parametrize("M,cfg,gran,dtype,fusion,k", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_small_m_variants(M, cfg, gran, dtype, fusion, k):
    _run(tf.qlinear_small_m, M, dtype, gran, fusion, cfg, seed=M + k, k=k)


# WEIGHT_ONLY: x multiplies as it is (v1 and v2); the prologues run as their own kernels first
WEIGHT_ONLY = [
    (1, replace(V1, WEIGHT_ONLY=True), "channel", torch.float16, (True, True, True)),
    (1, replace(V1, WEIGHT_ONLY=True, SPLIT_K=3), "block128", torch.float32, (False, True, False)),
    (1, QGemvConfig(BLOCK_N=8, BLOCK_K=128, WEIGHT_ONLY=True), "tensor", torch.float32, (False, False, True)),
    (3, replace(V2, WEIGHT_ONLY=True), "block128", torch.float16, (True, False, True)),
    (1, QGemvConfig(BLOCK_N=8, BLOCK_K=64, WEIGHT_ONLY=True, REDUCE_STEPS=True), "channel", torch.float16,
     (False, True, False)),  # Llama-3-8B's down GEMV's loop (``REDUCE_STEPS_MIN_K``)
    (1, QGemvConfig(BLOCK_N=8, BLOCK_K=128, WEIGHT_ONLY=True, REDUCE_STEPS=True, SPLIT_K=2), "block128",
     torch.float32, (True, False, True)),
]


@pytest.mark.parametrize("M,cfg,gran,dtype,fusion", WEIGHT_ONLY,
                         ids=[f"M{v[0]}-split{v[1].SPLIT_K}-{v[2]}-{_fusion_id(v[4])}" + "-reduce" * v[1].REDUCE_STEPS
                              for v in WEIGHT_ONLY])
def test_small_m_weight_only(M, cfg, gran, dtype, fusion):
    """Against the reference's unquantized product, and launching no quantize kernel."""
    bias, residual, prologue = fusion
    x, q, s, b, r = _inputs(M, N, K, dtype, gran, bias, residual, prologue, seed=31 + M)
    pro = "silu_mul" if prologue else None
    y, names = _launching(lambda: tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), _dev(b), _dev(r), granularity=gran,
                                                     prologue=pro, config=cfg))
    _check(y, fp8_ref.qlinear(x, q, s, b, r, gran, pro, weight_only=True), dtype)
    assert "_qgemv_kernel" in names and not any("quant" in n for n in names), names
    quantized = fp8_ref.qlinear(x, q, s, b, r, gran, pro)
    assert not torch.equal(y.cpu(), quantized)  # the product is not the quantized one


@pytest.mark.parametrize("gran,dtype,fusion,block_n", [("channel", torch.bfloat16, (False, True, False), 8),
                                                        ("tensor", torch.float16, (True, False, True), 32),
                                                        ("channel", torch.float32, (True, True, False), 256)])
def test_small_m_preload(gran, dtype, fusion, block_n):
    """PRELOAD (the whole [BLOCK_N, K] tile loaded before the PDL wait): the weight-only product on ragged N,
    tiles past N included; the config rule picks it for small matrices with rows of a power of two."""
    cfg = QGemvConfig(BLOCK_N=block_n, BLOCK_K=256, WEIGHT_ONLY=True, PRELOAD=True, num_warps=4)
    _run(tf.qlinear_small_m, 1, dtype, gran, fusion, cfg, seed=block_n, k=256)
    assert tf.config_for(1, N, 256, dtype, gran).PRELOAD and not tf.config_for(1, N, K, dtype, gran).PRELOAD


def test_preload_rejects_bad_configs():
    x, q, s, _, _ = _inputs(2, N, 256, torch.float16, "channel", False, False, False, seed=5)
    pre = QGemvConfig(BLOCK_N=8, BLOCK_K=256, WEIGHT_ONLY=True, PRELOAD=True)
    with pytest.raises(ValueError, match="PRELOAD"):
        tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), config=pre)  # two rows
    with pytest.raises(ValueError, match="PRELOAD"):
        tf.qlinear_small_m(_dev(x[:1]), _dev(q), _dev(s), config=replace(pre, SPLIT_K=2))
    x, q, s, _, _ = _inputs(1, N, K, torch.float16, "channel", False, False, False, seed=5)
    with pytest.raises(ValueError, match="PRELOAD"):
        tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), config=pre)  # K = 200: not a power of two


def test_weight_only_rms_norm_prologue():
    """The RMSNorm prologue under WEIGHT_ONLY: the norm kernel, then the unquantized product."""
    dtype = torch.float16
    x, q, s, _, _ = _inputs(1, N, K, dtype, "channel", False, False, False, seed=41)
    g = torch.randn(K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), prologue="rms_norm", norm_weight=_dev(g), eps=1e-5,
                           config=replace(V1, WEIGHT_ONLY=True))
    ref = fp8_ref.qlinear(torch_ref.rms_norm(x, g, 1e-5), q, s, weight_only=True)
    _check(y, ref, dtype)


@pytest.mark.parametrize("gran", ["channel", "block128"])
@pytest.mark.parametrize("M,cfg", [(1, V1), (3, V2), (17, DOT)], ids=["v1", "v2", "v3"])
def test_fused_quantization_matches_prequantized(M, cfg, gran):
    """Each program's own amax + quantization gives the same xq and xs as the quantize kernel:
    with the same accumulation order the outputs are bit-identical."""
    dtype = torch.bfloat16 if torch.bfloat16 in DTYPES else torch.float16
    x, q, s, b, r = _inputs(M, N, K, dtype, gran, True, True, True, seed=21)
    args = [_dev(t) for t in (x, q, s, b, r)]
    kw = dict(granularity=gran, prologue="silu_mul")
    fused = tf.qlinear_small_m(*args, **kw, config=cfg)
    pre = tf.qlinear_small_m(*args, **kw, config=replace(cfg, PREQUANT=True, QUANT_BLOCK_K=128))
    assert torch.equal(fused.cpu(), pre.cpu())


@pytest.mark.parametrize("M", [1, 4, 17])
def test_small_m_default_config(M):
    """config_for's choice (large tiles, split K for a small N, prequantized activations; at one row
    the FMA version, unquantized) runs."""
    n, k, dtype = 24, 300, torch.float16
    for gran in ("channel", "block128"):
        cfg = tf.config_for(tf.bucket(M), n, k, dtype, gran)
        assert cfg == tf.config_for(tf.bucket(M), n, k, dtype, gran)
        assert (cfg.WEIGHT_ONLY, cfg.PREQUANT) == ((True, False) if M == 1 else (False, True))
        _run(tf.qlinear_small_m, M, dtype, gran, (True, False, False), None, seed=M, n=n, k=k,
             weight_only=cfg.WEIGHT_ONLY)


def test_small_m_writes_only_inside_out():
    """``out=residual`` inside a NaN buffer (each element read, then written, by one program),
    with and without split K: right values, nothing written around it."""
    M, dtype = 3, torch.float16
    x, q, s, b, r = _inputs(M, N, K, dtype, "block128", True, True, True, seed=13)
    ref = fp8_ref.qlinear(x, q, s, b, r, "block128", "silu_mul")
    for cfg in (V2, replace(V2, SPLIT_K=2), replace(DOT, PREQUANT=True)):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        res = buf[32:32 + M * N].view(M, N)
        res.copy_(r)
        y = tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), _dev(b), res, granularity="block128",
                               prologue="silu_mul", config=cfg, out=res)
        assert y.data_ptr() == res.data_ptr()
        _check(y, ref, dtype)
        assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


# (M, config, granularity, K): K split into slices of 128 whose last one runs past K although K is a whole number of
# 64-wide steps (192 = 128 + 64: the second slice's second step is past K), or starts past K and past the last scale
# block (200 in three slices of 128: the third from 256, K block 2 of 2); v1 and v3 block-scaled steps whose
# columns past K fall in scale block KB (the block after the last)
SPLIT_EDGES = [
    (1, replace(V1, SPLIT_K=2), "channel", 192),
    (3, replace(V2, SPLIT_K=2), "block128", 192),
    (17, replace(DOT, SPLIT_K=2), "channel", 192),
    (5, replace(SWAP, SPLIT_K=2), "tensor", 192),
    (17, replace(DOT, SPLIT_K=3), "block128", 200),
    (1, replace(V1, SPLIT_K=3), "block128", 200),
    (3, replace(V2, SPLIT_K=3), "block128", 200),
    (1, QGemvConfig(BLOCK_N=16, BLOCK_K=256), "block128", 100),
]


@pytest.mark.parametrize("M,cfg,gran,k", SPLIT_EDGES,
                         ids=[_variant_id((M, c, g, torch.float32, FUSIONS[0], k)) for M, c, g, k in SPLIT_EDGES])
def test_small_m_k_edges_guarded(M, cfg, gran, k):
    """Every launch under ``guarded`` (tests/kernels/guarded.py): columns past K, and scales past the last K block
    of a row block, are masked (their surroundings are NaN, so an unmasked load shows even where it is multiplied by
    a masked zero), and nothing is written outside the scratch or y."""
    from tests.kernels.guarded import guarded

    with guarded():
        _run(tf.qlinear_small_m, M, torch.float32, gran, FUSIONS[1] if M == 1 else FUSIONS[0], cfg, seed=M + k, k=k)


# ----------------------------------------------------------------------------------------------
# qlinear_gemm

GEMM = QGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1, QUANT_BLOCK_K=256)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [17, 40])
@pytest.mark.parametrize("gran", GRANS)
def test_gemm(gran, M, dtype):
    fusion = FUSIONS[(GRANS.index(gran) + (M == 40) * 2 + DTYPES.index(dtype)) % len(FUSIONS)]
    cfg = GEMM if M == 40 else replace(GEMM, BLOCK_K=128, GROUP_M=1, QUANT_BLOCK_K=64)
    _run(tf.qlinear_gemm, M, dtype, gran, fusion, cfg, seed=M)


def test_gemm_default_config():
    """gemm_config_for's 128 x 128 x 128 tiles (one partial tile here), block scales and channel."""
    for gran in ("channel", "block128"):
        _run(tf.qlinear_gemm, 40, torch.float16, gran, (True, True, True), None, seed=4, n=24, k=300)


def test_gemm_writes_only_inside_out():
    M, dtype = 40, torch.bfloat16 if torch.bfloat16 in DTYPES else torch.float16
    x, q, s, b, r = _inputs(M, N, K, dtype, "channel", True, True, False, seed=17)
    ref = fp8_ref.qlinear(x, q, s, b, r, "channel")
    buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
    res = buf[32:32 + M * N].view(M, N)
    res.copy_(r)
    y = tf.qlinear_gemm(_dev(x), _dev(q), _dev(s), _dev(b), res, granularity="channel", config=GEMM, out=res)
    assert y.data_ptr() == res.data_ptr()
    _check(y, ref, dtype)
    assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


@pytest.mark.parametrize("fn,cfg", [(tf.qlinear_small_m, V2), (tf.qlinear_small_m, replace(V2, SPLIT_K=2)),
                                    (tf.qlinear_gemm, GEMM)], ids=["small_m", "small_m-split2", "gemm"])
def test_epilogue_rounding_order(fn, cfg):
    """The reference's epilogue exactly: the product rounded to the dtype, then ``+ bias``
    rounded, then ``residual +`` rounded (checked against the kernel's own unfused output)."""
    dtype = torch.bfloat16 if torch.bfloat16 in DTYPES else torch.float16
    M = 3 if fn is tf.qlinear_small_m else 40
    x, q, s, b, r = _inputs(M, N, K, dtype, "block128", True, True, False, seed=5)
    x, q, s, b, r = (_dev(t) for t in (x, q, s, b, r))
    run = lambda *a: fn(x, q, s, *a, granularity="block128", config=cfg).cpu()  # noqa: E731
    plain, with_bias, fused = run(), run(b), run(b, r)
    assert torch.equal(with_bias, plain + b.cpu())
    assert torch.equal(fused, r.cpu() + with_bias)


# ----------------------------------------------------------------------------------------------
# dispatch, input checks, recording (the activation-quantize kernels: test_fp8_quant_kernels.py)


@pytest.mark.parametrize("M", [1, 5, 40])
def test_qlinear_rms_norm_prologue(M):
    """qlinear with the rms_norm prologue (GEMV at M <= 32, GEMM above) against the reference composition."""
    n, k, dtype = 48, 128, torch.float16
    x, w, s, b, _ = _inputs(M, n, k, dtype, "channel", True, False, False, seed=M)
    g = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(2))).to(dtype)
    y = tf.qlinear(_dev(x), _dev(w), _dev(s), _dev(b), granularity="channel", prologue="rms_norm",
                   norm_weight=_dev(g), eps=1e-6)
    if M == 1:  # one row, N <= K: the FMA GEMV, x unquantized after the RMSNorm kernel
        assert tf.config_for(1, n, k, dtype, "channel").WEIGHT_ONLY
        ref = fp8_ref.qlinear(torch_ref.rms_norm(x, g, 1e-6), w, s, b, weight_only=True)
    else:
        ref = torch_ref.rms_norm_qlinear(x, g, w, s, b, 1e-6, "channel")
    _check(y, ref, dtype)
    with pytest.raises(ValueError, match="norm_weight"):
        tf.qlinear(_dev(x), _dev(w), _dev(s), prologue="rms_norm")


def test_qlinear_dispatch():
    launches = []
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    w, s = meta(256, 512, dtype=tf.FP8), meta(256, dtype=torch.float32)
    with launch_mod.using(lambda kernel, *a: launches.append(kernel)):
        tf.qlinear(meta(32, 512), w, s)
        assert tfm._qgemm_kernel not in launches
        assert launches[0] is tfq._quant_tile_kernel  # from one row
        launches.clear()
        tf.qlinear(meta(33, 512), w, s)
        assert launches == [tfq._quant_tile_kernel, tfm._qgemm_kernel]


@pytest.mark.parametrize("gran", ["channel", "block128"])
@pytest.mark.parametrize("fn,m,cfg", [(tf.qlinear_small_m, 5, SWAP), (tf.qlinear_small_m, 17, DOT),
                                      (tf.qlinear_gemm, 40, GEMM)], ids=["swap", "dot", "gemm"])
def test_promoted_accumulation(fn, m, cfg, gran, monkeypatch):
    """``FP8_ACC_PROMOTE``: the fp8 dots promote their sums every N elements of K, at most a dot's BLOCK_K (64
    here), through a launch constexpr passed only when set, so the shipped binaries stay as they were; the values
    are the reference's either way (the interpreter sums in fp32; the GPU's difference: bench/fp8_accum_lab.py)."""
    def constexprs(promote):
        seen = []

        def launcher(kernel, grid, args, consts, num_warps, num_stages):
            seen.append(consts)
            launch_mod.jit_launch(kernel, grid, args, consts, num_warps, num_stages)

        monkeypatch.setattr(tfq, "FP8_ACC_PROMOTE", promote)
        with launch_mod.using(launcher):
            _run(fn, m, torch.float32, gran, FUSIONS[0], cfg, seed=m)
        return [c.get("PROMOTE_ACC") for c in seen if "BLOCK_SCALE" in c]  # the GEMV's or GEMM's launch

    assert constexprs(0) == [None]
    assert constexprs(32) == [32]
    assert constexprs(1024) == [64]


def test_rejects_bad_inputs():
    x, q, s, b, r = (_dev(t) for t in _inputs(2, 8, 16, torch.float16, "channel", True, True, False, seed=1))
    ok = dict(granularity="channel")
    tf.qlinear_small_m(x, q, s, b, r, **ok)
    bad = [
        ((x, q.float(), s, b, r), ok),  # weight not fp8
        ((x, q, s.half(), b, r), ok),  # scale not fp32
        ((x, q, s[:4], b, r), ok),  # scale shape
        ((x, q, s, b, r), dict(granularity="block128")),  # channel scale for block128
        ((x, q, s, b, r), dict(granularity="row")),
        ((x, q, s, b, r), dict(ok, prologue="silu_mul")),  # x is [M, K], not [M, 2K]
        ((x, q, s, b, r), dict(ok, prologue="gelu_mul")),
        ((x, q, s, b.float(), r), ok),
        ((x, q, s, b, r[:1]), ok),
        ((x.t().contiguous().t(), q, s, b, r), ok),
        ((x.to(torch.float64), q, s, b, r), ok),
        ((x, q, s, b, r), dict(ok, out=torch.empty(2, 8, device=DEVICE))),  # out dtype
    ]
    for fn in (tf.qlinear_small_m, tf.qlinear_gemm):
        for args, kw in bad:
            with pytest.raises(ValueError):
                fn(*args, **kw)
    with pytest.raises(ValueError):
        tf.qlinear_small_m(_dev(torch.randn(33, 16).half()), q, s, **ok)  # past the last bucket
    qb, sb = (_dev(t) for t in quantize_fp8(torch.randn(8, 16), "block128"))
    with pytest.raises(ValueError):  # v3 with block scales: one K block a step
        tf.qlinear_small_m(x, qb, sb, granularity="block128", config=QGemvConfig(16, 256, USE_DOT=True))
    with pytest.raises(ValueError):
        tf.qlinear_gemm(x, qb, sb, granularity="block128", config=QGemmConfig(BLOCK_K=256))
    with pytest.raises(ValueError):
        tf.qlinear_small_m(x, q, s, config=QGemvConfig(16, 48), **ok)  # not a power of two


def test_meta_recording():
    """On meta tensors nothing runs; the small-M grids and constexprs depend on the bucket only
    (M = 3 and 4 share a binary, M passed as the dynamic argument); the GEMM's binaries are
    the same for every M and its grid covers M; prequantization adds the quantize launch."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    n, k = 4096, 4096
    for gran in GRANS:
        w = meta(n, k, dtype=tf.FP8)
        s = meta(32, 32, dtype=torch.float32) if gran == "block128" else meta(n, dtype=torch.float32)
        seen = {}
        with launch_mod.using(record):
            for M in (1, 2, 3, 4, 5, 8, 17, 32):
                launches.clear()
                y = tf.qlinear_small_m(meta(M, 2 * k), w, s, meta(n), meta(M, n), granularity=gran,
                                       prologue="silu_mul")
                assert y.shape == (M, n) and y.device.type == "meta"
                kernels = [lc[0] for lc in launches]
                # SiLU-and-mul's own kernel, the plain quantize (none at one row on CUDA cores), the GEMV
                pre = M > 1  # N = K: v1 at one row, x unquantized
                assert kernels[0].__name__ == "silu_mul_kernel"
                gemv = 1 + pre
                assert kernels[1:gemv + 1] == [tfq._quant_tile_kernel] * pre + [tfv._qgemv_kernel]
                assert kernels[gemv + 1:] in ([], [tfv._qgemv_reduce_kernel])  # split K (SWAP_AB's 64-row tiles)
                kernel, grid, args, consts, nw, ns = launches[gemv]
                assert args[-1] == M and consts["BLOCK_SCALE"] == (gran == "block128")
                assert not consts["PROLOGUE_SILU_MUL"] and consts["PREQUANT"] == pre and consts["WEIGHT_ONLY"] != pre
                spec = launch_mod.spec_of(kernel, args, consts, nw, ns)
                assert spec["signature"]["w_ptr"] == "*fp8e4nv"
                assert spec["signature"]["x_ptr"] == ("*fp8e4nv" if pre else "*bf16")
                seen[M] = [(lc[0], lc[1], lc[3], lc[4], lc[5]) for lc in launches if lc[0] is tfv._qgemv_kernel]
            gemm = {}
            for M in (33, 100, 1000):
                launches.clear()
                tf.qlinear_gemm(meta(M, k), w, s, meta(n), granularity=gran)
                (qk, qgrid, qargs, qconsts, _, _), (gk, ggrid, gargs, gconsts, _, _) = launches
                assert (qk, gk) == (tfq._quant_tile_kernel, tfm._qgemm_kernel) and gargs[-1] == M == qargs[-1]
                assert qgrid == (-(-M // qconsts["BLOCK_M"]),) and ggrid == (-(-M // 128) * (n // 128),)
                gemm[M] = (qconsts, gconsts)
        assert seen[3] == seen[4] and seen[5] == seen[8] and seen[17] == seen[32]
        assert seen[1] != seen[2]
        assert gemm[33] == gemm[100] == gemm[1000]
    # split K (a small N, not preloaded): the reduce kernel rounds and adds bias and residual
    with launch_mod.using(record), pytest.MonkeyPatch.context() as mp:
        mp.setattr(tfv, "PRELOAD_MAX_BYTES", 0)
        launches.clear()
        tf.qlinear_small_m(meta(1, k), meta(512, k, dtype=tf.FP8), meta(512, dtype=torch.float32), meta(512),
                           meta(1, 512))
    assert [lc[0] for lc in launches] == [tfv._qgemv_kernel, tfv._qgemv_reduce_kernel]  # x unquantized at one row
    assert launches[0][3]["SPLIT_K"] > 1 and launches[0][3]["HAS_BIAS"] is False
    assert launches[1][3]["HAS_BIAS"] is True and launches[1][3]["HAS_RESIDUAL"] is True


@pytest.mark.parametrize("prologue", [None, "silu_mul", "rms_norm"])
def test_scaled_mm_cpu_against_the_reference(prologue):
    """fp8_gemm.scaled_mm on the CPU (torch._scaled_mm runs there) against fp8_ref.qlinear, with each prologue,
    the bias and the residual; fp8_gemm.cutlass refuses CPU tensors."""
    from mxc.kernels import fp8_gemm

    try:  # row-wise scales on the CPU came with torch 2.12/2.13 (2.11: per-tensor only)
        one = torch.ones(16, 16).to(tf.FP8)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"this torch's CPU _scaled_mm takes no row-wise scales: {str(e).splitlines()[0][:80]}")
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 64
    x = torch.randn(5, 2 * k if prologue == "silu_mul" else k, generator=gen).to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k ** -0.5, "channel")
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    residual = torch.randn(5, n, generator=gen).to(torch.bfloat16)
    norm_weight = torch.rand(k, generator=gen).to(torch.bfloat16) + 0.5
    got = fp8_gemm.scaled_mm(x, q, s, bias, residual, prologue=prologue, norm_weight=norm_weight, eps=1e-6)
    xr = torch_ref.rms_norm(x, norm_weight, 1e-6) if prologue == "rms_norm" else x
    want = fp8_ref.qlinear(xr, q, s, bias, residual, prologue="silu_mul" if prologue == "silu_mul" else None)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        fp8_gemm.cutlass(x, q, s, prologue=prologue, norm_weight=norm_weight)


def test_gemm_rejects_bad_configs():
    """qlinear_gemm refuses, before any launch, configs its kernel cannot run (``_check_gemm_config``), and
    gemm_config_for an unsupported dtype or granularity."""
    x, q, s, _, _ = (_dev(t) for t in _inputs(40, 32, 64, torch.float16, "channel", False, False, False, seed=3))
    qb, sb = (_dev(t) for t in quantize_fp8(torch.randn(32, 64), "block128"))
    launches = []
    with launch_mod.using(lambda *a: launches.append(a)):
        for cfg, msg in [(replace(GEMM, GROUP_M=0), "GROUP_M >= 1"), (replace(GEMM, QUANT_BLOCK_K=96), "powers of two"),
                         (replace(GEMM, BLOCK_M=8), "BLOCK_M, BLOCK_N >= 16"),
                         (replace(GEMM, BLOCK_K=16), "BLOCK_K >= 32")]:
            with pytest.raises(ValueError, match=msg):
                tf.qlinear_gemm(x, q, s, granularity="channel", config=cfg)
        with pytest.raises(ValueError, match="dividing 128"):  # a 256-column tile spans two scale blocks
            tf.qlinear_gemm(x, qb, sb, granularity="block128", config=replace(GEMM, BLOCK_N=256))
    assert launches == []
    tf.qlinear_gemm(x, q, s, granularity="channel", config=replace(GEMM, BLOCK_N=256))  # channel: any BLOCK_N
    with pytest.raises(ValueError, match="unsupported dtype"):
        tf.gemm_config_for(32, 64, torch.float64, "channel")
    with pytest.raises(ValueError, match="granularity"):
        tf.gemm_config_for(32, 64, torch.float16, "row")


@pytest.mark.parametrize("M", [3, 40])
@pytest.mark.parametrize("gran", ["tensor", "block128"])
def test_qlinear_passes_granularity_and_out(M, gran):
    """qlinear hands its granularity and ``out`` to the wrapper it picks (GEMV at M <= 32, GEMM above)."""
    dtype = torch.float16
    x, q, s, b, r = _inputs(M, 24, 300, dtype, gran, True, True, False, seed=M)
    out = torch.empty(M, 24, dtype=dtype, device=DEVICE)
    y = tf.qlinear(_dev(x), _dev(q), _dev(s), _dev(b), _dev(r), granularity=gran, out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, fp8_ref.qlinear(x, q, s, b, r, gran), dtype)


def test_scaled_mm_cpu_interleave_and_eps():
    """fp8_gemm.scaled_mm on the CPU de-interleaves the SiLU prologue's gate/up blocks (``interleave``) and
    uses the RMSNorm prologue's ``eps``."""
    from mxc.kernels import fp8_gemm

    try:
        one = torch.ones(16, 16).to(tf.FP8)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"this torch's CPU _scaled_mm takes no row-wise scales: {str(e).splitlines()[0][:80]}")
    gen = torch.Generator().manual_seed(12)
    n, k, B = 48, 64, 16
    q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k ** -0.5, "channel")
    halves = torch.randn(5, 2 * k, generator=gen).to(torch.bfloat16)  # [gate | up]
    gate, up = halves.chunk(2, dim=-1)  # interleaved: B gate columns, then their B up columns, block by block
    inter = torch.stack([gate.reshape(5, -1, B), up.reshape(5, -1, B)], dim=2).reshape(5, 2 * k)
    got = fp8_gemm.scaled_mm(inter, q, s, prologue="silu_mul", interleave=B)
    want = fp8_ref.qlinear(halves, q, s, prologue="silu_mul")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16) * 0.3
    g = torch.rand(k, generator=gen).to(torch.bfloat16) + 0.5
    got = fp8_gemm.scaled_mm(x, q, s, prologue="rms_norm", norm_weight=g, eps=1.0)  # eps comparable to mean(x^2)
    want = fp8_ref.qlinear(torch_ref.rms_norm(x, g, 1.0), q, s)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_cutlass_paths_record_on_meta():
    """On meta tensors (a build recording) fp8_gemm.cutlass records the quantize kernel alone, the RMSNorm
    prologue's weight passed to it; fp8_gemm.silu_pair records the RMSNorm-quantize (with the norm weight) and
    quantize_max over h [M, N/2] and pmax [M, N / (2 * interleave)]."""
    from mxc.kernels import fp8_gemm

    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    m, n, k, B = 40, 512, 256, 64
    w, s, g = meta(n, k, dtype=tf.FP8), meta(n, dtype=torch.float32), meta(k)
    launches = []
    with launch_mod.using(lambda kernel, grid, args, *rest: launches.append((kernel, args))):
        y = fp8_gemm.cutlass(meta(m, k), w, s, prologue="rms_norm", norm_weight=g)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.device.type == "meta"
        assert [kl for kl, _ in launches] == [tfq._quant_tile_kernel]
        assert any(a is g for a in launches[0][1])
        launches.clear()
        xq, xs = fp8_gemm.silu_pair(meta(m, k), g, w, s, 1e-6, B)
    assert xq.shape == (m, n // 2) and xs.shape[0] == m
    assert len(launches) == 2 and any(a is g for a in launches[0][1])
    pmax = [a for a in launches[1][1] if isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.dim() == 2]
    assert [tuple(p.shape) for p in pmax] == [(m, n // (2 * B))]


def test_has_silu_pair_needs_the_library_s_interleave(monkeypatch):
    from types import SimpleNamespace

    from mxc.kernels import cutlass_fp8, fp8_gemm

    lib = SimpleNamespace(has_silu_pair=True, pair_block=64)
    monkeypatch.setattr(cutlass_fp8, "active", lambda k=0: lib)
    assert fp8_gemm.has_silu_pair(64) and not fp8_gemm.has_silu_pair(32) and not fp8_gemm.has_silu_pair(0)
    lib.has_silu_pair = False
    assert not fp8_gemm.has_silu_pair(64)
