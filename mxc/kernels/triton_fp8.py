"""fp8-weight linear (``qlinear``) in Triton: ``y = residual + prologue(x) @ dequant(w)^T (+ bias)``.

Semantics are ``mxc.kernels.fp8_ref.qlinear`` (the oracle): w [N, K] float8_e4m3fn with float32
scales (``channel``/``tensor``: one per output row, [N]; ``block128``: one per 128x128 tile,
[ceil(N/128), ceil(K/128)], see ``mxc.loaders.quantize``); activations quantized per token on the
fly to e4m3 with scale ``xs = max(amax(|row|) / 448, 1e-12)``, ``xq = clamp(x / xs, +-448)``
(both divisions IEEE, ``tl.div_rn``, as torch's on the CPU; e4m3 conversion rounds to nearest
even and saturates on the GPU, as torch's cast after the clamp); the product accumulates in
fp32, is scaled by ``xs[m]`` and the weight scale, rounded to x's dtype, then ``+ bias``
(rounded), then ``residual +`` (rounded) -- the reference's order, not the bf16 linear's (which
adds the bias before rounding). Optional prologue ``silu_mul``: x is [M, 2K] and the row is
``silu(gate) * up`` rounded as ``torch_ref.silu_mul`` (silu in fp32 rounded to the dtype, the
product rounded to the dtype; on the GPU Triton's exp and fp32 division are approximate, within 2 ulp
before the rounding), computed before the amax, so the scale is the post-prologue one.
The activation quantization is bit-exact to the reference in the interpreter
(``test_quantize_rows_exact``); the
results differ from it only by fp32 summation order (the reference rounds ``xq * xs`` and
``w * scale`` per element and sums; here ``sum(xq * w)`` is scaled once, per 128-block of K for
``block128``).

Two wrappers (``qlinear`` picks one by M):

``qlinear_small_m`` (M <= 32; decode): bandwidth-bound like ``triton_gemv``, whose layout it
  keeps (one program owns BLOCK_N weight rows and one of SPLIT_K slices of K; M padded to the
  bucket ``triton_gemv.bucket(M)`` so one binary serves a bucket; grid from (bucket, N, K) only),
  reading each fp8 weight byte once: half the bytes of the bf16 GEMV. Versions (constexprs):
  v1 FMA, BLOCK_M == 1: ``acc[BLOCK_N, BLOCK_K] += float(w) * float(xq)``, one reduction at
     the end (``triton_gemv`` v1 with a cast of the e4m3 weights right after the load).
  v2 FMA, BLOCK_M in 2..8: per row of x (static loop) ``sum(float(w) * float(xq_m), 1)``.
  v3 DOT (``USE_DOT``): ``tl.dot(xq, w^T)`` with both operands e4m3 and fp32 accumulation, x
     padded to a 16-row tile; weights arrive through a cp.async pipeline (num_stages). Default
     for M >= 2, as the bf16 GEMV's v3. On sm_90 a 16- or 32-row tile is below wgmma's 64 rows
     and Triton has no e4m3 mma.sync there, so it widens both operands to fp16 in registers
     (exact) and issues mma.sync m16n8k16 (seen in the PTX): the weight bytes are still fp8.
  Weight-only (``WEIGHT_ONLY``, FMA versions; the default at one row where the config is v1 --
     ``triton_fp8_gemv.WEIGHT_ONLY_M1``): x multiplies as it is, no quantize kernel (the RMSNorm and
     SiLU prologues run as their own kernels first); the reference is ``fp8_ref.qlinear(...,
     weight_only=True)``. Otherwise, activation quantization, two ways (``PREQUANT``):
  fused (PREQUANT=False; no default uses it: measured 1.2-9x slower, see ``config_for``):
     every program first reads its x rows over
     the whole K (from L2; x is at most 32 x K) for the row amax (after the prologue), then
     quantizes each K chunk as it goes. One launch; the x re-reads cost, per program,
     2 x M x K x 2 bytes (bf16; twice that under silu_mul) against BLOCK_N x K weight bytes,
     i.e. 4M/BLOCK_N of the weight traffic (from L2), plus an IEEE division per x element
     per program.
  prequantized (PREQUANT=True; the default): ``_quant_rows_kernel`` (the GEMM's first
     kernel; one program per row, the row held in registers up to 16K elements) writes
     xq [M, K] e4m3 + xs [M] once, and the GEMV reads 1 byte per x element, no divisions.
     A second launch.
  The block sizes are the bf16 GEMV's measured choices carried over by byte counts; ``gemv_tuning.tune_fp8``
  times the candidates.
  block128: a program's BLOCK_N rows lie in one 128-row block (128 % BLOCK_N == 0); FMA paths
  multiply the quantized x chunk by the scale of each element's K block (a gathered [BLOCK_K]
  vector from one scale row, any BLOCK_K); v3 scales each step's dot product, so there BLOCK_K
  must divide 128 (one K block per step).
  ``epilogue="silu_mul"`` (the fp8 MLP's gate/up at decode, ``cuda_ops.rms_norm_mlp_small_m``): a
     program takes BLOCK_N/2 gate rows and the matching up rows and stores silu(gate) * up, [M, N/2],
     with the SiLU kernel's numerics (one K slice, channel/tensor scales; else that kernel after it);
     w's rows as [gate; up] halves or (``interleave`` B) blocks of B gate then B up rows.
  SPLIT_K > 1: fp32 partials (already scaled) in a scratch [SPLIT_K, M, N], summed in a fixed
  order by ``_qgemv_reduce_kernel`` (deterministic, no atomics), which rounds, adds bias and
  residual.

``qlinear_gemm`` (any M; prefill): ``_quant_rows_kernel`` (one program per row: amax pass, then
  quantize-and-store pass; the prologue folded in) writes xq [M, K] e4m3 and xs [M] fp32; then
  ``_qgemm_kernel``: [BLOCK_M, BLOCK_N] tiles (grouped launch order for L2 reuse of w), a K loop
  of ``tl.dot`` on e4m3 operands into fp32 (wgmma on sm_90 for 128-row tiles), rows scaled by
  xs and columns by the weight scale at the end (channel/tensor); for block128 each step's
  product is scaled by its tile's block scale before accumulating (BLOCK_K divides 128 and
  128 % BLOCK_N == 0, so a step is one scalar scale). Default tiles 128 x 128 x 128, 8 warps,
  3 stages (fp8 operands: 32 KB a stage); a pure function of (N, K, dtype, granularity), not M,
  so one binary serves every M.

The code: ``triton_fp8_quant`` (the activation-quantize kernel and what the kernels share),
``triton_fp8_gemv`` (``qlinear_small_m`` and its configs; ``gemv_tuning`` times them) and ``triton_fp8_gemm``
(``qlinear_gemm``); this module is the entry point (``qlinear``, and the public names).

Kernels follow ``mxc.kernels.launch``'s convention (pointers and the dynamic M only; N, K and
all tiles are constexprs; contiguous tensors; ``None`` for absent optional pointers). Plain
pointer arithmetic (no block pointers or tensor descriptors): compiles on Triton 3.6 and 3.9
(``tests/kernels/test_fp8_kernels.py`` compiles every kernel for sm_90). e4m3 values are cast to
fp32 right after loading wherever they feed arithmetic other than ``tl.dot`` (the interpreter
holds fp8 as raw bits).
"""

from __future__ import annotations

import torch

from mxc.kernels.triton_fp8_gemm import QGemmConfig, gemm_config_for, qlinear_gemm
from mxc.kernels.triton_fp8_gemv import QGemvConfig, config_for, qlinear_small_m
from mxc.kernels.triton_fp8_quant import FP8, FP8_MAX, GRANULARITIES
from mxc.kernels.triton_gemv import M_BUCKETS, NUM_SMS, bucket

__all__ = ["qlinear", "qlinear_small_m", "qlinear_gemm", "QGemvConfig", "QGemmConfig",
           "config_for", "gemm_config_for", "FP8", "FP8_MAX", "GRANULARITIES",
           "M_BUCKETS", "NUM_SMS", "bucket"]


def qlinear(x, w, scale, bias=None, residual=None, *, granularity: str = "channel", prologue=None,
            norm_weight=None, eps: float = 1e-6, out=None) -> torch.Tensor:
    """``qlinear_small_m`` for M <= 32 (decode), else ``qlinear_gemm``."""
    fn = qlinear_small_m if x.dim() == 2 and 1 <= x.shape[0] <= M_BUCKETS[-1] else qlinear_gemm
    return fn(x, w, scale, bias, residual, granularity=granularity, prologue=prologue, norm_weight=norm_weight,
              eps=eps, out=out)
