"""Every fp8 kernel compiles for Hopper (sm_90) with the AOT build's options, checked in its PTX.

Runs Triton's compiler (not the interpreter) in a subprocess on a machine without a GPU: saturating e4m3
quantization with IEEE divisions (the SiLU's sigmoid excepted), widened e4m3 weights or fp8 wgmma in the GEMV (SWAP_AB puts the weights
on the wgmma side), fp8 wgmma in the GEMM, shared memory within the SM's, no global scratch; the SiLU's gate/up
interleaved in blocks (``PAIR_BLOCK``) and ``quantize_max`` too. The kernels' numerics are tested in
test_fp8_kernels.py and test_fp8_quant_kernels.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.sm90_compile import run_compile_script


_COMPILE_SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mxc.kernels import kernel_templates, launch as L, triton_fp8 as tf, triton_fp8_gemv as tfv
    from mxc.kernels import triton_fp8_quant as tfq

    specs = {}
    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        spec = L.spec_of(kernel, args, constexprs, num_warps, num_stages)
        specs.setdefault(L.spec_key(spec), (kernel, spec))
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    n, k = 4096, 4096
    with L.using(record):
        for gran in ("channel", "block128"):
            w = meta(n, k, dtype=tf.FP8)
            s = meta(32, 32, dtype=torch.float32) if gran == "block128" else meta(n, dtype=torch.float32)
            for M in (1, 2, 32):  # v1 fused, v3 fused, v3 prequantized
                tf.qlinear_small_m(meta(M, 2 * k), w, s, meta(n), meta(M, n), granularity=gran, prologue="silu_mul")
            tf.qlinear_small_m(meta(4, k), w, s, granularity=gran, config=tf.QGemvConfig(32, 512))  # v2
            s512 = meta(4, 32, dtype=torch.float32) if gran == "block128" else meta(512, dtype=torch.float32)
            tf.qlinear_small_m(meta(1, k), meta(512, k, dtype=tf.FP8), s512, meta(512), meta(1, 512),
                               granularity=gran)  # split K + reduce
            tf.qlinear_gemm(meta(300, 2 * k), w, s, meta(n), meta(300, n), granularity=gran, prologue="silu_mul")
            tf.qlinear_gemm(meta(300, k, dtype=torch.float16), w, s, granularity=gran)
            tf.qlinear_gemm(meta(300, k), w, s, granularity=gran, prologue="rms_norm", norm_weight=meta(k))
        # the wgmma GEMV in one K slice at 5 stages (MEASURED entries, SWAP_AB_ONE_SLICE), at its largest x tile
        tf.qlinear_small_m(meta(32, k), meta(n, k, dtype=tf.FP8), meta(n, dtype=torch.float32),
                           config=tf.QGemvConfig(64, 256, 1, True, True, 4, 5, 4096, SWAP_AB=True))
        # the Llama-3-8B down GEMV at one row: weight-only in v2's loop (REDUCE_STEPS)
        tf.qlinear_small_m(meta(1, 14336), meta(n, 14336, dtype=tf.FP8), meta(n, dtype=torch.float32), None, meta(1, n))
        # the Llama-3-8B down projection's input: K = 14336 in three pieces under SiLU-and-mul
        tf.qlinear_gemm(meta(300, 2 * 14336), meta(n, 14336, dtype=tf.FP8), meta(n, dtype=torch.float32),
                        prologue="silu_mul")
        # gate/up in blocks of 64 gate then 64 up (the SiLU-pair layout): the decode GEMV's SiLU epilogue (v1
        # weight-only, SWAP_AB), the SiLU kernel and the quantize kernels' SiLU prologue (tiled, two passes);
        # and quantize_max on the pair GEMM's h and row maxima
        wgu, sgu = meta(2048, k, dtype=tf.FP8), meta(2048, dtype=torch.float32)
        tf.qlinear_small_m(meta(1, k), wgu, sgu, epilogue="silu_mul", interleave=64,
                           config=tf.QGemvConfig(16, 1024, num_warps=8, WEIGHT_ONLY=True))
        tf.qlinear_small_m(meta(2, k), wgu, sgu, epilogue="silu_mul", interleave=64,
                           config=tf.QGemvConfig(64, 256, USE_DOT=True, PREQUANT=True, num_stages=4,
                                                 QUANT_BLOCK_K=4096, SWAP_AB=True))
        for M, K in ((4, 14336), (300, 14336), (4, 20480)):
            tfq._prequantize(meta(M, 2 * K), M, K, True, tfq._quant_block(K), interleave=64)
        for dtype in (torch.bfloat16, torch.float32):
            tfq.quantize_max(meta(2048, 14336, dtype=dtype), meta(2048, 224, dtype=torch.float32))
    for fn, spec in specs.values():
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a, t in spec["signature"].items() if t.startswith("*")}
        src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                    "enable_fp_fusion": True})
        ptx, md = c.asm["ptx"], c.metadata
        assert md.shared <= 227 * 1024, (fn.__name__, md.shared)
        assert not getattr(md, "global_scratch_size", 0), fn.__name__
        name = fn.__name__
        if name == "silu_mul_kernel":  # the decode side's SiLU before the quantize: Triton's division, as the prologue's
            assert "div.full.f32" in ptx and "div.rn" not in ptx, name
            print(name, "pairs" if "PAIR_BLOCK" in kernel_templates.source(fn.__module__) else "", "ok")
            continue
        if name != "_qgemv_reduce_kernel":
            assert "e4m3" in ptx, name + ": no e4m3 conversion or mma"
        if name in ("_quant_rows_kernel", "_quant_tile_kernel", "_quant_max_kernel"):
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # rounding, saturating quantization
            assert "div.rn.f32" in ptx
        if name == "_quant_tile_kernel":  # x * (1 / xs) corrected by fmas, no division per element
            assert ptx.count("fma.rn.f32") >= 4 * spec["constexprs"]["BLOCK_M"], name
        if name == "_quant_max_kernel":  # the same; two divisions a program (the scale, its reciprocal)
            assert ptx.count("div.rn.f32") == 2 and ptx.count("fma.rn.f32") >= 4, name
        # IEEE divisions for the scales and quantization, as torch's (`/` would be div.full's approximation);
        # the RMSNorm prologue's mean of squares is `/ K` (one div.approx, as the rows kernel's); the SiLU
        # prologue's (and the GEMV's SiLU epilogue's) sigmoid is Triton's division (div.full, one an element), as
        # silu_mul_kernel's
        approx = ptx.count("div.full") + ptx.count("div.approx")
        if spec["constexprs"].get("PROLOGUE_SILU_MUL") or spec["constexprs"].get("EPILOGUE_SILU_MUL"):
            assert approx == ptx.count("div.full.f32") >= 1, name
        else:
            assert approx == (1 if spec["constexprs"].get("PROLOGUE_RMS_NORM") else 0), name
        if name == "_qgemv_kernel":
            assert "ld.global.v4" in ptx or "cp.async.cg.shared.global" in ptx, "no 16-byte weight loads"
            if spec["constexprs"].get("SWAP_AB"):  # the default from 2 rows: weights on the e4m3 wgmma side
                assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx, "no fp8 wgmma"
            else:
                assert "cvt.rn.f16x2.e4m3x2" in ptx  # e4m3 weights widened in registers
        if name == "_qgemm_kernel":
            assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx, "no fp8 wgmma"
        print(name, spec["constexprs"].get("BLOCK_M"), "pairs" if spec["constexprs"].get("PAIR_BLOCK") else "",
              "smem", md.shared, "ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    """Every kernel and version compiles for Hopper (sm_90) with the AOT build's options; the PTX
    quantizes with saturating e4m3 conversions, widens e4m3 weights, and the GEMM uses fp8 wgmma."""
    out = run_compile_script(_COMPILE_SCRIPT)
    assert out.count(" ok") >= 14, out
    assert out.count(" pairs ") == 5 and out.count("_quant_max_kernel") == 2, out


_SWAP_PTX = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_fp8 as tf, triton_fp8_gemv as tfv
meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
cfg = tf.QGemvConfig(BLOCK_N=128, BLOCK_K=256, USE_DOT=True, PREQUANT=True, num_warps=4, num_stages=4,
                     QUANT_BLOCK_K=4096, SWAP_AB=True)
rec = L.Recorder()
with L.using(rec):
    tf.qlinear_small_m(meta(1, 4096), meta(4096, 4096, dtype=torch.float8_e4m3fn), meta(4096, dtype=torch.float32),
                       config=cfg)
(spec,) = [s for s in rec.specs.values() if s["kernel"].endswith("_qgemv_kernel")]
fn = tfv._qgemv_kernel
aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
           if t.startswith("*")}
ptx = triton.compile(ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=aligned),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
print("e4m3 wgmma" if "wgmma.mma_async" in ptx and "e4m3" in ptx.split("wgmma.mma_async", 1)[1][:80] else "none")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_swap_ab_runs_on_fp8_wgmma():
    """SWAP_AB puts the weights on the 64-row side of the product: sm_90 then issues e4m3 wgmma (no
    widening of the weights to fp16, which the 16-row v3 tile needs for mma.sync)."""
    out = run_compile_script(_SWAP_PTX)
    assert out.strip().splitlines()[-1] == "e4m3 wgmma", out


_PRELOAD_PTX = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_fp8 as tf, triton_fp8_gemv as tfv
meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
rec = L.Recorder(pdl=True)
with L.using(rec):  # Llama-3-8B's o GEMV at one row, with the residual
    tf.qlinear_small_m(meta(1, 4096), meta(4096, 4096, dtype=torch.float8_e4m3fn), meta(4096, dtype=torch.float32),
                       None, meta(1, 4096))
for spec in rec.specs.values():
    fn = tfv._qgemv_kernel
    assert spec["constexprs"]["PRELOAD"] and spec["constexprs"]["USE_PDL"], spec["constexprs"]
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
               if t.startswith("*")}
    ptx = triton.compile(ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=aligned),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]}).asm["ptx"]
    before, after = ptx.split("griddepcontrol.wait", 1)
    print(fn.__name__, before.count("ld.global.v4"), after.count("ld.global.v4"))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_preload_loads_weights_before_the_wait():
    """A PRELOAD GEMV (one row, small matrix) issues its whole tile's weight loads before ``griddepcontrol.wait``:
    32 KB a program over 256 threads, eight 16-byte loads a thread; after the wait only x (and the epilogue)."""
    out = run_compile_script(_PRELOAD_PTX)
    counts = {name: (int(b), int(a)) for name, b, a in (line.split() for line in out.strip().splitlines())}
    assert set(counts) == {"_qgemv_kernel"}, out
    for name, (before, after) in counts.items():
        assert before >= 8 and after < before, (name, before, after)
