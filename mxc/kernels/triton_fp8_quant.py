"""The per-token activation quantization of the fp8 linears, and what their kernels share.

``_quant_rows_kernel`` (one program per row) computes ``xs = max(amax(|a|) / 448, 1e-12)`` and
``xq = e4m3(a / xs)`` of each row ``a`` of x, of ``silu(gate) * up`` (``PROLOGUE_SILU_MUL``) or of
``rms_norm(x, g, eps)`` (``PROLOGUE_RMS_NORM``); ``_prequantize`` launches it. The Triton helpers
(activation load with the prologue, row scale, quantization, the reference's epilogue) and the
input checks serve ``triton_fp8_gemv`` and ``triton_fp8_gemm``. Semantics and numerics:
``mxc.kernels.triton_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import check_operand, launch
from mxc.kernels.pdl import pdl_enter

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("channel", "tensor", "block128")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_act(x_ptrs, mask, other, K: tl.constexpr, PROLOGUE_SILU_MUL: tl.constexpr):
    """A chunk of the (post-prologue) activation rows as fp32 values of x's dtype. With
    PROLOGUE_SILU_MUL, ``x_ptrs`` point into the gate half of x [M, 2K] and the chunk is
    ``silu(gate) * up`` rounded as ``torch_ref.silu_mul``; masked lanes give 0."""
    if PROLOGUE_SILU_MUL:
        ty = x_ptrs.dtype.element_ty
        gate = tl.load(x_ptrs, mask=mask, other=other).to(tl.float32)
        up = tl.load(x_ptrs + K, mask=mask, other=other).to(tl.float32)
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
        return (act * up).to(ty).to(tl.float32)
    else:
        return tl.load(x_ptrs, mask=mask, other=other).to(tl.float32)


@triton.jit
def _row_scale(amax):
    """Per-token scale from the row's amax: ``max(amax / 448, 1e-12)`` (IEEE division)."""
    return tl.maximum(tl.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _quant(x, xs):
    """fp32 values -> e4m3: ``clamp(x / xs, -448, 448)`` rounded to nearest even."""
    q = tl.div_rn(x, xs)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q.to(tl.float8e4nv)


@triton.jit
def _finish(acc, y_ptr, b_ptr, r_ptr, offs, offs_n, n_ok, mask,
            HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The reference's epilogue on acc [rows, cols] (fp32, scaled): round to y's dtype, then
    ``+ bias`` rounded, then ``residual +`` rounded; store."""
    ty = y_ptr.dtype.element_ty
    y = acc.to(ty)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(ty)
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _quant_rows_kernel(x_ptr, xq_ptr, xs_ptr, g_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       PROLOGUE_SILU_MUL: tl.constexpr, PROLOGUE_RMS_NORM: tl.constexpr = False,
                       USE_PDL: tl.constexpr = False):
    """One program per row: xs[row] = max(amax(|a|) / 448, 1e-12) and xq[row] = e4m3(a / xs)
    where a is the row of x (or silu(gate) * up of x [M, 2K], or with PROLOGUE_RMS_NORM
    ``torch_ref.rms_norm(x, g, eps)``, rounded as it is). One pass (the row held in registers)
    when BLOCK_K >= K, else two passes over the row (no norm then)."""
    pdl_enter(USE_PDL)
    tl.static_assert(not PROLOGUE_RMS_NORM or (BLOCK_K >= K and not PROLOGUE_SILU_MUL))
    X_STRIDE: tl.constexpr = 2 * K if PROLOGUE_SILU_MUL else K
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row * X_STRIDE + offs_k
    if BLOCK_K >= K:
        k_ok = offs_k < K
        a = _load_act(x_ptrs, k_ok, 0.0, K, PROLOGUE_SILU_MUL)
        if PROLOGUE_RMS_NORM:  # HF's RMSNorm: normalised row rounded to the dtype, times the weight, rounded
            ty = x_ptr.dtype.element_ty
            rstd = tl.rsqrt(tl.sum(a * a, axis=0) / K + eps)
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = (g * (a * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        xs = _row_scale(tl.max(tl.abs(a), axis=0))
        tl.store(xs_ptr + row, xs)
        tl.store(xq_ptr + row * K + offs_k, _quant(a, xs), mask=k_ok)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = _load_act(x_ptrs + k, None, None, K, PROLOGUE_SILU_MUL)
            else:
                a = _load_act(x_ptrs + k, (k + offs_k) < K, 0.0, K, PROLOGUE_SILU_MUL)
            amax = tl.maximum(amax, tl.abs(a))
        xs = _row_scale(tl.max(amax, axis=0))
        tl.store(xs_ptr + row, xs)
        q_ptrs = xq_ptr + row * K + offs_k
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = _load_act(x_ptrs + k, None, None, K, PROLOGUE_SILU_MUL)
                tl.store(q_ptrs + k, _quant(a, xs))
            else:
                k_ok = (k + offs_k) < K
                a = _load_act(x_ptrs + k, k_ok, 0.0, K, PROLOGUE_SILU_MUL)
                tl.store(q_ptrs + k, _quant(a, xs), mask=k_ok)


def _quant_block(k: int) -> int:
    """The quantize kernel's chunk: the whole row up to 16K elements (one pass, no re-read)."""
    return min(16384, triton.next_power_of_2(k))


def _quant_warps(block_k: int) -> int:
    """Warps of the quantize kernel: 32 elements a thread, 4 to 16 warps."""
    return max(4, min(16, block_k // 1024))


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_inputs(x, w, scale, bias, residual, granularity, prologue, out):
    """Validate; return (M, N, K, silu_mul)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if prologue not in (None, "silu_mul", "rms_norm"):
        raise ValueError(f"prologue must be None, 'silu_mul' or 'rms_norm', got {prologue!r}")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    silu_mul = prologue == "silu_mul"
    M, Kx = x.shape
    N, K = w.shape
    if Kx != (2 * K if silu_mul else K):
        raise ValueError(f"x has K={Kx} but w has K={K}" + (f" (silu_mul needs x [M, {2 * K}])" if silu_mul else ""))
    if M < 1 or N < 1 or K < 1:
        raise ValueError(f"empty linear: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    if w.dtype != FP8:
        raise ValueError(f"w must be {FP8}, got {w.dtype}")
    want = (N,) if granularity in ("channel", "tensor") else (triton.cdiv(N, 128), triton.cdiv(K, 128))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{granularity} scale must be float32 {list(want)}, got {scale.dtype} {list(scale.shape)}")
    for name, t in (("x", x), ("w", w), ("scale", scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} on {t.device} but x on {x.device}")
    for name, t, shape in (("bias", bias, (N,)), ("residual", residual, (M, N)), ("out", out, (M, N))):
        if t is not None:
            check_operand(name, t, shape, x.dtype, x.device)
    return M, N, K, silu_mul


def _check_norm(x, K, norm_weight):
    check_operand("the rms_norm prologue's norm_weight", norm_weight, (K,), x.dtype, x.device)


def _prequantize(x, M, K, silu_mul, block_k, norm_weight=None, eps=1e-6):
    """xq [M, K] e4m3 and xs [M] fp32 by ``_quant_rows_kernel`` (one program per row); with
    ``norm_weight``, of ``torch_ref.rms_norm(x, norm_weight, eps)``: in the same kernel when the
    row fits one pass (K <= 16K), else after the RMSNorm kernel."""
    if norm_weight is not None and block_k < K:
        from mxc.kernels import triton_norm

        x, norm_weight = triton_norm.rms_norm(x, norm_weight, eps), None
    xq = torch.empty((M, K), dtype=FP8, device=x.device)
    xs = torch.empty((M,), dtype=torch.float32, device=x.device)
    launch(_quant_rows_kernel, (M,), [x, xq, xs, norm_weight, float(eps)],
           dict(K=K, BLOCK_K=block_k, PROLOGUE_SILU_MUL=silu_mul, PROLOGUE_RMS_NORM=norm_weight is not None),
           num_warps=_quant_warps(block_k), num_stages=1)
    return xq, xs
