"""Small-M linear for decode: ``y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N])``, M <= 32.

An optional residual [M, N] is fused into the epilogue (``mxc.compiler.passes.fuse_linear_io``):
``y = residual + linear(...)`` as the unfused ``torch_ref.add``: the linear (fp32 accumulator +
bias) rounded to the dtype, then the sum in fp32, rounded. With SPLIT_K > 1 the reduce kernel
adds it (with the bias). ``out`` may be the residual itself (each element is read, then
written, by the same program). Input-side fusions were measured on the H200 and removed: a
SiLU-and-mul prologue (every program recomputes silu on x) was 1.2x slower at batch 1 and 30x at
batch 8; an RMSNorm prologue at batch 1 (x^2 summed while streaming the weights) made the step's
GEMVs 16% slower (4437 against 3836 us a step on Llama-3-8B) for 132 us of norm kernels saved. Re-measured
2026-12-03 under PDL (v1 with the norm weight multiplied into x and 1/rms applied at the end, one artifact,
``bench/decode_ab.py``): Llama-3-8B bf16 4.469 against 4.086 ms a step, the fp8 step with only its bf16 LM
head fused 2.561 against 2.512, Qwen3-30B-A3B bf16 (qkv only: 640 programs of two K steps) 2.537 against
2.547. v1 keeps bytes in flight through resident programs, so per-program latency costs in proportion to the
waves of programs (the LM head's 8016 programs: 49 us).
Under fp8 both live in the activation-quantize kernel instead (``triton_fp8_quant``).
With ``PUSH_WORLD`` ranks (``linear_small_m_push``, the ``fuse_linear_all_reduce`` pass) a row-parallel GEMV stores
its rows into every rank's push all-reduce buffer instead of returning them.
On the output side, a SiLU-and-mul epilogue on the merged gate/up GEMV at batch 1
(``fuse_silu_epilogue``) measured 4.41 against 4.29 ms/token end to end on Llama-3-8B and was removed.

At decode a linear reads the whole weight matrix to produce a handful of rows,
so it is bound by memory bandwidth: every weight byte must be read exactly once
per call, with 16-byte coalesced loads, and with enough bytes in flight to cover
HBM latency (Little's law on an H200: ~4.2 TB/s x ~1 us ~ 4 MB in flight over
132 SMs, i.e. >= ~32 KB per SM). x (at most 32 x K) is re-read by every program
from L2; its traffic is M / BLOCK_N of the weight traffic.

Layout: one program owns BLOCK_N consecutive rows of ``w`` (a [BLOCK_N, BLOCK_K]
tile per step, K contiguous, so each thread loads 16 bytes of one row) and one
of SPLIT_K slices of K; it loops over its K slice and writes a [M, BLOCK_N]
block. M is padded to a power-of-two bucket (``BLOCK_M``, a constexpr) and
masked, so one compiled binary serves every M in a bucket and the grid depends
only on (bucket, N, K).

Versions (one kernel, chosen by constexprs; the reference is
``torch.nn.functional.linear`` computed in fp32, see tests/kernels/test_gemv.py).
Measured on one H200 (Triton 3.6, bf16, CUDA graph of back-to-back calls,
weights from HBM, copy ceiling 4.22 TB/s); numbers in ``config_for``:
  v1 FMA, BLOCK_M == 1 (batch-1 decode; the default there): weights cast to fp32
     right after the load, ``acc[BLOCK_N, BLOCK_K] += w * x`` with no reduction
     in the loop; one reduction over K at the end. 1 convert + 1 FMA per weight
     element. 74-105% of the copy ceiling on Llama-3-8B shapes, ahead of cuBLAS.
  v2 FMA, BLOCK_M in {2, 4, 8}: for each of the BLOCK_M rows (a static loop)
     ``sum(w * x_m, axis=1)``, reduced every step, w loaded once per step. Kept
     for ``gemv_tuning.tune`` and as the CUDA-core reference; no default uses it: at M = 2 it
     measured 1.5-2x slower than v3 (a per-row reduction and a move of x through
     shared memory every step, no load pipelining).
  v3 DOT (``USE_DOT``; the default for M >= 2): ``tl.dot(x, w^T)`` on tensor
     cores with x padded to a 16-row tile (mma, native bf16/fp16 operands, fp32
     accumulation; fp32 weights use input_precision="tf32x3" to stay
     fp32-accurate: "ieee" measured 10% of bandwidth). Its cp.async pipeline
     (num_stages=4) keeps the bytes in flight, and the FLOPs (up to 32 per
     weight element) leave the CUDA cores.
  SPLIT_K > 1: when N / BLOCK_N programs cannot fill the GPU (small N, e.g.
     tensor-parallel shards), K is split over SPLIT_K programs that write fp32
     partials to a scratch [SPLIT_K, M, N]; a second tiny kernel sums them in
     a fixed order (deterministic, no atomics), adds the bias and casts.

Kernels follow ``mxc.kernels.launch``'s convention for ahead-of-time builds:
arguments are pointers and the dynamic M only; N, K and all tile sizes are
constexprs; tensors are contiguous (no strides). Works on Triton 3.6 and 3.9
(plain pointer arithmetic, no block pointers or tensor descriptors).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, check_operand, launch
from mxc.kernels.pdl import pdl_enter, prefetch_bytes, prefetch_rows_l2

M_BUCKETS = (1, 2, 4, 8, 16, 32)
NUM_SMS = 132  # H200 SXM; config_for must stay a pure function of (bucket, N, K, dtype)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bucket(m: int) -> int:
    """The smallest M bucket (a power of two in ``M_BUCKETS``) that holds ``m`` rows."""
    if not 1 <= m <= M_BUCKETS[-1]:
        raise ValueError(f"linear_small_m handles 1..{M_BUCKETS[-1]} rows, got {m}")
    return next(b for b in M_BUCKETS if b >= m)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, bufs_ptr, state_ptr, rank, slot_elems,
                 N: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr = False, PUSH_WORLD: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
                 PREFETCH: tl.constexpr = 0):
    """One program: rows [pid_n * BLOCK_N, +BLOCK_N) of y over K slice pid_k.

    With SPLIT_K == 1, ``y_ptr`` is y [M, N] (bias and residual added, cast to y's dtype);
    otherwise it is the fp32 scratch [SPLIT_K, M, N] and HAS_BIAS and HAS_RESIDUAL are False.
    ``b_ptr`` / ``r_ptr`` are None (specialised away) when there is no bias / residual.
    Built for PDL (USE_PDL), it first asks L2 for PREFETCH bytes (0: none) of each of its weight rows.
    With PUSH_WORLD ranks (> 0; ``y_ptr`` None), y goes into the push all-reduce's buffers instead:
    rows of this rank in slot ``state[0]`` of every rank's buffer (``bufs_ptr``, its own included),
    -0.0 sent as +0.0 (``peer_allreduce``); ``bufs_ptr``, ``state_ptr``, ``rank`` and ``slot_elems``
    are None otherwise.
    """
    tl.static_assert(SPLIT_K == 1 or not (HAS_BIAS or HAS_RESIDUAL))
    tl.static_assert(PUSH_WORLD == 0 or (SPLIT_K == 1 and not HAS_RESIDUAL))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # K slice of this program: a whole number of BLOCK_K steps (the last slices may run past K)
    K_PER_SPLIT: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    EVEN_K: tl.constexpr = K % (SPLIT_K * BLOCK_K) == 0
    k_start = pid_k * K_PER_SPLIT

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N re-read row (n % N): loads need no N mask (only the store does).
    rn = offs_n % N
    if USE_PDL and PREFETCH > 0:  # weights stream into L2 while the kernel ahead finishes; then wait for its output
        prefetch_rows_l2(w_ptr, rn, k_start, K, PREFETCH)
    pdl_enter(USE_PDL)
    if N * K > 2**31 - 1:  # element offsets past int32
        rn = rn.to(tl.int64)
    w_ptrs = w_ptr + rn[:, None] * K + (k_start + offs_k)[None, :]
    x_row_ok = offs_m < M

    if USE_DOT:
        # v3: acc[BLOCK_M, BLOCK_N] on tensor cores, operands in their own dtype
        x_ptrs = x_ptr + offs_m[:, None] * K + (k_start + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=x_row_ok[:, None], other=0.0)
            else:
                k_ok = (k_start + k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=x_row_ok[:, None] & k_ok[None, :], other=0.0)
            if w_ptr.dtype.element_ty == tl.float32:
                # three tf32 products (hi*hi + hi*lo + lo*hi): ~fp32 accuracy on tensor cores;
                # "ieee" runs on CUDA cores and measured 6x slower than cuBLAS at M = 2
                acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc_t = tl.trans(acc)  # [BLOCK_N, BLOCK_M]
    elif BLOCK_M == 1:
        # v1: per-thread partial products, one reduction at the end
        x_ptrs = x_ptr + k_start + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs).to(tl.float32)
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                k_ok = (k_start + k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
                x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            # x arrives in its own 1-D layout and moves to w's through shared memory
            # (BLOCK_K values per step, 1/BLOCK_N of the weight bytes); a [1, BLOCK_K] load
            # instead makes Triton move w to x's layout.
            acc2 += w * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc_t = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        # v2: w loaded once per step, one reduced dot product per row of x
        x_ptrs = x_ptr + k_start + offs_k
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            k_ok = (k_start + k + offs_k) < K
            if EVEN_K:
                w = tl.load(w_ptrs).to(tl.float32)
            else:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                # rows past M re-read row M - 1 (no mask); their sums are never stored
                xm_ptrs = x_ptrs + tl.minimum(M - 1, m) * K
                if EVEN_K:
                    xm = tl.load(xm_ptrs).to(tl.float32)
                else:
                    xm = tl.load(xm_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * xm[None, :], axis=1)  # [BLOCK_N]
                acc_t += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

    # epilogue on acc_t [BLOCK_N, BLOCK_M]; y is [M, N] row-major
    n_ok = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc_t += bias[:, None]
    y_mask = n_ok[:, None] & x_row_ok[None, :]
    if PUSH_WORLD > 0:
        bits = acc_t.to(x_ptr.dtype.element_ty).to(tl.int16, bitcast=True)
        bits = tl.where(bits == -32768, 0, bits)  # -0.0 marks "not written yet": send +0.0
        at = (tl.load(state_ptr) % 3).to(tl.int64) * slot_elems + rank * M * N
        for r in tl.static_range(PUSH_WORLD):
            buf = tl.load(bufs_ptr + r).to(tl.pointer_type(tl.int16))
            tl.store(buf + at + offs_m[None, :] * N + offs_n[:, None], bits, mask=y_mask)
    else:
        y_ptrs = y_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
        y = acc_t.to(y_ptr.dtype.element_ty)
        if HAS_RESIDUAL:  # torch_ref.add(residual, linear): the linear rounded, then the sum rounded
            r = tl.load(r_ptr + offs_m[None, :] * N + offs_n[:, None], mask=y_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptrs, y, mask=y_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, r_ptr, y_ptr, M,
                          N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr = False,
                          USE_PDL: tl.constexpr = False):
    """y[:, cols] = sum over s (in order) of ws[s, :, cols] (+ bias), cast to y's dtype
    (then + residual [M, N], rounded again, as ``_gemv_kernel``'s epilogue)."""
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs
    y = acc.to(y_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=mask)


@triton.jit
def _block_scaled(w, s_ptrs, k, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [ROWS, BLOCK_K] (fp32) times their 128x128 block scales, in fp32 (the reference rounds the dequantized
    weights to x's dtype first; the kernels skip that rounding per element); ``s_ptrs`` [ROWS]: each row's scale
    row at K block 0 (one scale a row for a step inside one block column, else a scale per element)."""
    if 128 % BLOCK_K == 0:
        s = tl.load(s_ptrs + k // 128)[:, None]
    else:
        kb = tl.minimum((k + offs_k) // 128, (K + 127) // 128 - 1)  # masked columns past K: any block
        s = tl.load(s_ptrs[:, None] + kb[None, :])
    return w * s


@triton.jit
def _rows_step(x_ptrs, w_ptrs, k, acc, K: tl.constexpr, BLOCK_K: tl.constexpr, X_PER_ROW: tl.constexpr = False,
               s_ptrs=None):
    """One BLOCK_K step of ``dot_rows``, the pointers at column ``k``: (acc plus this step's products, the
    pointers moved to the next step)."""
    offs_k = tl.arange(0, BLOCK_K)
    if K % BLOCK_K == 0:
        x = tl.load(x_ptrs).to(tl.float32)
        w = tl.load(w_ptrs).to(tl.float32)
    else:
        k_ok = (k + offs_k) < K
        if X_PER_ROW:
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
    if s_ptrs is not None:
        w = _block_scaled(w, s_ptrs, k, offs_k, K, BLOCK_K)
    if X_PER_ROW:
        acc += w * x
    else:
        acc += w * x[None, :]
    return acc, x_ptrs + BLOCK_K, w_ptrs + BLOCK_K


@triton.jit
def dot_rows(x_ptrs, w_ptrs, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
             X_PER_ROW: tl.constexpr = False, s_ptrs=None, UNROLL: tl.constexpr = False):
    """The v1 loop: ``sum over K of w[r, :] * x`` [ROWS] in fp32, with per-thread partial products
    and one reduction at the end. ``w_ptrs`` [ROWS, BLOCK_K] points at column 0 of each weight row
    (rows contiguous along K); ``x_ptrs`` at column 0 of one input row [BLOCK_K], or with
    ``X_PER_ROW`` of each weight row's own input row [ROWS, BLOCK_K]. ``s_ptrs`` (fp8 weights with 128x128
    block scales, else None): each row's scale row, the weights scaled as they are loaded. ``UNROLL``: the K loop
    unrolled (as ``dot_gate_up_rows``')."""
    acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    if UNROLL:
        for k in tl.static_range(0, K, BLOCK_K):
            acc, x_ptrs, w_ptrs = _rows_step(x_ptrs, w_ptrs, k, acc, K, BLOCK_K, X_PER_ROW, s_ptrs)
    else:
        for k in range(0, K, BLOCK_K):
            acc, x_ptrs, w_ptrs = _rows_step(x_ptrs, w_ptrs, k, acc, K, BLOCK_K, X_PER_ROW, s_ptrs)
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_step(x_ptrs, g_ptrs, u_ptrs, k, acc_g, acc_u, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  sg_ptrs=None, su_ptrs=None):
    """One BLOCK_K step of ``dot_gate_up_rows``, the pointers at column ``k``: (acc_g, acc_u) plus this step's
    products, and the pointers moved to the next step."""
    offs_k = tl.arange(0, BLOCK_K)
    if K % BLOCK_K == 0:
        x = tl.load(x_ptrs).to(tl.float32)
        g = tl.load(g_ptrs).to(tl.float32)
        u = tl.load(u_ptrs).to(tl.float32)
    else:
        k_ok = (k + offs_k) < K
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
    if sg_ptrs is not None:
        g = _block_scaled(g, sg_ptrs, k, offs_k, K, BLOCK_K)
        u = _block_scaled(u, su_ptrs, k, offs_k, K, BLOCK_K)
    acc_g += g * x[None, :]
    acc_u += u * x[None, :]
    return acc_g, acc_u, x_ptrs + BLOCK_K, g_ptrs + BLOCK_K, u_ptrs + BLOCK_K


@triton.jit
def dot_gate_up_rows(x_ptrs, g_ptrs, u_ptrs, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                     sg_ptrs=None, su_ptrs=None, UNROLL: tl.constexpr = False):
    """``dot_rows`` over gate rows and the matching up rows in one pass over x: (gate, up) [ROWS]; with block
    scales, ``sg_ptrs`` / ``su_ptrs`` as ``dot_rows``' ``s_ptrs``. ``UNROLL``: the K loop unrolled, so the
    compiler may issue later steps' loads before earlier steps' products (more bytes in flight a program; the
    same sums in the same order)."""
    acc_g = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    if UNROLL:
        for k in tl.static_range(0, K, BLOCK_K):
            acc_g, acc_u, x_ptrs, g_ptrs, u_ptrs = _gate_up_step(x_ptrs, g_ptrs, u_ptrs, k, acc_g, acc_u, K, BLOCK_K,
                                                                 sg_ptrs, su_ptrs)
    else:
        for k in range(0, K, BLOCK_K):
            acc_g, acc_u, x_ptrs, g_ptrs, u_ptrs = _gate_up_step(x_ptrs, g_ptrs, u_ptrs, k, acc_g, acc_u, K, BLOCK_K,
                                                                 sg_ptrs, su_ptrs)
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


# ----------------------------------------------------------------------------------------------
# configs


@dataclass(frozen=True)
class GemvConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    USE_DOT: bool = False
    num_warps: int = 4
    num_stages: int = 1


def _vec(dtype: torch.dtype) -> int:
    """Elements in one 16-byte load."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def fill_gpu(cfg, n: int, k: int):
    """Give the GPU enough programs (any GEMV config with BLOCK_N, BLOCK_K, USE_DOT and SPLIT_K:
    this module's and ``triton_fp8_gemv``'s). v1 (no pipelining: bytes in flight come from programs
    resident at once) wants >= 1 program per SM: halve BLOCK_N down to 8. v3 keeps
    num_stages tiles in flight per program and measured best with 128 programs on 132 SMs
    (o_proj), so it only halves (down to 16) below 64 programs. Then, if still short, split K
    in powers of two up to ~1 program per SM (a split costs a second launch: o_proj measured
    slower split 4 ways), keeping >= 2 BLOCK_K steps per slice."""
    min_bn, want = (16, NUM_SMS // 2) if cfg.USE_DOT else (8, NUM_SMS)
    while cdiv(n, cfg.BLOCK_N) < want and cfg.BLOCK_N > min_bn:
        cfg = replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
    programs = cdiv(n, cfg.BLOCK_N)
    return replace(cfg, SPLIT_K=split_k_for(programs, k, cfg.BLOCK_K) if programs < want else 1)


def split_k_for(n_programs: int, k: int, block_k: int) -> int:
    split = 1
    while n_programs * split < NUM_SMS and k >= 2 * (2 * split) * block_k:
        split *= 2
    return split


# Shapes where ``gemv_tuning.tune`` found a faster config than the rules below (H200, Triton 3.6, bf16,
# ``bench/moe_lab.py``, 2026-11-30): the place a tuning cache's entries will plug in.
MEASURED = {
    (1, 6144, 4096, torch.bfloat16): GemvConfig(8, 256, 1, False, 4, 1),  # Llama-3-8B qkv: 16.0 -> 14.2 us
    (1, 5120, 2048, torch.bfloat16): GemvConfig(8, 1024, 1, False, 8, 1),  # Qwen3-30B-A3B qkv: 7.9 -> 7.4 us
    # Llama-3-8B at tp=2, per rank (bench/linear_lab.py --tune-tp 2; qkv and down: default within 2%)
    (1, 4096, 2048, torch.bfloat16): GemvConfig(8, 512, 1, False, 8, 1),  # o: 6.8 -> 6.1 us
    (1, 14336, 4096, torch.bfloat16): GemvConfig(16, 256, 1, False, 4, 1),  # gate_up: 32.0 -> 29.6 us
}


def config_for(m_bucket: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Default H200 config for a (bucket, N, K, dtype); a pure function of its arguments.

    Sizes are in bytes of a weight row so that fp32 (4 B) gets half the elements of bf16/fp16.
    One load is 16 B per thread; a warp spans 512 B of a row. Measured on one H200 (Triton 3.6,
    bf16, back-to-back calls in a CUDA graph, weights from HBM; copy ceiling 4.22 TB/s):
    - M = 1, v1: [16 rows, 2 KB] steps, 8 warps (acc2: 16 * 1024 / 256 = 64 fp32 registers a
      thread; 8 x 16-B loads in flight a thread). o 10.7 us (3.13 TB/s), down 29.0 us
      (4.05 TB/s), vs cuBLAS 13.3 and 31.8. num_stages has no effect (Triton does not pipeline
      loads that feed no tl.dot), nor does BLOCK_N 8-32 much; [8, 512 B] steps were 4-5% slower.
    - M >= 2, v3 (tensor cores, cp.async pipeline): [32 rows, 512 B] steps, 4 warps, 4 stages
      (16 KB of w a stage, 64-128 KB of shared memory with x). 4 stages beat 2-3 by 10-40%:
      the pipeline is what keeps bytes in flight. M = 2: o 11.4 us, down 30.8 us (cuBLAS 13.2,
      31.9); M = 32: gate_up 67.6 us, 3.47 TB/s (cuBLAS 58.7: the one shape class behind).
      v2 (CUDA cores) measured 1.5-2x slower than v3 at M = 2 (per-row reductions and a
      layout change of x through shared memory every step), so no default uses it.
    - fp32 weights (rare at decode; not tuned): M = 1 v1 o 17.3 us (3.87 TB/s, cuBLAS 22.5);
      M >= 2 v3 with input_precision="tf32x3": o 34.6 us at M = 2, 111.8 us at M = 32 vs
      cuBLAS 26.4 and 47.3 ("ieee", on CUDA cores, was 148 us at M = 2).
    - few rows (N < ~4K): see ``fill_gpu``.
    - v1's K loop unrolled (as the MoE gate/up pair kernel's, which gained), in the whole step
      (``bench/decode_ab.py``, interleaved rounds, 2026-12-04): slower everywhere, so the loop stays.
      Llama-3-8B bf16 4.238 / 4.571 ms against 4.081 (loops of up to 4 / 16 steps unrolled; the 16-row
      tiles go from 128 to 173-255 registers a thread, one program an SM); its fp8 step (the LM head
      only) 2.516 against 2.505; Qwen3-30B-A3B bf16 2.483 (qkv and LM head, 2 steps) / 2.488 (and o,
      4 steps) against 2.475.
    ``gemv_tuning.tune`` times its candidates on a real GPU; its winners can replace rows here.
    """
    if m_bucket not in M_BUCKETS:
        raise ValueError(f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    if (m_bucket, n, k, dtype) in MEASURED:
        return MEASURED[(m_bucket, n, k, dtype)]
    row = 512 // torch.empty((), dtype=dtype).element_size()  # elements in 512 B: one warp's span
    if m_bucket == 1:
        cfg = GemvConfig(BLOCK_N=16, BLOCK_K=4 * row, num_warps=8, num_stages=1)
    else:
        cfg = GemvConfig(BLOCK_N=32, BLOCK_K=row, USE_DOT=True, num_warps=4, num_stages=4)
    return fill_gpu(cfg, n, k)


def _tile_m(m_bucket: int, cfg: GemvConfig) -> int:
    """Rows of the kernel's tile: the bucket, or 16 at least for tensor cores (tl.dot)."""
    return max(16, m_bucket) if cfg.USE_DOT else m_bucket


# ----------------------------------------------------------------------------------------------
# wrapper


def linear_small_m(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, *, config: GemvConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x [M, K] @ w [N, K]^T (+ bias [N])`` for 1 <= M <= 32, in x's dtype (fp32
    accumulation); the same as ``torch_ref.linear(x, w, bias, residual)``.

    ``residual`` (contiguous [M, N], x's dtype) is added to the result (``residual`` is
    positional after ``bias``, as the generated programs pass a linear's inputs). ``config``
    overrides ``config_for`` (tests, tuning; K is w's K); ``out`` (contiguous [M, N], x's dtype;
    it may be ``residual`` itself, not x) receives the result instead of a new tensor. Never
    reads tensor values on the host, so it runs on ``meta`` tensors under a recording launcher.
    """
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, Kx = x.shape
    N, K = w.shape
    if Kx != K:
        raise ValueError(f"x has K={Kx} but w has K={K}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one of {_DTYPES}, got {x.dtype} and {w.dtype}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("x and w must be contiguous")
    if x.device != w.device:
        raise ValueError(f"x on {x.device} but w on {w.device}")
    for name, t, shape in (("bias", bias, (N,)), ("residual", residual, (M, N))):
        if t is not None:
            check_operand(name, t, shape, x.dtype, x.device)
    m_bucket = bucket(M)
    cfg = config if config is not None else config_for(m_bucket, N, K, x.dtype)
    if out is None:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        check_operand("out", out, (M, N), x.dtype, x.device)
        y = out
    grid = (cdiv(N, cfg.BLOCK_N), cfg.SPLIT_K)
    consts = dict(N=N, K=K, BLOCK_M=_tile_m(m_bucket, cfg), BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  SPLIT_K=cfg.SPLIT_K, USE_DOT=cfg.USE_DOT, PREFETCH=prefetch_bytes(PREFETCH_BYTES, K * w.element_size()))
    has_bias, has_residual = bias is not None, residual is not None
    if cfg.SPLIT_K == 1:
        launch(_gemv_kernel, grid, [x, w, bias, residual, y, M, None, None, None, None],
               dict(consts, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y
    ws = torch.empty((cfg.SPLIT_K, M, N), dtype=torch.float32, device=x.device)
    launch(_gemv_kernel, grid, [x, w, None, None, ws, M, None, None, None, None],
           dict(consts, HAS_BIAS=False, HAS_RESIDUAL=False),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_r = max(64, 1024 // m_bucket)
    launch(_splitk_reduce_kernel, (cdiv(N, block_r),), [ws, bias, residual, y, M],
           dict(N=N, SPLIT_K=cfg.SPLIT_K, BLOCK_M=m_bucket, BLOCK_R=block_r, HAS_BIAS=has_bias,
                HAS_RESIDUAL=has_residual),
           num_warps=4, num_stages=1)
    return y


# Bytes of each weight row (from the program's first column) a GEMV built for PDL asks L2 for before it
# waits for the kernel ahead (``pdl.prefetch_rows_l2``); ``triton_fp8_gemv`` has its own. Llama-3-8B bf16
# batch-1 decode on one H200 (Triton 3.6, 2026-11-30, ``bench/decode_ab.py``, medians of three interleaved
# rounds): none 4.133 ms, 1 KB 4.134, 2 KB 4.120, 4 KB (the former default) 4.279, 8 KB 4.673, 16 KB 4.776.
# More than the kernel ahead hides competes with the weights that GEMV is still streaming.
PREFETCH_BYTES = 2048


def pushes(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``linear_small_m_push`` serves this shape: its default config has no K split (the
    split's reduce kernel would have to push instead)."""
    return 1 <= m <= M_BUCKETS[-1] and dtype in (torch.float16, torch.bfloat16) and \
        config_for(bucket(m), n, k, dtype).SPLIT_K == 1


def linear_small_m_push(x: torch.Tensor, w: torch.Tensor, bufs: torch.Tensor, state: torch.Tensor, rank: int,
                        slot_elems: int, world: int) -> None:
    """``x [M, K] @ w [N, K]^T`` rounded to x's dtype, pushed into the push all-reduce's buffers (rows
    of ``rank`` in slot ``state[0]`` of every rank's buffer, as ``peer_allreduce.push_all_reduce``
    pushes them) instead of returned: the row-parallel linear before the all-reduce, whose wait
    kernel (``push_all_reduce(..., pushed=True)``) then only waits, sums and goes on. Only shapes
    ``pushes`` takes; bf16/fp16."""
    M, K = x.shape
    N = w.shape[0]
    assert pushes(M, N, K, x.dtype) and w.dtype == x.dtype and w.shape[1] == K, (
        f"linear_small_m_push: {M} x {K} @ {tuple(w.shape)} {x.dtype} is not a pushed shape")
    assert x.is_contiguous() and w.is_contiguous() and M * N * world <= slot_elems, "linear_small_m_push: layout"
    cfg = config_for(bucket(M), N, K, x.dtype)
    consts = dict(N=N, K=K, BLOCK_M=_tile_m(bucket(M), cfg), BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  SPLIT_K=1, USE_DOT=cfg.USE_DOT, HAS_BIAS=False, HAS_RESIDUAL=False, PUSH_WORLD=int(world),
                  PREFETCH=prefetch_bytes(PREFETCH_BYTES, K * w.element_size()))
    launch(_gemv_kernel, (cdiv(N, cfg.BLOCK_N), 1), [x, w, None, None, None, M, bufs, state, int(rank),
                                                           int(slot_elems)],
           consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
