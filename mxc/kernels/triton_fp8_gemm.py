"""The fp8-weight GEMM (``qlinear_gemm``, any M: prefill): quantize x per token, then tl.dot on e4m3.

Default tiles 128 x 128 x 128 (wgmma on sm_90), a pure function of (N, K, dtype, granularity) so
one binary serves every M. Semantics: ``mxc.kernels.triton_fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, launch
from mxc.kernels.pdl import pdl_enter
from mxc.kernels.triton_fp8_quant import (_DTYPES, GRANULARITIES, _check_inputs, _check_norm, _dot_e4m3, _finish,
                                          _pow2, _prequantize, _quant_block, promote_acc)


@triton.jit
def _qgemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, M,
                  N: tl.constexpr, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, BLOCK_SCALE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  USE_PDL: tl.constexpr = False, PROMOTE_ACC: tl.constexpr = 0):
    """One [BLOCK_M, BLOCK_N] tile of y = (xq [M, K] @ w [N, K]^T) * xs[:, None] * scale, both
    operands e4m3, fp32 accumulation; grid: cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs in
    groups of GROUP_M row tiles (consecutive programs share w tiles in L2). The dots' sums go to fp32 every
    PROMOTE_ACC columns of K (0: never, the tensor cores' accumulator; ``_dot_e4m3``)."""
    pdl_enter(USE_PDL)
    tl.static_assert(not BLOCK_SCALE or (128 % BLOCK_K == 0 and 128 % BLOCK_N == 0))
    KB: tl.constexpr = (K + 127) // 128
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    GRID_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
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
    rm = (offs_m % M).to(tl.int64)  # rows past M / N re-read valid rows: loads need no M/N mask
    rn = offs_n % N
    if N * K > 2**31 - 1:
        rn = rn.to(tl.int64)
    a_ptrs = xq_ptr + rm[:, None] * K + offs_k[None, :]
    b_ptrs = w_ptr + rn[:, None] * K + offs_k[None, :]
    if BLOCK_SCALE:
        s_row = s_ptr + (pid_n * BLOCK_N // 128) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        if BLOCK_SCALE:
            acc += _dot_e4m3(a, tl.trans(b), None, PROMOTE_ACC) * tl.load(s_row + k // 128)
        else:
            acc = _dot_e4m3(a, tl.trans(b), acc, PROMOTE_ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    m_ok = offs_m < M
    n_ok = offs_n < N
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    if BLOCK_SCALE:
        acc = acc * xs[:, None]
    else:
        ws = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    _finish(acc, y_ptr, b_ptr, r_ptr, offs, offs_n, n_ok, m_ok[:, None] & n_ok[None, :], HAS_BIAS, HAS_RESIDUAL)


@dataclass(frozen=True)
class QGemmConfig:
    """``qlinear_gemm`` tiles; with block128 scales BLOCK_K and BLOCK_N divide 128."""
    BLOCK_M: int = 128
    BLOCK_N: int = 128
    BLOCK_K: int = 128
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    QUANT_BLOCK_K: int = 1024


def gemm_config_for(n: int, k: int, dtype: torch.dtype, granularity: str) -> QGemmConfig:
    """Default ``qlinear_gemm`` config (independent of M: one binary for every M). Not measured:
    the usual Hopper fp8 tile, 128 x 128 x 128, 8 warps (two warpgroups for wgmma), 3 stages
    (3 x 32 KB of operands in shared memory)."""
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return QGemmConfig(QUANT_BLOCK_K=_quant_block(k))


def _check_gemm_config(cfg: QGemmConfig, block: bool) -> None:
    if not all(_pow2(v) for v in (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.QUANT_BLOCK_K)) or cfg.GROUP_M < 1:
        raise ValueError(f"block sizes must be powers of two and GROUP_M >= 1: {cfg}")
    if cfg.BLOCK_M < 16 or cfg.BLOCK_N < 16 or cfg.BLOCK_K < 32:
        raise ValueError(f"fp8 tl.dot needs BLOCK_M, BLOCK_N >= 16 and BLOCK_K >= 32: {cfg}")
    if block and (cfg.BLOCK_N > 128 or cfg.BLOCK_K > 128):
        raise ValueError(f"block128 scales need BLOCK_N and BLOCK_K dividing 128: {cfg}")


def qlinear_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, *, granularity: str = "channel",
                 prologue: str | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, config: QGemmConfig | None = None,
                 out: torch.Tensor | None = None, interleave: int = 0) -> torch.Tensor:
    """``fp8_ref.qlinear(...)`` for any M (meant for M > 32): quantize x per token
    (``_quant_rows_kernel``, prologue folded in), then the fp8 GEMM ``_qgemm_kernel``.
    Arguments as ``qlinear_small_m``; ``config`` overrides ``gemm_config_for``; ``interleave`` B (SiLU-and-mul
    prologue only): x's gate and up columns in blocks of B (``triton_elementwise.check_interleave``). The binaries
    depend on (N, K, dtypes, granularity, fusions), not on M; the grid on M too (row offsets
    are 64-bit, so M is not limited by int32 offsets)."""
    M, N, K, silu_mul = _check_inputs(x, w, scale, bias, residual, granularity, prologue, out)
    block = granularity == "block128"
    cfg = config if config is not None else gemm_config_for(N, K, x.dtype, granularity)
    _check_gemm_config(cfg, block)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    rms = prologue == "rms_norm"
    if rms:
        _check_norm(x, K, norm_weight)
    xq, xs = _prequantize(x, M, K, silu_mul, cfg.QUANT_BLOCK_K, norm_weight if rms else None, eps,
                          interleave=interleave)
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N),)
    launch(_qgemm_kernel, grid, [xq, xs, w, scale, bias, residual, y, M],
           dict(N=N, K=K, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                BLOCK_SCALE=block, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                **promote_acc(cfg.BLOCK_K)),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
