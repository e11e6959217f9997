"""Fused mixture-of-experts MLP in Triton: token sorting by expert, then two grouped GEMMs.

Semantics are ``mxc.kernels.moe_ref.fused_moe`` (the oracle): x [T, H]; each token t was
routed to experts ``ids[t, j]`` with weights ``weights[t, j]`` (j < k); the output row is
``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with w_gate_up [E, 2I, H]
(gate rows, then up rows) and w_down [E, H, I]. The work is E small GEMMs whose row sets are
known only on the device; the algorithm (vLLM's ``fused_moe`` structure, written anew) makes
them one launch each with shapes and grids that depend on shapes only, so a forward pass can be
recorded on ``meta`` tensors, compiled ahead of time and replayed in a CUDA graph.

1. ``moe_align`` groups the k*T *assignments* (index ``a = t * k + j``) by expert, each group
   padded to a multiple of BLOCK_M with the sentinel ``T * k``, so that every block of BLOCK_M
   consecutive entries of ``sorted_token_ids`` belongs to one expert (``expert_of_block``).
   The padded length is data-dependent (``num_tokens_post_padded``, on the device); the buffers
   are sized for the worst case ``P = roundup(T*k + min(E, T*k) * (BLOCK_M - 1), BLOCK_M)``
   (at most min(E, T*k) experts are used, each wasting < BLOCK_M slots), and programs of blocks
   past ``num_tokens_post_padded`` return at once. Three kernels, no host reads, no atomics:
   a. ``_moe_count_kernel`` (grid cdiv(P, CHUNK)): fills ``sorted_token_ids`` with the
      sentinel and writes per-chunk histograms ``counts [C, E]`` of CHUNK assignments each
      (``tl.histogram``; invalid and masked lanes go to a discard bin E).
   b. ``_moe_offsets_kernel`` (one program): expert totals, padded to BLOCK_M; their exclusive
      prefix sum (``starts [E]``) and total (``num_tokens_post_padded``); ``expert_of_block``
      for every block (the number of experts ending at or before the block's first slot; -1 for
      blocks past the padded length).
   c. ``_moe_scatter_kernel`` (grid (C, E); programs whose (chunk, expert) count is 0 return):
      the program of (c, e) places chunk c's assignments of expert e at ``starts[e]`` + the
      counts of e in chunks before c + their rank in the chunk (``tl.cumsum`` of the match
      mask). Groups are in ascending assignment order: the result is deterministic.
   With ``ONE_CHUNK_SORT`` and T*k <= CHUNK <= ``ONE_CHUNK_MAX``, ``_moe_align_one_chunk_kernel`` (one program)
   does all three.
2. ``_moe_gemm1_kernel`` (grid (P / BLOCK_M, cdiv(I, BLOCK_N))): per block, gather the x rows
   of its assignments (row ``a // k``), ``tl.dot`` them against the gate and the up rows of the
   block's expert (two fp32 accumulators, one pass over H), then ``silu(gate) * up`` with the
   reference's rounding (gate and up rounded to x's dtype as F.linear's outputs, silu in fp32
   rounded, the product rounded), stored to ``h [T*k, I]`` at the assignments' rows.
3. ``_moe_gemm2_kernel`` (grid (P / BLOCK_M, cdiv(H, BLOCK_N)); its tile ``MoeConfig.down()``):
   ``h[rows] @ w_down[e]^T``, rounded, times the routing weight (rounded, as the reference's ``y * weight``), stored to
   ``y [T*k, H]`` at the assignments' rows. With k == 1, y is the output itself. Float32 routing
   weights (Mixtral's) with 16-bit x make y float32: the products unrounded, as torch promotes them
   (``moe_ref``; transformers' default experts path), until the sum rounds once.
4. ``_moe_sum_kernel`` (k > 1; grid (T, cdiv(H, BLOCK_H))): ``out[t] = sum_j y[t*k + j]`` in
   fp32, in j order, rounded once (deterministic; no atomics). The reference adds in its own
   dtype in ascending expert order (``index_add_``): identical for k <= 2, within a rounding of
   the dtype for k > 2 (with fp32 weights it too sums in fp32 over j, rounded once). With a
   residual (``fuse_linear_io``), it also adds that (then it runs at k == 1 too).

Why this shape: grouping turns k*T tiny GEMVs into full-width tensor-core tiles whose rows
share one expert's weights, so each expert's weights are read once per BLOCK_M rows (once in
total at decode, where every expert gets < BLOCK_M rows); the gather of x rows happens in the
GEMM's loads (no permuted copy of x), and the intermediate ``h`` is indexed by assignment
(k*T rows, not P) so its size does not grow with E * BLOCK_M padding. The grid is
``(block, n-tile)`` with the block index fastest: concurrently running programs are mostly
consecutive blocks of one expert on one n-tile, which share the weight tile in L2.

Versions: v1 (this file). The tiles live in ``mxc.kernels.moe_tiles``. The defaults in ``config_for`` are
vLLM-style heuristics while experts get few rows (BLOCK_M 16; fp8 experts with row scales there step K by 256
elements: ``bench/moe_prefill_lab.py --decode``, docs/perf.md, sixty-sixth run) and, past 16 rows an expert, the
tiles a sweep on an H100 found fastest (``bench/moe_prefill_lab.py``; docs/perf.md, sixty-fifth run). Measured in
the step (one H200, Triton 3.6, Qwen3-30B-A3B shape, bf16, 2026-11-30, ``bench/moe.py``; docs/perf.md, fifth
run): batch-64 decode 14.6 ms a step (about the bytes of the ~126 experts 64 tokens touch, at the copy rate),
11.6x Hugging Face eager; one MoE layer 547 / 1152 us at 64 / 2048 tokens against 30218 / 41477 for a per-expert
loop. One or a few tokens take ``triton_moe_decode`` instead. Possible next steps, each to be measured: a sort
that avoids the E x C scatter grid for large prefills; fusing the k-sum into GEMM 2.

fp8 experts: w_gate_up / w_down in float8_e4m3fn with per-output-row fp32 scales
``s_gate_up [E, 2I]`` / ``s_down [E, H]``: weight tiles are widened to x's dtype after the load
(exact: e4m3 fits in fp16 and bf16), the accumulator columns are scaled by the row scales
before the epilogue's rounding. Activations stay unquantized. The oracle is ``moe_ref`` on the
dequantized weights ``(w.float() * s[..., None]).to(x.dtype)``; results differ by the rounding
of the dequantized weights and the fp32 summation order. An already-fp8 checkpoint's 128x128
block scales (``[E, row blocks, column blocks]``, ``BLOCK_SCALE``): each weight tile is
dequantized by its blocks' scales and rounded to x's dtype before the dot, as the oracle does.

Kernels follow ``mxc.kernels.launch``'s convention: pointers and dynamic ints only (the
assignment count ``numel = T*k`` and the padded length P are dynamic, so one binary serves a
token-count bucket); E, H, I, k and every tile are constexprs; tensors are contiguous; absent
scale pointers are None. Plain pointer arithmetic (no block pointers or tensor descriptors):
compiles on Triton 3.6 and 3.9. Loaded bf16/fp8 values are cast before any arithmetic other
than ``tl.dot`` (the interpreter holds them as raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, check_operand, launch, next_pow2
from mxc.kernels.moe_tiles import DTYPES as _DTYPES, MoeConfig, config_for, heuristic_config, token_bucket
from mxc.kernels.pdl import pdl_enter

FP8 = torch.float8_e4m3fn
# moe_align's tiles: elements of the offsets kernel's [C_TILE, E_PAD] and [B_TILE, E_PAD] tiles,
# and chunk counts summed per step by the scatter kernel (module names so tests can shrink them)
_OFFSETS_TILE_ELEMS = 8192
_SCATTER_C_TILE = 64
# Assignments that fit one chunk of at most ONE_CHUNK_MAX (T * k <= CHUNK <= 256: decode batches up to 32 tokens at
# k = 8) sorted by one program, ``_moe_align_one_chunk_kernel``, instead of the count, offsets and scatter kernels.
# moe_align alone (E = 128, k = 8, one H100, CUDA graph, 2026-12-06): 4.36 us against 6.55 at 8 tokens, 7.38
# against 9.19 at 32, and 12.94 against 10.95 at 128 (a 1024-key sort). The fp8 Qwen3-30B-A3B step (one H100,
# ``bench/decode_ab.py``, one artifact, 2026-12-06; docs/perf.md, sixty-ninth run): batch 8 6.101 against 6.345 ms
# (medians of five rounds; with the 8-row GEMV configs of ``triton_fp8_gemv.MEASURED`` too, 6.071 against 6.329 over
# ten), batch 32 10.530 against 10.534, batch 1 2.205 against 2.206. Read at launch (False: the three kernels).
ONE_CHUNK_SORT = True
ONE_CHUNK_MAX = 256

__all__ = ["MoeConfig", "config_for", "heuristic_config", "token_bucket", "padded_size", "moe_align", "fused_moe"]


# ----------------------------------------------------------------------------------------------
# kernels: sorting assignments by expert


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, sorted_ptr, numel, P,
                      E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """Program c: ``sorted[c*CHUNK : (c+1)*CHUNK] = numel`` (the sentinel; slots < P) and, for
    chunks of assignments (c*CHUNK < numel), ``counts[c, e]`` = the chunk's assignments to e."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + numel, mask=offs < P)
    if pid * CHUNK < numel:
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E)
        ok = (ids >= 0) & (ids < E)
        bins = tl.where(ok, ids, E).to(tl.int32)  # E: the discard bin (E_PAD > E)
        hist = tl.histogram(bins, E_PAD)
        offs_e = tl.arange(0, E_PAD)
        tl.store(counts_ptr + pid * E + offs_e, hist, mask=offs_e < E)


@triton.jit
def _store_block_experts(expert_ptr, ends, ntpp, P, BLOCK_M: tl.constexpr, B_TILE: tl.constexpr):
    """``expert_of_block`` for all P / BLOCK_M blocks from the groups' padded ends [E_PAD]: the number of
    experts ending at or before the block's first slot, -1 for blocks past ``ntpp``."""
    n_blocks = P // BLOCK_M
    for b0 in range(0, n_blocks, B_TILE):
        offs_b = b0 + tl.arange(0, B_TILE)
        first = offs_b * BLOCK_M  # first slot of each block
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + offs_b, tl.where(first < ntpp, expert, -1), mask=offs_b < n_blocks)


@triton.jit
def _moe_offsets_kernel(counts_ptr, starts_ptr, expert_ptr, ntpp_ptr, numel, P,
                        E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        CHUNK: tl.constexpr, C_TILE: tl.constexpr, B_TILE: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """One program: totals per expert, padded to BLOCK_M; ``starts`` (exclusive prefix sum),
    ``ntpp`` (the padded total) and ``expert_of_block`` for all P / BLOCK_M blocks."""
    pdl_enter(USE_PDL)
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    n_chunks = tl.cdiv(numel, CHUNK)
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n_chunks, C_TILE):
        offs_c = c0 + tl.arange(0, C_TILE)
        cnt = tl.load(counts_ptr + offs_c[:, None] * E + offs_e[None, :],
                      mask=(offs_c < n_chunks)[:, None] & e_ok[None, :], other=0)
        totals += tl.sum(cnt, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [E_PAD]; lanes >= E are 0 wide and end at ntpp
    ntpp = tl.sum(padded, axis=0)
    tl.store(starts_ptr + offs_e, ends - padded, mask=e_ok)
    tl.store(ntpp_ptr, ntpp)
    _store_block_experts(expert_ptr, ends, ntpp, P, BLOCK_M, B_TILE)


@triton.jit
def _moe_scatter_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_ptr, numel,
                        E: tl.constexpr, CHUNK: tl.constexpr, C_TILE: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """Program (c, e): chunk c's assignments to expert e, in order, at their sorted slots."""
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    e = tl.program_id(1)
    if tl.load(counts_ptr + c * E + e) == 0:
        return
    base = tl.load(starts_ptr + e)
    for c0 in range(0, c, C_TILE):  # counts of e in the chunks before c
        offs_c = c0 + tl.arange(0, C_TILE)
        base += tl.sum(tl.load(counts_ptr + offs_c * E + e, mask=offs_c < c, other=0), axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    hit = ids == e
    slot = base + tl.cumsum(hit.to(tl.int32), 0) - 1
    tl.store(sorted_ptr + slot, offs, mask=hit)


@triton.jit
def _moe_align_one_chunk_kernel(ids_ptr, sorted_ptr, expert_ptr, ntpp_ptr, delta_ptr, numel, P,
                                E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                                CHUNK: tl.constexpr, B_TILE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program, numel <= CHUNK: the three sort kernels' results at once. The histogram, the padded starts,
    ``ntpp`` and ``expert_of_block`` as the offsets kernel makes them; then the assignments sorted by (expert,
    index) (``tl.sort`` of CHUNK keys), the one at sorted position i of expert e going to slot i + ``delta[e]``
    (its padded start less the unpadded one, through ``delta_ptr``: a gather needs memory)."""
    pdl_enter(USE_PDL)
    offs = tl.arange(0, CHUNK)
    for p0 in range(0, P, CHUNK):  # the sentinel everywhere first; the barrier below orders the scatter after
        tl.store(sorted_ptr + p0 + offs, tl.zeros((CHUNK,), dtype=tl.int32) + numel, mask=p0 + offs < P)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=E)
    bins = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)  # E: the discard bin (E_PAD > E)
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    totals = tl.where(e_ok, tl.histogram(bins, E_PAD), 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    ntpp = tl.sum(padded, axis=0)
    tl.store(delta_ptr + offs_e, ends - padded - (tl.cumsum(totals, 0) - totals), mask=e_ok)
    tl.store(ntpp_ptr, ntpp)
    _store_block_experts(expert_ptr, ends, ntpp, P, BLOCK_M, B_TILE)
    tl.debug_barrier()  # every thread's sentinels and deltas are in
    keys = tl.sort(bins * CHUNK + offs)  # < (E + 1) * CHUNK <= 1025 * 1024: int32
    e = keys // CHUNK
    hit = e < E
    delta = tl.load(delta_ptr + e, mask=hit, other=0)
    tl.store(sorted_ptr + offs + delta, keys % CHUNK, mask=hit)


# ----------------------------------------------------------------------------------------------
# kernels: grouped GEMMs


@triton.jit
def _dot(a, b, acc):
    """acc += a @ b in fp32; fp32 operands as three tf32 products (~fp32 accuracy on tensor cores)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_w(w_ptrs, mask, other, ty: tl.constexpr):
    """A weight tile as an operand of dtype ``ty`` (x's dtype): fp8 widened (exact), else as is.
    ``mask`` and ``other`` are both None (unmasked) or both given."""
    w = tl.load(w_ptrs, mask=mask, other=other)
    if w_ptrs.dtype.element_ty == tl.float8e4nv:
        w = w.to(tl.float32).to(ty)
    return w


@triton.jit
def _load_w_blocks(w_ptrs, mask, s_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, ty: tl.constexpr):
    """An fp8 weight tile [BLOCK_K, BLOCK_N] dequantized by its 128x128 block scales and rounded to ``ty``, as the
    reference dequantizes the weights. ``s_ptrs`` [BLOCK_N]: each column's (weight row's) scale row at K block 0.
    A step inside one block column (BLOCK_K divides 128, the configs' case) loads one scale a column; a wider
    step gathers a scale per element."""
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    if 128 % BLOCK_K == 0:
        s = tl.load(s_ptrs + k0 // 128)[None, :]
    else:
        kb = tl.minimum((k0 + tl.arange(0, BLOCK_K)) // 128, (K + 127) // 128 - 1)  # masked columns: any block
        s = tl.load(s_ptrs[None, :] + kb[:, None])
    return (w * s).to(ty)


@triton.jit
def _block_rows(sorted_ptr, expert_ptr, numel, pid_m, BLOCK_M: tl.constexpr):
    """Block pid_m's assignment rows (int64; the sentinel ``numel`` marks padding), their mask,
    and its expert (int64)."""
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < numel
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    return rows, row_ok, expert


@triton.jit
def _moe_gemm1_kernel(x_ptr, w_ptr, s_ptr, sorted_ptr, expert_ptr, ntpp_ptr, h_ptr, numel,
                      H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_SCALE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program (block, n-tile): h[rows, n] = silu(x[rows // k] @ gate_e^T) * (x[rows // k] @ up_e^T)
    for columns n of I, e the block's expert. w_ptr: w_gate_up [E, 2I, H]; s_ptr: its fp8 row
    scales [E, 2I] (or with BLOCK_SCALE its 128x128 block scales [E, 2I / 128, cdiv(H, 128)]), or None;
    h_ptr: h [numel, I] in x's dtype."""
    pdl_enter(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    ty = x_ptr.dtype.element_ty
    EVEN_K: tl.constexpr = H % BLOCK_K == 0
    rows, row_ok, expert = _block_rows(sorted_ptr, expert_ptr, numel, pid_m, BLOCK_M)
    tok = tl.where(row_ok, rows // TOP_K, 0)  # padding rows read token 0; never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % I  # columns past I re-read valid rows; only the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * (2 * I * H) + rn[None, :] * H + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + I * H
    KB: tl.constexpr = (H + 127) // 128
    if BLOCK_SCALE:  # the gate and up rows' scale rows
        sg_ptrs = s_ptr + expert * (2 * I // 128 * KB) + (rn // 128) * KB
        su_ptrs = s_ptr + expert * (2 * I // 128 * KB) + ((I + rn) // 128) * KB
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if BLOCK_SCALE:
            k_ok = (k + offs_k) < H
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            g = _load_w_blocks(g_ptrs, k_ok[:, None], sg_ptrs, k, H, BLOCK_K, ty)
            u = _load_w_blocks(u_ptrs, k_ok[:, None], su_ptrs, k, H, BLOCK_K, ty)
        elif EVEN_K:
            a = tl.load(x_ptrs)
            g = _load_w(g_ptrs, None, None, ty)
            u = _load_w(u_ptrs, None, None, ty)
        else:
            k_ok = (k + offs_k) < H
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            g = _load_w(g_ptrs, k_ok[:, None], 0.0, ty)
            u = _load_w(u_ptrs, k_ok[:, None], 0.0, ty)
        acc_g = _dot(a, g, acc_g)
        acc_u = _dot(a, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if s_ptr is not None and not BLOCK_SCALE:
        s_g = tl.load(s_ptr + expert * (2 * I) + rn).to(tl.float32)
        s_u = tl.load(s_ptr + expert * (2 * I) + I + rn).to(tl.float32)
        acc_g = acc_g * s_g[None, :]
        acc_u = acc_u * s_u[None, :]
    # the reference's rounding: F.linear outputs in the dtype, silu in fp32 rounded, product rounded
    gate = acc_g.to(ty).to(tl.float32)
    up = acc_u.to(ty).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
    h = (act * up).to(ty)
    mask = row_ok[:, None] & (offs_n < I)[None, :]
    tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h, mask=mask)


@triton.jit
def _moe_gemm2_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, sorted_ptr, expert_ptr, ntpp_ptr, y_ptr, numel,
                      H: tl.constexpr, I: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_SCALE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program (block, n-tile): y[rows, n] = (h[rows] @ down_e^T)[:, n] * weights[rows] for
    columns n of H. w_ptr: w_down [E, H, I]; s_ptr: its fp8 row scales [E, H] (or with BLOCK_SCALE its
    block scales [E, cdiv(H, 128), cdiv(I, 128)]), or None;
    weights_ptr: the routing weights [numel] (x's dtype, or fp32); y_ptr: y [numel, H] (x's dtype, or fp32
    with fp32 weights and a k-sum after: the products unrounded)."""
    pdl_enter(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    ty = h_ptr.dtype.element_ty
    EVEN_K: tl.constexpr = I % BLOCK_K == 0
    rows, row_ok, expert = _block_rows(sorted_ptr, expert_ptr, numel, pid_m, BLOCK_M)
    src = tl.where(row_ok, rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + src[:, None] * I + offs_k[None, :]
    w_ptrs = w_ptr + expert * (H * I) + rn[None, :] * I + offs_k[:, None]
    KB: tl.constexpr = (I + 127) // 128
    if BLOCK_SCALE:  # the rows' scale rows
        s_rows = s_ptr + expert * ((H + 127) // 128 * KB) + (rn // 128) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        if BLOCK_SCALE:
            k_ok = (k + offs_k) < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = _load_w_blocks(w_ptrs, k_ok[:, None], s_rows, k, I, BLOCK_K, ty)
        elif EVEN_K:
            a = tl.load(a_ptrs)
            w = _load_w(w_ptrs, None, None, ty)
        else:
            k_ok = (k + offs_k) < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = _load_w(w_ptrs, k_ok[:, None], 0.0, ty)
        acc = _dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if s_ptr is not None and not BLOCK_SCALE:
        acc = acc * tl.load(s_ptr + expert * H + rn).to(tl.float32)[None, :]
    wt = tl.load(weights_ptr + src).to(tl.float32)
    y = (acc.to(ty).to(tl.float32) * wt[:, None]).to(y_ptr.dtype.element_ty)
    mask = row_ok[:, None] & (offs_n < H)[None, :]
    tl.store(y_ptr + rows[:, None] * H + offs_n[None, :], y, mask=mask)


@triton.jit
def _moe_sum_kernel(y_ptr, r_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    """Program (t, h-tile): out[t] = sum over j (in order, fp32) of y[t*k + j], rounded once; with a
    residual ``r_ptr`` (else None), then r[t] + that, in fp32, rounded (``torch_ref.add``)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + offs_h, mask=ok, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if r_ptr is not None:
        r = tl.load(r_ptr + t * H + offs_h, mask=ok, other=0.0).to(tl.float32)
        out = (r + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + offs_h, out, mask=ok)


# ----------------------------------------------------------------------------------------------
# sizes


def padded_size(numel: int, num_experts: int, block_m: int) -> int:
    """P: the most slots the padded expert groups can take (at most min(E, numel) groups,
    each padded by < block_m), rounded up to block_m."""
    bound = numel + min(num_experts, numel) * (block_m - 1)
    return -(-bound // block_m) * block_m


# ----------------------------------------------------------------------------------------------
# wrappers


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, *, chunk: int = 1024):
    """Group the assignments of ``ids [T, k]`` (int64 expert ids in [0, E)) by expert.

    Returns ``(sorted_token_ids [P] int32, expert_of_block [P / block_m] int32,
    num_tokens_post_padded [1] int32)`` with ``P = padded_size(T * k, E, block_m)``. Entries are
    assignment indices ``t * k + j``, grouped by ascending expert, each group in ascending order
    and padded to a multiple of block_m with the sentinel ``T * k``; slots from
    ``num_tokens_post_padded`` to P are sentinels too, and their blocks' expert is -1. Ids
    outside [0, E) are dropped (no out-of-bounds access; their rows are then left unwritten
    by ``fused_moe``). Never reads device values on the host; runs on ``meta`` tensors.
    """
    if ids.dim() != 2 or ids.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [T, k] int64, got {tuple(ids.shape)} {ids.dtype}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"need E >= 1 and power-of-two block_m and chunk >= 16, got {num_experts}, "
                         f"{block_m}, {chunk}")
    numel = ids.numel()
    if numel < 1:
        raise ValueError("ids is empty")
    P = padded_size(numel, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    n_chunks = cdiv(numel, chunk)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)  # the one-program sort's deltas instead
    e_pad = next_pow2(num_experts + 1)  # room for the discard bin
    if n_chunks == 1 and ONE_CHUNK_SORT and chunk <= ONE_CHUNK_MAX:
        launch(_moe_align_one_chunk_kernel, (1,), [ids, sorted_ids, expert_of_block, ntpp, starts, numel, P],
               dict(E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk,
                    B_TILE=max(1, _OFFSETS_TILE_ELEMS // e_pad)), num_warps=4)
        return sorted_ids, expert_of_block, ntpp
    counts = torch.empty((n_chunks, num_experts), dtype=torch.int32, device=dev)
    launch(_moe_count_kernel, (cdiv(P, chunk),), [ids, counts, sorted_ids, numel, P],
           dict(E=num_experts, E_PAD=e_pad, CHUNK=chunk), num_warps=4)
    launch(_moe_offsets_kernel, (1,), [counts, starts, expert_of_block, ntpp, numel, P],
           dict(E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk,
                C_TILE=max(1, _OFFSETS_TILE_ELEMS // e_pad), B_TILE=max(1, _OFFSETS_TILE_ELEMS // e_pad)),
           num_warps=4)
    launch(_moe_scatter_kernel, (n_chunks, num_experts), [ids, counts, starts, sorted_ids, numel],
           dict(E=num_experts, CHUNK=chunk, C_TILE=_SCATTER_C_TILE), num_warps=4)
    return sorted_ids, expert_of_block, ntpp


def block_scale_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The 128x128 block scales' shape of an expert stack [E, rows, K]."""
    return shape[0], -(-shape[1] // 128), -(-shape[2] // 128)


def _check_weight(name, w, shape, scale, dtype, device):
    if tuple(w.shape) != shape or not w.is_contiguous() or w.device != device:
        raise ValueError(f"{name} must be contiguous {list(shape)} on {device}, got {tuple(w.shape)}")
    if w.dtype == FP8:
        blocks = block_scale_shape(shape)
        if scale is None or tuple(scale.shape) not in (shape[:2], blocks) or scale.dtype != torch.float32 \
                or not scale.is_contiguous() or scale.device != device:
            raise ValueError(f"fp8 {name} needs contiguous float32 row scales {list(shape[:2])} or block scales "
                             f"{list(blocks)} on {device}")
    elif w.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (x's dtype) or {FP8}, got {w.dtype}")
    elif scale is not None:
        raise ValueError(f"a scale for {name} is only taken with fp8 weights")


def check_inputs(x, weights, ids, w_gate_up, w_down, s_gate_up, s_down,
                 residual=None) -> tuple[int, int, int, int, int]:
    """``fused_moe``'s argument checks (see there); returns (T, H, E, I, k)."""
    if x.dim() != 2 or x.dtype not in _DTYPES or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [T, H] in one of {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous [{T}, k] int64, got {tuple(ids.shape)} {ids.dtype}")
    top_k = ids.shape[1]
    if weights.shape != ids.shape or weights.dtype not in (x.dtype, torch.float32) or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous {list(ids.shape)} {x.dtype} or float32, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"expected w_gate_up [E, 2I, H] and w_down [E, H, I], got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    E, I = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    _check_weight("w_gate_up", w_gate_up, (E, 2 * I, H), s_gate_up, x.dtype, x.device)
    _check_weight("w_down", w_down, (E, H, I), s_down, x.dtype, x.device)
    if (s_gate_up is not None and s_gate_up.dim()) != (s_down is not None and s_down.dim()):
        raise ValueError("w_gate_up and w_down need scales of one granularity (both per row or both per block)")
    if s_gate_up is not None and s_gate_up.dim() == 3 and I % 128:
        raise ValueError(f"block-scaled w_gate_up needs I a multiple of 128 (its gate and up parts whole 128-row "
                         f"blocks), got {I}")
    if len({t.device for t in (x, weights, ids)}) != 1:
        raise ValueError("x, weights and ids must be on one device")
    if residual is not None:
        check_operand("residual", residual, (T, H), x.dtype, x.device)
    return T, H, E, I, top_k


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, *, s_gate_up: torch.Tensor | None = None, s_down: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """``moe_ref.fused_moe(x, weights, ids, w_gate_up, w_down)`` -> [T, H] in x's dtype
    (``+ residual`` [T, H] as ``torch_ref.add`` when given: the sum kernel adds it).

    x [T, H] (fp32/fp16/bf16); weights [T, k] (x's dtype, or fp32: Mixtral's, whose products then stay fp32
    until the k-sum rounds them once, as ``moe_ref``); ids [T, k] int64 in [0, E);
    w_gate_up [E, 2I, H] (gate rows then up rows) and w_down [E, H, I], in x's dtype or
    float8_e4m3fn with float32 row scales ``s_gate_up [E, 2I]`` / ``s_down [E, H]``
    (``w = q * s[..., None]``) or 128x128 block scales ``[E, 2I / 128, cdiv(H, 128)]`` /
    ``[E, cdiv(H, 128), cdiv(I, 128)]`` (each tile dequantized and rounded to x's dtype, as the reference
    dequantizes). All contiguous on one device. ``config`` overrides
    ``config_for(token_bucket(T), E, k, H, I, x.dtype, fp8 experts, block scales)``. Never reads device values on the
    host: runs on ``meta`` tensors under a recording launcher; grids depend on shapes only.
    """
    T, H, E, I, top_k = check_inputs(x, weights, ids, w_gate_up, w_down, s_gate_up, s_down, residual)
    block_scales = s_gate_up is not None and s_gate_up.dim() == 3
    cfg = config if config is not None else config_for(token_bucket(T), E, top_k, H, I, x.dtype,
                                                       fp8_weights=w_gate_up.dtype == FP8, block_scales=block_scales)

    sorted_ids, expert_of_block, ntpp = moe_align(ids, E, cfg.BLOCK_M, chunk=cfg.CHUNK)
    numel = T * top_k
    n_blocks = sorted_ids.numel() // cfg.BLOCK_M
    h = torch.empty((numel, I), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    sums = top_k > 1 or residual is not None  # the sum kernel also adds the residual
    # fp32 weights (Mixtral's) with 16-bit x: fp32 products (torch's promotion), rounded once by the sum
    y = torch.empty((numel, H), dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device) if sums else out
    launch(_moe_gemm1_kernel, (n_blocks, cdiv(I, cfg.BLOCK_N)),
           [x, w_gate_up, s_gate_up, sorted_ids, expert_of_block, ntpp, h, numel],
           dict(H=H, I=I, TOP_K=top_k, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                BLOCK_SCALE=block_scales), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    down_n, down_k, down_warps, down_stages = cfg.down()
    launch(_moe_gemm2_kernel, (n_blocks, cdiv(H, down_n)),
           [h, w_down, s_down, weights, sorted_ids, expert_of_block, ntpp, y, numel],
           dict(H=H, I=I, BLOCK_M=cfg.BLOCK_M, BLOCK_N=down_n, BLOCK_K=down_k, BLOCK_SCALE=block_scales),
           num_warps=down_warps, num_stages=down_stages)
    if sums:
        block_h = min(1024, next_pow2(H))
        launch(_moe_sum_kernel, (T, cdiv(H, block_h)), [y, residual, out],
               dict(H=H, TOP_K=top_k, BLOCK_H=block_h), num_warps=4)
    return out
