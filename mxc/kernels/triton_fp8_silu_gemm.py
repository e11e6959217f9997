"""The fp8 MLP's gate/up GEMM with SiLU-and-mul in its epilogue, and the quantize of its output (prefill).

The prefill's fp8 MLP otherwise runs the merged gate/up GEMM (bf16 [M, 2I] written), then one quantize kernel
that reads both halves, applies ``silu(gate) * up`` and writes the down projection's e4m3 input: at Llama-3-8B's
M = 2048 that is 117 MB written and read again, and ~35 instructions an element in a kernel that must hold a
whole row before its scale is known. Here:

- ``_silu_gemm_kernel``: each program multiplies one [BLOCK_M, K] row tile of xq by BLOCK_N gate rows of the
  merged weight and the BLOCK_N up rows I below them (two accumulators: the weight's layout is the checkpoint's),
  rounds both to x's dtype as the GEMM's output would be, and stores ``h = silu(gate) * up`` (``_silu_mul``: the
  SiLU kernel's numerics) -- half the bytes -- with the tile's row maxima of |h| into ``pmax`` [M, tiles of I]
  (no atomics, nothing to zero first).
- ``_quant_max_kernel``: ``xs = max(amax / 448, 1e-12)`` from the row's partial maxima (max is exact in any
  order) and ``xq = e4m3(h / xs)`` (``_quant_recip``), column blocks in parallel: no row held in registers. Bit for
  bit the quantize kernel's result on h (``triton_fp8_quant._prequantize``).

So the chain's values equal the unfused nodes' (gate/up GEMM, SiLU-and-mul, per-token quantize) up to the GEMM's
fp32 summation order. Weight scales per output row (``channel``; ``tensor`` is stored per row); block scales keep
the unfused kernels. Semantics: ``mxc.kernels.triton_fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, launch, next_pow2
from mxc.kernels.pdl import pdl_enter
from mxc.kernels.triton_elementwise import _silu_mul
from mxc.kernels.triton_fp8_quant import FP8, _quant_recip, _row_scale


@triton.jit
def _silu_gemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, pmax_ptr, M,
                      I: tl.constexpr, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] tile of h = silu(g) * u, g and u the [M, I] halves of
    (xq [M, K] @ w [2I, K]^T) * xs[:, None] * s[None, :] rounded to h's dtype; pmax[m, pid_n] = max |h| of the
    tile's row m. Grid: cdiv(M, BLOCK_M) * cdiv(I, BLOCK_N) programs in groups of GROUP_M row tiles."""
    pdl_enter(USE_PDL)
    ty: tl.constexpr = h_ptr.dtype.element_ty
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    GRID_N: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    group = pid // (GROUP_M * GRID_N)
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * GRID_N)) % group_m
    pid_n = (pid % (GROUP_M * GRID_N)) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)  # rows past M / I re-read valid rows: loads need no M/N mask
    rn = offs_n % I
    if 2 * I * K > 2**31 - 1:
        rn = rn.to(tl.int64)
    a_ptrs = xq_ptr + rm[:, None] * K + offs_k[None, :]
    g_ptrs = w_ptr + rn[:, None] * K + offs_k[None, :]
    u_ptrs = g_ptrs + I * K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            k_ok = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
        acc_g = tl.dot(a, tl.trans(bg), acc_g)
        acc_u = tl.dot(a, tl.trans(bu), acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    m_ok = offs_m < M
    n_ok = offs_n < I
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    sg = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    su = tl.load(s_ptr + I + offs_n, mask=n_ok, other=0.0)
    # rounded as the merged GEMM's output (``_finish``), then the SiLU kernel's arithmetic
    gate = (acc_g * xs[:, None] * sg[None, :]).to(ty).to(tl.float32)
    up = (acc_u * xs[:, None] * su[None, :]).to(ty).to(tl.float32)
    h = _silu_mul(gate, up, ty)
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], h, mask=mask)
    amax = tl.max(tl.where(mask, tl.abs(h.to(tl.float32)), 0.0), axis=1)
    tl.store(pmax_ptr + offs_m * GRID_N + pid_n, amax, mask=m_ok)


@triton.jit
def _quant_max_kernel(h_ptr, pmax_ptr, xq_ptr, xs_ptr, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row ``program_id(0)``'s columns [pid_k * BLOCK_K, + BLOCK_K) of xq = e4m3(h / xs), xs = max(amax / 448,
    1e-12) from the row's P partial maxima (``_silu_gemm_kernel``'s pmax); the first column block stores xs."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    # h's load first: issued before the maxima's reduction (its barrier), so the two loads overlap
    h = tl.load(h_ptr + row * K + offs_k, mask=k_ok, other=0.0)
    offs_p = tl.arange(0, BLOCK_P)
    amax = tl.max(tl.load(pmax_ptr + row * P + offs_p, mask=offs_p < P, other=0.0), axis=0)
    xs = _row_scale(amax)
    if pid_k == 0:
        tl.store(xs_ptr + row, xs)
    y = tl.div_rn(1.0, xs)
    nxs = tl.where(y == 0.0, 0.0, -xs)
    tl.store(xq_ptr + row * K + offs_k, _quant_recip(h.to(tl.float32), nxs, y), mask=k_ok)


@dataclass(frozen=True)
class SiluGemmConfig:
    """Tiles of ``_silu_gemm_kernel`` (BLOCK_N of each half: the merged weight's 2 * BLOCK_N rows a program) and
    the quantize's column block."""
    BLOCK_M: int = 128
    BLOCK_N: int = 64
    BLOCK_K: int = 128
    GROUP_M: int = 16
    num_warps: int = 8
    num_stages: int = 3
    QUANT_BLOCK_K: int = 2048
    QUANT_WARPS: int = 4


def config_for(i: int, k: int) -> SiluGemmConfig:
    """The default tiles (one binary for every M)."""
    return SiluGemmConfig()


def _check(xq, xs, w, scale, cfg: SiluGemmConfig) -> tuple[int, int, int]:
    if xq.dim() != 2 or w.dim() != 2 or w.shape[0] % 2 or w.shape[1] != xq.shape[1]:
        raise ValueError(f"silu_gemm: expected xq [M, K] and the merged gate/up weight [2I, K], got "
                         f"{tuple(xq.shape)} and {tuple(w.shape)}")
    (M, K), I = xq.shape, w.shape[0] // 2
    if xq.dtype != FP8 or w.dtype != FP8:
        raise ValueError(f"silu_gemm: xq and w must be {FP8}, got {xq.dtype} and {w.dtype}")
    for name, t, shape in (("xs", xs, (M,)), ("scale", scale, (2 * I,))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"silu_gemm: {name} must be float32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    for name, t in (("xq", xq), ("xs", xs), ("w", w), ("scale", scale)):
        if not t.is_contiguous() or t.device != xq.device:
            raise ValueError(f"silu_gemm: {name} must be contiguous and on {xq.device}")
    if M < 1 or I < 1 or K < 1:
        raise ValueError(f"silu_gemm: empty operands xq {tuple(xq.shape)}, w {tuple(w.shape)}")
    blocks = (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.QUANT_BLOCK_K)
    if not all(v > 0 and v & (v - 1) == 0 for v in blocks) or min(cfg.BLOCK_M, cfg.BLOCK_N) < 16 or cfg.BLOCK_K < 32:
        raise ValueError(f"silu_gemm: block sizes must be powers of two, BLOCK_M/N >= 16, BLOCK_K >= 32: {cfg}")
    return M, I, K


def silu_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype = torch.bfloat16, config: SiluGemmConfig | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [M, I] of ``dtype``, pmax [M, cdiv(I, BLOCK_N)] fp32): h = silu_mul of the merged gate/up linear of the
    quantized activations (xq e4m3 [M, K], xs [M]) with weight w e4m3 [2I, K] and row scales ``scale`` [2I]."""
    cfg = config or config_for(w.shape[0] // 2, w.shape[1])
    M, I, K = _check(xq, xs, w, scale, cfg)
    h = torch.empty((M, I), dtype=dtype, device=xq.device)
    pmax = torch.empty((M, cdiv(I, cfg.BLOCK_N)), dtype=torch.float32, device=xq.device)
    launch(_silu_gemm_kernel, (cdiv(M, cfg.BLOCK_M) * cdiv(I, cfg.BLOCK_N),), [xq, xs, w, scale, h, pmax, M],
           dict(I=I, K=K, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return h, pmax


def quantize_max(h: torch.Tensor, pmax: torch.Tensor, block_k: int = 2048, num_warps: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq e4m3 [M, K], xs fp32 [M]) of h [M, K] per token, the row maxima of |h| given as pmax's partials."""
    M, K = h.shape
    P = pmax.shape[1]
    xq = torch.empty((M, K), dtype=FP8, device=h.device)
    xs = torch.empty((M,), dtype=torch.float32, device=h.device)
    block_k = min(block_k, next_pow2(K))
    launch(_quant_max_kernel, (M, cdiv(K, block_k)), [h, pmax, xq, xs],
           dict(K=K, P=P, BLOCK_P=next_pow2(P), BLOCK_K=block_k), num_warps=num_warps, num_stages=1)
    return xq, xs


def silu_mul_quantized(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16, config: SiluGemmConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The down projection's per-token e4m3 input (hq [M, I], hs [M]) from the gate/up linear's: ``silu_gemm``,
    then ``quantize_max``."""
    cfg = config or config_for(w.shape[0] // 2, w.shape[1])
    h, pmax = silu_gemm(xq, xs, w, scale, dtype, cfg)
    return quantize_max(h, pmax, cfg.QUANT_BLOCK_K, cfg.QUANT_WARPS)
