"""The fp8-weight GEMV (``qlinear_small_m``, M <= 32: decode) and its configs (``gemv_tuning.tune_fp8`` times them).

Bandwidth-bound like ``triton_gemv``, whose layout it keeps; versions v1 (FMA, one row), v2 (FMA,
a few rows), v3 (tensor cores; ``SWAP_AB`` puts the weights on the wgmma side). The module doc of
``mxc.kernels.triton_fp8`` describes them and the numerics.

Measured and removed (H200, Triton 3.6, 2026-11-30, ``bench/linear_lab.py``): v1 issuing the next step's
weight load before its own math (two steps' bytes in flight a thread) was slower at every Llama-3-8B
shape at one row: qkv 20.0 against 13.6 us, o 15.0 against 9.6, gate/up 76.4 against 40.5, down 28.2
against 22.0; and weights widened by integer ops instead of cvt, 3-7% slower. A weight-only mode for every
GEMV (x kept in bf16, no quantize kernel; the weights widened to bf16, as v1 FMA or as the A operand of a
bf16 wgmma under SWAP_AB): Llama-3-8B fp8 batch-1 decode 3.97 against 2.75 ms (``bench/decode_ab.py``,
2026-12-01; its GEMVs 3389 against 2127 us a step), since the e4m3 wgmma needs both operands in e4m3 and
widening the weights in registers costs more than the quantize kernels it saves (329 us a step). Kept:
weight-only where the GEMV is v1 anyway (``WEIGHT_ONLY_M1``: the FMAs are the same, the quantize goes).
SWAP_AB (e4m3 wgmma) for o and down at one row too (64-row tiles, K split 4), with the splits summed by
the reduce kernel or inside the GEMV by each column block's last program (an atomic count; no second launch): 2.745 and
2.738 ms a step against 2.755 (``bench/decode_ab.py``, 2026-12-01), within the rounds' spread; in the
step these two GEMVs already cost about their bytes (``bench/ablate.py``: down 15.3 us a layer for 14.0
us of bytes at the copy rate; o 6.6 for 4.0). The gate/up and down GEMVs at one token linked by counters
instead of a kernel boundary (2026-12-01): each gate/up program counted its SiLU columns into a per-chunk
counter (bar.sync, then a gpu-scope release by one thread); the down GEMV, launched under PDL while the
gate/up's last programs ran, awaited each 1024-column chunk of x a step ahead (one thread polling with an
acquire, nanosleep between polls) and passed the PDL wait only before its epilogue. Bit for bit the
unlinked values in a replayed PDL graph, but slower: 2.673 against 2.614 ms a step (the counting alone
2.638); every thread polling the counters' line took 2.954. The down GEMV's ramp overlapping the gate/up's
tail gained nothing measurable. Removed. The RMSNorm-quantize in the prologue of the one-token tensor-core
GEMVs (qkv, gate/up; 2026-12-02): each program normalised and quantized the row itself (the quantize kernel's
code and warps), stored xq and xs (every program the same bytes), then ran as PREQUANT, so no quantize kernel
ran: 3.098 against 2.507 ms a step. The prologue sits between the PDL wait and the weight pipeline in every
program, and the gate/up GEMV's 448 programs run in two waves (80 KB of shared memory, two an SM): it added
42.6 us a layer instead of 29.8 plus the 2.3 of the kernel it replaced (``--timeline``). Removed. The qkv and
gate/up GEMVs at one token as v2 weight-only FMA loops, the down GEMV's [8, 2048] steps (768 and 3584 programs
instead of 96 and 448, x unquantized, a plain RMSNorm ahead; 2026-12-02, ``bench/decode_ab.py`` through
``OVERRIDES``, one artifact): qkv 2.575, gate/up 2.659, both 2.725 against 2.507 ms. Not kept. A CUDA GEMV on
mma.sync m16n8k32 e4m3 fed straight from global memory into the MMA's A registers (each thread 16 contiguous
bytes of a row, the K order permuted alike in x; no shared memory; its first loads before the PDL wait; KS warps
splitting K), as the qkv and gate/up (SiLU epilogue) GEMVs at one token (2026-12-02, a lab in commit 5152cce,
32 Llama-3-8B layers' linears in a PDL graph): 68.0 against 66.7 us a layer; gate/up alone 34.1 against 31.5
(89% of its bytes at the copy rate); L2 256-byte line hints 32.7, the weights in a tile-major layout (each
warp load 512 contiguous bytes) 32.3, the CTA's warps on interleaved chunks 34.7. Removed. The e4m3 wgmma
GEMV with each [BLOCK_N, BLOCK_K] weight tile a TMA copy (a host tensor descriptor, ``tl.range`` stages
pipelined by Triton; 2026-12-03, a lab in commit 0e1d957, each Llama-3-8B linear alone in a graph of
back-to-back calls over weight copies 4x the L2): at one token the best of 8-16 configs a shape took qkv 10.5
against the shipped 9.6 us, o 8.6 against 6.8 (v1 weight-only, preloaded), gate/up 32.5 against 32.6, down
21.6 against 16.9 (v1 weight-only); at eight tokens o 8.7 against 9.8, gate/up 33.1 against 33.5, down 22.0
against 23.0. Removed: no one-token GEMV got faster, and the TMA loads feed the same wgmma the pointer loads do.
Weights stored tile-major (each program's [BLOCK_N, BLOCK_K] tiles one after another, so a stage reads one
contiguous 16 KB piece instead of 64 rows' 256 B; 2026-12-04, ``bench/tile_layout_lab.py``, the SWAP_AB loop alone,
back-to-back calls over copies 4x the L2): at the shipped [64, 256 B] x 4 tiles gate/up 30.34 against 30.58 us
(shipped kernel 30.56), qkv (x 5) 8.38 against 8.43; the most any config gained was 1 us (gate/up [128, 128 B]
29.79 against 30.79; down [64, 128 B] x 8 18.16 against 19.89, still above the shipped v2's ~17). Not built: a
layout for the loader and the manifest for well under 1 us a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mxc.kernels import triton_elementwise, triton_norm
from mxc.kernels.launch import cdiv, launch, next_pow2
from mxc.kernels.triton_elementwise import _gate_col, _silu_mul
from mxc.kernels.pdl import pdl_enter, prefetch_bytes, prefetch_rows_l2, reads_before_wait
from mxc.kernels.triton_fp8_quant import (_DTYPES, GRANULARITIES, _check_inputs, _check_norm, _dot_e4m3, _finish,
                                          _load_act, _pow2, _prequantize, _quant, _quant_block, _row_scale, promote_acc)
from mxc.kernels.triton_gemv import M_BUCKETS, NUM_SMS, bucket, fill_gpu, split_k_for


@reads_before_wait("w_ptr")  # PRELOAD: the program's weight tile
@triton.jit
def _qgemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, M,
                  N: tl.constexpr, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_SCALE: tl.constexpr,
                  PREQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  PROLOGUE_SILU_MUL: tl.constexpr,
                  USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                  WEIGHT_ONLY: tl.constexpr = False, EPILOGUE_SILU_MUL: tl.constexpr = False,
                  REDUCE_STEPS: tl.constexpr = False, PRELOAD: tl.constexpr = False, PAIR_BLOCK: tl.constexpr = 0,
                  PROMOTE_ACC: tl.constexpr = 0):
    """One program: columns [pid_n * BLOCK_N, +BLOCK_N) of y over K slice pid_k.

    x_ptr: x [M, K] (or [M, 2K] under PROLOGUE_SILU_MUL) in its float dtype, with xs_ptr None;
    with PREQUANT, xq [M, K] e4m3 and xs_ptr its scales [M] (from ``_quant_rows_kernel``); with
    WEIGHT_ONLY (FMA versions), x [M, K] in its float dtype taken as it is (no activation quantization).
    s_ptr: the weight scales, [N] or (BLOCK_SCALE) [ceil(N/128), ceil(K/128)].
    With SPLIT_K == 1, y_ptr is y [M, N]; otherwise the fp32 scratch [SPLIT_K, M, N] of scaled
    partial sums, and HAS_BIAS and HAS_RESIDUAL are False. EPILOGUE_SILU_MUL (SPLIT_K == 1, no bias,
    residual or block scales): the weight is [gate; up] ([N/2, K] each) and y [M, N/2] is
    silu(gate) * up; the program's rows are gate rows [pid_n * BLOCK_N/2, +BLOCK_N/2) and the up rows
    N/2 below them; with PAIR_BLOCK B the weight's rows come in blocks of B gate then B up rows, each gate
    row's up row B below it (``triton_elementwise.check_interleave``). REDUCE_STEPS (one row): v2's loop,
    each step's products summed to BLOCK_N values, instead of v1's [BLOCK_N, BLOCK_K] accumulator. Built
    for PDL (USE_PDL), it first asks L2 for PREFETCH bytes (0: none) of each of its weight rows. The e4m3
    dots' sums go to fp32 every PROMOTE_ACC columns of K (0: never, the tensor cores' accumulator; ``_dot_e4m3``)."""
    tl.static_assert(SPLIT_K == 1 or not (HAS_BIAS or HAS_RESIDUAL))
    tl.static_assert(not PREQUANT or not PROLOGUE_SILU_MUL)
    tl.static_assert(not SWAP_AB or (USE_DOT and PREQUANT))
    tl.static_assert(not WEIGHT_ONLY or not (USE_DOT or PREQUANT or PROLOGUE_SILU_MUL))
    tl.static_assert(not EPILOGUE_SILU_MUL or (SPLIT_K == 1 and not (HAS_BIAS or HAS_RESIDUAL or BLOCK_SCALE)))
    tl.static_assert(not PAIR_BLOCK or EPILOGUE_SILU_MUL)
    LOAD_X: tl.constexpr = PREQUANT or WEIGHT_ONLY  # x's values are the factors as loaded
    tl.static_assert(not BLOCK_SCALE or 128 % BLOCK_N == 0)
    tl.static_assert(not (BLOCK_SCALE and USE_DOT) or 128 % BLOCK_K == 0)
    X_STRIDE: tl.constexpr = 2 * K if PROLOGUE_SILU_MUL else K
    KB: tl.constexpr = (K + 127) // 128  # scale columns (block128)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K_PER_SPLIT: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    EVEN_K: tl.constexpr = K % (SPLIT_K * BLOCK_K) == 0
    k_start = pid_k * K_PER_SPLIT

    if EPILOGUE_SILU_MUL:  # BLOCK_N / 2 gate rows, then their up rows (N / 2 below them, or PAIR_BLOCK)
        HALF: tl.constexpr = BLOCK_N // 2
        offs_j = tl.arange(0, BLOCK_N)
        if PAIR_BLOCK:
            offs_n = _gate_col(pid_n * HALF + offs_j % HALF, PAIR_BLOCK) + (offs_j // HALF) * PAIR_BLOCK
        else:
            offs_n = pid_n * HALF + offs_j % HALF + (offs_j // HALF) * (N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rn = offs_n % N  # rows past N re-read row n % N: weight loads need no N mask
    if PRELOAD:  # one row, one K slice: the program's whole [BLOCK_N, K] tile in registers before the wait
        tl.static_assert(BLOCK_M == 1 and SPLIT_K == 1 and LOAD_X and not BLOCK_SCALE and not EPILOGUE_SILU_MUL)
        offs_kk = tl.arange(0, K)
        w_all = tl.load(w_ptr + rn[:, None] * K + offs_kk[None, :])
    elif USE_PDL and PREFETCH > 0:  # weights stream into L2 while the kernel ahead finishes; then wait for its output
        prefetch_rows_l2(w_ptr, rn, k_start, K, PREFETCH)
    pdl_enter(USE_PDL)
    if N * K > 2**31 - 1:
        rn = rn.to(tl.int64)
    w_ptrs = w_ptr + rn[:, None] * K + (k_start + offs_k)[None, :]
    row_ok = offs_m < M
    if BLOCK_SCALE:
        s_row = s_ptr + (pid_n * BLOCK_N // 128) * KB  # the program's rows share one 128-row block

    # per-token activation scales xs [BLOCK_M] (padding rows: 0 if prequantized, else 1e-12)
    if PREQUANT:
        xs = tl.load(xs_ptr + offs_m, mask=row_ok, other=0.0)
    elif WEIGHT_ONLY:
        xs = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        a_ptrs = x_ptr + offs_m[:, None] * X_STRIDE + offs_k[None, :]
        for k in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                a = _load_act(a_ptrs + k, row_ok[:, None], 0.0, K, PROLOGUE_SILU_MUL)
            else:
                a = _load_act(a_ptrs + k, row_ok[:, None] & ((k + offs_k) < K)[None, :], 0.0, K,
                              PROLOGUE_SILU_MUL)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        xs = _row_scale(amax)

    if USE_DOT:
        # v3: acc[BLOCK_M, BLOCK_N] = xq @ w^T on tensor cores, both operands e4m3
        # (SWAP_AB: acc^T[BLOCK_N, BLOCK_M] = w @ xq^T, so the weights are the 64+-row operand and
        # sm_90 runs a native e4m3 wgmma, no widening of the weights; the tokens are the 16-wide side)
        x_ptrs = x_ptr + offs_m[:, None] * X_STRIDE + (k_start + offs_k)[None, :]
        if SWAP_AB:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x_mask = row_ok[:, None]
            else:
                k_ok = (k_start + k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x_mask = row_ok[:, None] & k_ok[None, :]
            if PREQUANT:
                xq = tl.load(x_ptrs, mask=x_mask, other=0.0)
            else:
                xq = _quant(_load_act(x_ptrs, x_mask, 0.0, K, PROLOGUE_SILU_MUL), xs[:, None])
            if BLOCK_SCALE:
                kb = (k_start + k) // 128
                if EVEN_K:
                    sk = tl.load(s_row + kb)
                else:  # the last slices of a split may start past K
                    sk = tl.load(s_row + kb, mask=kb < KB, other=0.0)
                if SWAP_AB:
                    acc_t += _dot_e4m3(w, tl.trans(xq), None, PROMOTE_ACC) * sk
                else:
                    acc += _dot_e4m3(xq, tl.trans(w), None, PROMOTE_ACC) * sk
            elif SWAP_AB:
                acc_t = _dot_e4m3(w, tl.trans(xq), acc_t, PROMOTE_ACC)
            else:
                acc = _dot_e4m3(xq, tl.trans(w), acc, PROMOTE_ACC)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc_t)
    elif PRELOAD:
        xk = tl.load(x_ptr + offs_kk).to(tl.float32)
        acc = tl.sum(w_all.to(tl.float32) * xk[None, :], axis=1)[None, :]  # [1, BLOCK_N]
    elif BLOCK_M == 1 and not REDUCE_STEPS:
        # v1: per-thread partial products, one reduction at the end
        x_ptrs = x_ptr + k_start + offs_k
        xs0 = tl.max(xs, axis=0)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            k_ok = (k_start + k + offs_k) < K
            if EVEN_K:
                w = tl.load(w_ptrs).to(tl.float32)
                if LOAD_X:
                    xq = tl.load(x_ptrs).to(tl.float32)
                else:
                    xq = _quant(_load_act(x_ptrs, None, None, K, PROLOGUE_SILU_MUL), xs0).to(tl.float32)
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
                if LOAD_X:
                    xq = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                else:
                    xq = _quant(_load_act(x_ptrs, k_ok, 0.0, K, PROLOGUE_SILU_MUL), xs0).to(tl.float32)
            if BLOCK_SCALE:  # each element times its K block's scale (a gather from one scale row)
                xq *= tl.load(s_row + (k_start + k + offs_k) // 128, mask=k_ok, other=0.0)
            acc2 += w * xq[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        # v2: w loaded once per step, one reduced dot product per row of x
        x_ptrs = x_ptr + k_start + offs_k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            k_ok = (k_start + k + offs_k) < K
            if EVEN_K:
                w = tl.load(w_ptrs).to(tl.float32)
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
            if BLOCK_SCALE:
                sk = tl.load(s_row + (k_start + k + offs_k) // 128, mask=k_ok, other=0.0)
            for m in tl.static_range(BLOCK_M):
                # rows past M re-read row M - 1 (no mask); their sums are never stored
                xm_ptrs = x_ptrs + tl.minimum(M - 1, m) * X_STRIDE
                if LOAD_X:
                    if EVEN_K:
                        xq = tl.load(xm_ptrs).to(tl.float32)
                    else:
                        xq = tl.load(xm_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                else:
                    xs_m = tl.sum(tl.where(offs_m == m, xs, 0.0), axis=0)
                    if EVEN_K:
                        a = _load_act(xm_ptrs, None, None, K, PROLOGUE_SILU_MUL)
                    else:
                        a = _load_act(xm_ptrs, k_ok, 0.0, K, PROLOGUE_SILU_MUL)
                    xq = _quant(a, xs_m).to(tl.float32)
                if BLOCK_SCALE:
                    xq = xq * sk
                part = tl.sum(w * xq[None, :], axis=1)  # [BLOCK_N]
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

    # scales, then the epilogue on acc [BLOCK_M, BLOCK_N]; y is [M, N] row-major
    n_ok = offs_n < N
    if BLOCK_SCALE:
        acc = acc * xs[:, None]
    else:
        ws = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    if EPILOGUE_SILU_MUL:
        _store_silu_mul(acc, y_ptr, pid_n, offs_m, row_ok, N // 2, BLOCK_M, BLOCK_N // 2)
    elif SPLIT_K == 1:
        _finish(acc, y_ptr, b_ptr, r_ptr, offs, offs_n, n_ok, mask, HAS_BIAS, HAS_RESIDUAL)
    else:
        tl.store(y_ptr + pid_k * M * N + offs, acc, mask=mask)


@triton.jit
def _store_silu_mul(acc, y_ptr, pid_n, offs_m, row_ok, I: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """y[:, cols] = silu(gate) * up of acc [BLOCK_M, 2 * HALF] = [gate | up] of columns cols (of I): each half
    rounded to y's dtype first, as the unfused GEMV's output, then ``_silu_mul`` (the SiLU kernel's numerics)."""
    ty: tl.constexpr = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    act = _silu_mul(gate.to(ty).to(tl.float32), up.to(ty).to(tl.float32), ty)
    cols = pid_n * HALF + tl.arange(0, HALF)
    tl.store(y_ptr + offs_m[:, None] * I + cols[None, :], act, mask=row_ok[:, None] & (cols < I)[None, :])


@triton.jit
def _qgemv_reduce_kernel(ws_ptr, b_ptr, r_ptr, y_ptr, M,
                         N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """y[:, cols] = sum over s (in order) of ws[s, :, cols], then ``_finish`` (round, bias, residual)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    n_ok = offs_n < N
    mask = (offs_m[:, None] < M) & n_ok[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    _finish(acc, y_ptr, b_ptr, r_ptr, offs, offs_n, n_ok, mask, HAS_BIAS, HAS_RESIDUAL)


# Bytes of each weight row (from the program's first column) a GEMV built for PDL asks L2 for before it
# waits for the kernel ahead (``pdl.prefetch_rows_l2``; ``pdl.prefetch_bytes`` caps it at the row).
# Llama-3-8B fp8 batch-1 decode on one H200 (Triton 3.6, 2026-11-30, ``bench/decode_ab.py``, medians of
# three interleaved rounds): none 2.798 ms, 512 B 2.770, 1 KB 2.793, 2 KB (the former default) 2.854,
# 4 KB 3.157, 8 KB 3.170 (the none/512/1K spread is within the rounds' noise). Only the qkv GEMV's rows at
# 2 KB (6144 x 4096: 12 MB asked during the RMSNorm-quantize ahead of it; 2026-12-02): 2.536 against 2.518.
# Nor is L2 residency what limits it (2026-12-02, same bench): every weight load evict_first (the weights are
# read once) and the prefetches evict_last, 2.524 against 2.522 ms at 512 B; at 1 KB / 2 KB 2.598 / 2.707
# (1 KB without the hints: 2.550). The prefetched rows are not lost to eviction: the next GEMV's prefetches
# slow the current GEMV's last loads.
PREFETCH_BYTES = 512


@dataclass(frozen=True)
class QGemvConfig:
    """``qlinear_small_m`` tiles. BLOCK_N <= 128 (a power of two); with block128 scales and
    USE_DOT, BLOCK_K divides 128. PREQUANT: quantize x in a first kernel (see the module doc).
    WEIGHT_ONLY (FMA, instead of PREQUANT): multiply x's own values, unquantized.
    SWAP_AB (v3 with PREQUANT, BLOCK_N >= 64): the product as w @ x^T, weights on the wgmma side."""
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    USE_DOT: bool = False
    PREQUANT: bool = False
    num_warps: int = 4
    num_stages: int = 1
    QUANT_BLOCK_K: int = 1024  # the prequantize kernel's chunk
    SWAP_AB: bool = False
    WEIGHT_ONLY: bool = False  # FMA versions: x as it is, no activation quantization (nor its kernel)
    REDUCE_STEPS: bool = False  # one row, FMA: v2's loop (each step summed to BLOCK_N values), not v1's
    PRELOAD: bool = False  # one row, weight-only, K a power of two: the whole tile loaded before the PDL wait


# Shapes where ``gemv_tuning.tune_fp8`` found a config >= 3% faster than the rules below (bf16 activations, channel
# scales, Triton 3.6, ``bench/linear_lab.py --tune-fp8``): the place a tuning cache's entries will plug in. Llama-3-8B's
# one-token down entry gave way to ``REDUCE_STEPS_MIN_K``'s rule, measured in the whole step.
MEASURED = {
    # Qwen3-30B-A3B's o GEMV at 8 rows (``tune_fp8`` on one H100, 2026-12-06): 8.43 against 8.97 us in one slice of
    # 512-byte steps. Its qkv at 8 (7.94 against 9.73) and Llama-3-8B's one-token qkv (12.4 -> 11.0 us; split in two in
    # the step, 2.558 against 2.508 ms) ran best in one slice at 5 stages: ``SWAP_AB_ONE_SLICE``'s rule, their entries
    # gone with it (docs/perf.md, sixty-ninth and seventieth runs).
    (8, 2048, 4096, torch.bfloat16, "channel"): QGemvConfig(64, 512, 1, True, True, 4, 4, 4096, SWAP_AB=True),
}


# One-row FMA configs (v1: the o and down projections of Llama-3-8B) multiply x unquantized: the
# GEMV does the same FMAs on bf16 x as on e4m3 xq, and the quantize kernel ahead of it goes (more
# accurate too: only the weights are rounded). Llama-3-8B fp8 batch-1 decode on one H200 (Triton 3.6,
# 2026-12-01, ``bench/decode_ab.py``, medians of three interleaved rounds): 2.670 against 2.753 ms;
# with the SiLU in the gate/up epilogue and the attention's cache prefetch too, 2.604 against 2.735.
WEIGHT_ONLY_M1 = True

# Rows of at least this many elements, in a one-row weight-only GEMV, run [8 rows, 2048] steps under
# REDUCE_STEPS (0: never): 63 registers a thread against v1's 76 at [8, 1024], so four 8-warp programs fit
# an SM and Llama-3-8B's down GEMV (512 programs) runs in one wave, with twice the bytes in flight a
# step. Llama-3-8B fp8 batch-1 decode on one H200 (Triton 3.6, 2026-12-01, ``bench/decode_ab.py``,
# medians of three interleaved rounds, three calls): 2.553, 2.560 and 2.634 against 2.600, 2.606 and
# 2.680 ms; [8, 4096], [16, 2048], [4, 2048], [8, 1024] and 4 warps were slower, and no tile moved the o GEMV
# (K = 4096) past the rounds' spread (docs/perf.md, 2026-12-01).
# Measured with channel scales; block128 takes the same tiles (8 rows divide a 128-row block). The down GEMV's loop
# unrolled (by 7, by 2): slower, removed (``docs/persistent_decode.md``'s index of batch-1 ideas).
REDUCE_STEPS_MIN_K = 8192

# One-row weight-only GEMVs whose weights take at most PRELOAD_MAX_BYTES, with rows of a power of two elements,
# load each program's whole [BLOCK_N, K] tile (PRELOAD_TILE_BYTES, held in registers: 128 B a thread at 8 warps)
# before their PDL wait, instead of asking L2 for the start of each row: the weights stream while the kernels
# ahead run, and after the wait only x is read. 16 MiB is half the H200's register file: with 32 KB tiles four
# 8-warp programs (61 registers a thread at [8, 4096]) fit an SM, so every program is resident at once. The
# decode attention's merge kernel then lets the GEMV after it launch before it waits (the compiler's
# ``early_launch_o_proj``), so these loads overlap the attention itself. Llama-3-8B fp8 batch 1 on one H200
# (o: 4096 x 4096, [8, 4096] tiles; Triton 3.6, 2026-12-01, ``bench/decode_ab.py``, medians of three
# interleaved rounds): 2.519-2.523 ms against 2.566-2.569 in three calls; the preload alone 2.534, the early
# launch alone 2.579; a [32, 4096] tile at 16 warps (105 registers: one program an SM beside the attention's)
# 2.545. Not measured: a preloading GEMV right after another GEMV (a small model's down projection), whose loads
# then compete with that GEMV's. Measured and removed (``docs/persistent_decode.md``'s index of batch-1 ideas): the
# same mode for the bf16 GEMV (Qwen3-30B-A3B's o: the attention's split kernel slower under the loads), the preload
# delayed so that the attention loads first, and the o GEMV past its wait asking L2 for the gate/up weight's rows.
# 0 turns it off.
PRELOAD_MAX_BYTES = 16 << 20
PRELOAD_TILE_BYTES = 32 << 10


def _preload_config(cfg: QGemvConfig, n: int, k: int) -> QGemvConfig:
    """``cfg`` (a one-row weight-only config) made PRELOAD where the rule above applies (rows of at most a
    quarter tile; fewer rows a tile where the tiles would not fill the GPU, as ``fill_gpu``), else ``cfg``."""
    if not (PRELOAD_MAX_BYTES and n * k <= PRELOAD_MAX_BYTES and k & (k - 1) == 0 and 4 * k <= PRELOAD_TILE_BYTES):
        return cfg
    block_n = min(PRELOAD_TILE_BYTES // k, next_pow2(n))
    while cdiv(n, block_n) < NUM_SMS and block_n > 1:
        block_n //= 2
    return replace(cfg, BLOCK_N=block_n, BLOCK_K=k, SPLIT_K=1, num_warps=8, PRELOAD=True)


# True: the wgmma (SWAP_AB) GEMVs the rule splits over K run in one K slice at 5 stages instead (read by
# ``config_for``; unsplit ones keep 4 stages, as 5 was slower for Llama-3-8B's gate/up in the step). fp8 steps on one
# H100 (2026-12-06, ``bench/decode_ab.py``, one artifact, medians of three interleaved rounds; docs/perf.md, seventieth
# run): Qwen3-30B-A3B batch 1 2.163 against 2.221 ms, 8 6.175 against 6.208, 32 10.420 against 10.722; Llama-3-8B
# batch 8 3.576 against 3.672, 32 4.221 against 4.465 (its batch 1 unchanged: the qkv was already one slice).
SWAP_AB_ONE_SLICE = True

# Field overrides of the default configs by (bucket, N, K), applied after the rules: what
# ``bench/decode_ab.py`` variants set to time other tiles in the whole step.
OVERRIDES: dict[tuple[int, int, int], dict] = {}


def config_for(m_bucket: int, n: int, k: int, dtype: torch.dtype, granularity: str,
               epilogue: bool = False) -> QGemvConfig:
    """Default ``qlinear_small_m`` config; a pure function of its arguments (for the AOT build): the
    rules of ``_base_config``, with one-row FMA configs made ``WEIGHT_ONLY`` under ``WEIGHT_ONLY_M1`` (and
    long rows' tiles ``REDUCE_STEPS``, small matrices' ``PRELOAD`` (``PRELOAD_MAX_BYTES``; channel or tensor
    scales; not for a GEMV with the SiLU-and-mul ``epilogue``, which PRELOAD's loop lacks), unless ``MEASURED``
    has the shape), then ``OVERRIDES``."""
    cfg = _base_config(m_bucket, n, k, dtype, granularity)
    if WEIGHT_ONLY_M1 and m_bucket == 1 and not cfg.USE_DOT:
        cfg = replace(cfg, PREQUANT=False, WEIGHT_ONLY=True)
        measured = (m_bucket, n, k, dtype, granularity) in MEASURED
        if not measured and 0 < REDUCE_STEPS_MIN_K <= k:
            cfg = fill_gpu(replace(cfg, BLOCK_N=8, BLOCK_K=2048, SPLIT_K=1, num_warps=8, REDUCE_STEPS=True), n, k)
        elif not measured and granularity != "block128" and not epilogue:
            cfg = _preload_config(cfg, n, k)
    if (m_bucket, n, k) in OVERRIDES:
        cfg = replace(cfg, **OVERRIDES[(m_bucket, n, k)])
    return cfg


def preloads(n: int, k: int, dtype: torch.dtype, granularity: str) -> bool:
    """Whether the one-token GEMV of an [n, k] weight loads its tiles before the PDL wait (``PRELOAD``): the
    compiler's ``early_launch_o_proj`` asks, to let the kernel ahead launch it early."""
    return config_for(1, n, k, dtype, granularity).PRELOAD


def _base_config(m_bucket: int, n: int, k: int, dtype: torch.dtype, granularity: str) -> QGemvConfig:
    """``config_for`` before ``WEIGHT_ONLY_M1``.

    The bf16 GEMV's measured shapes (``triton_gemv.config_for``) carried over in bytes. M = 1,
    v1: [16 rows, 1 KB] fp8 steps, 8 warps (acc 64 fp32 registers a thread, 4 x 16-B weight
    loads in flight a thread). M >= 2, v3 (fp8 tensor cores): [32 rows, 512 B] steps (128 B
    under block128: one K block a step, so 64 rows), 4 warps, 4 stages. x is quantized in a
    first kernel at every bucket: measured on one H200 (Triton 3.6, 2026-11-30, Llama-3-8B
    shapes), the fused quantization (every program re-reading x) took 1.2-2x longer at M = 1
    (o 13.9 us vs 9.8, gate_up 82.7 vs 40.8) and 5-9x at M = 8 and 32. ``tune_fp8`` at M = 1
    preferred BLOCK_N 8 by under 3% (o 9.6 us, down 23.5 us)."""
    if m_bucket not in M_BUCKETS:
        raise ValueError(f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if (m_bucket, n, k, dtype, granularity) in MEASURED:
        return MEASURED[(m_bucket, n, k, dtype, granularity)]
    qbk = _quant_block(k)
    if granularity != "block128" and (m_bucket > 1 or n > k):
        # w @ x^T on e4m3 wgmma (SWAP_AB), [64 rows, 256 B] steps, K split to ~1 program per SM (not under
        # SWAP_AB_ONE_SLICE). Llama-3-8B's one-token gate/up GEMV (80 KB of shared memory: two programs an SM, 448
        # programs in two waves) in the whole step (2026-12-02, ``bench/decode_ab.py``): 2.522 ms against [128, 128 B]
        # x 4 stages 2.597 (one wave of 224), [64, 128 B] x 5 stages 2.598 (four an SM: one wave), [64, 128 B] x 8
        # stages 2.536. The first weight tiles loaded into registers before the PDL wait: slower
        # (``docs/persistent_decode.md``'s index).
        split_k = split_k_for(cdiv(n, 64), k, 256)
        if SWAP_AB_ONE_SLICE and split_k > 1:
            split_k, stages = 1, 5
        else:
            stages = 4
        return QGemvConfig(BLOCK_N=64, BLOCK_K=256, SPLIT_K=split_k, USE_DOT=True, PREQUANT=True, num_warps=4,
                           num_stages=stages, QUANT_BLOCK_K=qbk, SWAP_AB=True)
    if m_bucket == 1:
        cfg = QGemvConfig(BLOCK_N=16, BLOCK_K=1024, PREQUANT=True, num_warps=8, num_stages=1, QUANT_BLOCK_K=qbk)
    elif granularity == "block128":
        cfg = QGemvConfig(BLOCK_N=64, BLOCK_K=128, USE_DOT=True, PREQUANT=True, num_warps=4,
                          num_stages=4, QUANT_BLOCK_K=qbk)
    else:
        cfg = QGemvConfig(BLOCK_N=32, BLOCK_K=512, USE_DOT=True, PREQUANT=True, num_warps=4,
                          num_stages=4, QUANT_BLOCK_K=qbk)
    return fill_gpu(cfg, n, k)


# False: the silu_mul epilogue always runs as the SiLU kernel after the GEMV (A/B in one artifact). Measured as
# ``WEIGHT_ONLY_M1``: 2.604 against 2.652 ms with the other two changes, 2.724 against 2.735 without them.
SILU_EPILOGUE = True


def _silu_epilogue_fits(cfg: QGemvConfig, block: bool) -> bool:
    """Whether the GEMV's epilogue can take SiLU-and-mul: one K slice (no reduce kernel), channel or
    tensor scales (a program's gate and up rows lie in different 128-row blocks)."""
    return SILU_EPILOGUE and cfg.SPLIT_K == 1 and not block and cfg.BLOCK_N >= 2


def _tile_m(m_bucket: int, cfg: QGemvConfig) -> int:
    """Rows of the kernel's tile: the bucket, or 16 at least for tensor cores (tl.dot)."""
    return max(16, m_bucket) if cfg.USE_DOT else m_bucket


def _check_gemv_config(cfg: QGemvConfig, block: bool) -> None:
    if not (_pow2(cfg.BLOCK_N) and _pow2(cfg.BLOCK_K) and _pow2(cfg.QUANT_BLOCK_K) and cfg.SPLIT_K >= 1):
        raise ValueError(f"BLOCK_N, BLOCK_K and QUANT_BLOCK_K must be powers of two, SPLIT_K >= 1: {cfg}")
    if cfg.USE_DOT and (cfg.BLOCK_N < 16 or cfg.BLOCK_K < 32):
        raise ValueError(f"USE_DOT (fp8 tensor cores) needs BLOCK_N >= 16 and BLOCK_K >= 32: {cfg}")
    if block and cfg.BLOCK_N > 128:
        raise ValueError(f"block128 scales need BLOCK_N dividing 128: {cfg}")
    if block and cfg.USE_DOT and cfg.BLOCK_K > 128:
        raise ValueError(f"block128 scales with USE_DOT need BLOCK_K dividing 128: {cfg}")
    if cfg.SWAP_AB and not (cfg.USE_DOT and cfg.PREQUANT and cfg.BLOCK_N >= 64):
        raise ValueError(f"SWAP_AB needs USE_DOT, PREQUANT and BLOCK_N >= 64 (the wgmma side): {cfg}")
    if cfg.REDUCE_STEPS and cfg.USE_DOT:
        raise ValueError(f"REDUCE_STEPS is an FMA loop (no USE_DOT): {cfg}")
    if cfg.PRELOAD and not (cfg.WEIGHT_ONLY and cfg.SPLIT_K == 1 and not (block or cfg.REDUCE_STEPS)):
        raise ValueError(f"PRELOAD is a one-row weight-only loop over one K slice (no REDUCE_STEPS), channel or tensor "
                         f"scales: {cfg}")
    if cfg.WEIGHT_ONLY and (cfg.USE_DOT or cfg.PREQUANT):
        raise ValueError(f"WEIGHT_ONLY is an FMA version (no USE_DOT) and quantizes nothing (no PREQUANT): {cfg}")


def qlinear_small_m(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, *, granularity: str = "channel",
                    prologue: str | None = None, norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, config: QGemvConfig | None = None,
                    out: torch.Tensor | None = None, epilogue: str | None = None,
                    interleave: int = 0) -> torch.Tensor:
    """``fp8_ref.qlinear(x, w, scale, bias, residual, granularity, prologue)`` for 1 <= M <= 32.

    x [M, K] (``prologue="silu_mul"``: [M, 2K]; ``prologue="rms_norm"``: x is normalised with
    ``norm_weight`` [K] and ``eps`` by the quantize kernel) float32/float16/bfloat16; w [N, K] float8_e4m3fn;
    scale float32 [N] (channel, tensor) or [ceil(N/128), ceil(K/128)] (block128); bias [N] and
    residual [M, N] in x's dtype; all contiguous. ``config`` overrides ``config_for``; ``out``
    (contiguous [M, N], x's dtype; may be ``residual`` itself, not x) receives the result.
    ``epilogue="silu_mul"``: w is [gate; up] and the result [M, N/2] is ``torch_ref.silu_mul`` of the
    product: in the GEMV's epilogue where its config allows (``_silu_epilogue_fits``), else by the SiLU
    kernel after it (no ``out``, bias or residual then). ``interleave`` B (only with that epilogue): w's rows
    (and the scales) come in blocks of B gate then B up rows (``triton_elementwise.check_interleave``).
    Never reads tensor values on the host: runs on ``meta`` tensors under a recording launcher.
    The GEMV's grid and constexprs depend on (bucket(M), N, K, dtypes, granularity, fusions)
    only (M is a dynamic argument); the prequantize kernel (``PREQUANT``) has one program per
    row, grid (M,), and one binary for every M.
    """
    if epilogue not in (None, "silu_mul"):
        raise ValueError(f"epilogue must be None or 'silu_mul', got {epilogue!r}")
    if epilogue and (out is not None or bias is not None or residual is not None or w.shape[0] % 2):
        raise ValueError("the silu_mul epilogue takes no out, bias or residual, and an even number of weight rows")
    if interleave and not epilogue:
        raise ValueError(f"interleave={interleave} is a layout of the silu_mul epilogue's gate and up rows; "
                         f"there is no epilogue")
    if epilogue:
        triton_elementwise.check_interleave(w.shape[0] // 2, interleave)
    M, N, K, silu_mul = _check_inputs(x, w, scale, bias, residual, granularity, prologue, out)
    m_bucket = bucket(M)
    block = granularity == "block128"
    cfg = config if config is not None else config_for(m_bucket, N, K, x.dtype, granularity, epilogue is not None)
    _check_gemv_config(cfg, block)
    if cfg.PRELOAD and (m_bucket != 1 or K & (K - 1) or epilogue):
        raise ValueError(f"PRELOAD needs one row, K a power of two and no epilogue: {cfg}, M={M}, K={K}")
    if epilogue and not _silu_epilogue_fits(cfg, block):
        y = qlinear_small_m(x, w, scale, granularity=granularity, prologue=prologue, norm_weight=norm_weight, eps=eps,
                            config=cfg)
        return triton_elementwise.silu_mul(y, interleave=interleave)
    y = out if out is not None else torch.empty((M, N // 2 if epilogue else N), dtype=x.dtype, device=x.device)
    xs = None
    rms = prologue == "rms_norm"
    if rms:
        _check_norm(x, K, norm_weight)
        if not (cfg.PREQUANT or cfg.WEIGHT_ONLY):
            raise ValueError(f"the rms_norm prologue runs in the quantize or norm kernel: needs PREQUANT or "
                             f"WEIGHT_ONLY, got {cfg}")
    if cfg.WEIGHT_ONLY:  # the prologues as their own kernels, as the quantize would run them
        if rms:
            x = triton_norm.rms_norm(x, norm_weight, eps)
        if silu_mul:
            x = triton_elementwise.silu_mul(x)
    elif cfg.PREQUANT:
        x, xs = _prequantize(x, M, K, silu_mul, cfg.QUANT_BLOCK_K, norm_weight if rms else None, eps)
    grid = (cdiv(N // 2, cfg.BLOCK_N // 2) if epilogue else cdiv(N, cfg.BLOCK_N), cfg.SPLIT_K)
    consts = dict(N=N, K=K, BLOCK_M=_tile_m(m_bucket, cfg), BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  SPLIT_K=cfg.SPLIT_K, USE_DOT=cfg.USE_DOT, BLOCK_SCALE=block, PREQUANT=cfg.PREQUANT,
                  PROLOGUE_SILU_MUL=silu_mul and not (cfg.PREQUANT or cfg.WEIGHT_ONLY), SWAP_AB=cfg.SWAP_AB,
                  PREFETCH=prefetch_bytes(PREFETCH_BYTES, K), WEIGHT_ONLY=cfg.WEIGHT_ONLY,
                  EPILOGUE_SILU_MUL=epilogue is not None, **({"REDUCE_STEPS": True} if cfg.REDUCE_STEPS else {}),
                  **({"PRELOAD": True} if cfg.PRELOAD else {}), **({"PAIR_BLOCK": interleave} if interleave else {}),
                  **promote_acc(cfg.BLOCK_K))
    has_bias, has_residual = bias is not None, residual is not None
    if cfg.SPLIT_K == 1:
        launch(_qgemv_kernel, grid, [x, xs, w, scale, bias, residual, y, M],
               dict(consts, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y
    ws = torch.empty((cfg.SPLIT_K, M, N), dtype=torch.float32, device=x.device)
    launch(_qgemv_kernel, grid, [x, xs, w, scale, None, None, ws, M],
           dict(consts, HAS_BIAS=False, HAS_RESIDUAL=False),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_r = max(64, 1024 // m_bucket)
    launch(_qgemv_reduce_kernel, (cdiv(N, block_r),), [ws, bias, residual, y, M],
           dict(N=N, SPLIT_K=cfg.SPLIT_K, BLOCK_M=m_bucket, BLOCK_R=block_r, HAS_BIAS=has_bias,
                HAS_RESIDUAL=has_residual),
           num_warps=4, num_stages=1)
    return y
