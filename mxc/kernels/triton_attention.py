"""Causal GQA attention through the paged-by-slot KV cache: decode and prefill, in Triton.

Owns the Triton paths of the ``attention`` op (reference:
``torch_ref.attention``). They read keys/values from the cache, which already
holds this call's keys/values (a separate kernel writes them first):

    k_cache, v_cache [S, L, HKV, D]   S slots, L rows per slot, contiguous
    slots   [B] int32                 cache row of sequence b
    kv_lens [B] int32                 valid cache rows of sequence b (this call's tokens included)

Key position p is visible to query position t iff p <= t and, with a sliding
window w, p > t - w. Query heads h use kv head h // (HQ // HKV).

The kernels' entry points are rendered per head layout, cache length and window
from ``kernels/templates/decode_attention.py.j2`` (the merge of the
splits: ``decode_merge.py.j2``) and ``prefill_attention.py.j2``; their loops are the hand-written ``@triton.jit``
helpers below (``_split_rows``, ``_attend_rows``, ``_store_split``,
``_prefill_inner``). Tile sizes and split counts stay constexpr parameters.

Versions:
- ``decode_attention``: one new token per sequence (position kv_lens[b] - 1).
  Flash-decoding: grid (B, HKV, NUM_SPLITS); a program takes all GROUP query
  heads of one kv head (K/V rows are read once per group; the group is padded
  to >= 16 rows for tl.dot) over one of NUM_SPLITS equal chunks of the rows the
  token sees (ceil(visible / NUM_SPLITS), computed in the kernel from kv_lens[b]).
  The grid depends on L and B only, so it is static (ahead-of-time builds, CUDA
  graphs), while the work spreads over every split whatever the context length
  (with chunks fixed by L, a 200-row context at L = 2049 ran as two sequential
  128-row blocks in one split of 16: 5.9 us per layer on the H200, 2026-11-30).
  Each split writes its normalised partial output and its
  log-sum-exp (base 2) to fp32 scratch; ``decode_reduce_kernel`` merges the
  splits (a split with no visible row has lse = -inf and weight 0). With
  NUM_SPLITS == 1 the split kernel writes the output directly (one launch). Measured and removed: the
  last split of each kv head merging (an atomic count, no merge launch), Llama-3-8B fp8 batch 1 2.796
  against 2.671 ms (H200, 2026-12-01, ``bench/decode_ab.py``): that split's serial merge costs more
  than the launch it saves.
  ``default_splits`` picks NUM_SPLITS from L and B * HKV (static shapes).
- ``prefill_attention``: variable-length batch of query tokens, sequence b's
  tokens q[q_start[b]:q_start[b+1]] at positions kv_lens[b] - n_b .. kv_lens[b] - 1
  (a cached prefix, as in chunked prefill, works the same). FlashAttention-2:
  grid (cdiv(max_q_len, BLOCK_M), B, HQ), programs past a sequence's end exit;
  each loops over key blocks between the window start of its first query and the
  causal limit of its last, with an online softmax, in stages (``_prefill_inner``,
  as in Triton's fused-attention tutorial): blocks every query of the block sees
  in full run without masks, the window edge and the causal diagonal with them.

Numerics: scores, softmax statistics and accumulators in fp32; tl.dot operands
in the model dtype (fp32 models use exact fp32 dots, ``input_precision="ieee"``).
The probabilities are cast to the value dtype before P @ V, as the reference does.

H200 (Triton 3.6, bf16, HQ/HKV = 32/8, D = 128): decode reads the cache at
3.5-4.4 TB/s from B=1 L=32768 to B=32 L=4096 (copy ceiling 4.23); causal prefill
of 4096 tokens ran at 390 TFLOP/s for D = 128 (74% of torch SDPA's 524) and
330 for D = 64 (88% of 375) before the FMA softmax and TMA loads (``PREFILL_TMA``), and now at
486 TFLOP/s (0.283 ms; cuDNN 0.266) for D = 128 (2026-12-03). Not done yet: warp specialisation for
prefill, fp8 KV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels import kernel_templates
from mxc.kernels.launch import cdiv, launch, next_pow2
from mxc.kernels.pdl import prefetch_l2

LOG2E = 1.4426950408889634

# Under PDL the decode split kernel asks L2 for its first block of cache rows before it waits for the
# kernel ahead (RoPE + KV write), so the rows' HBM latency overlaps that kernel. Llama-3-8B batch-1 decode
# on one H200 (2026-12-01, ``bench/decode_ab.py``, medians of three interleaved rounds, rounds within
# 0.003 ms): fp8 2.745 against 2.753 ms, bf16 4.107 against 4.113. That version also loaded q before the
# wait, a race with the RoPE kernel that writes it (``tests/gpu/test_pdl_order_gpu.py``); with q loaded after
# the wait (2026-12-02, same bench): fp8 2.519 against 2.526 ms without the prefetch (bf16 4.109).
DECODE_PREFETCH_KV = True


@triton.jit
def _split_rows(kv_len, split, HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """[lo, hi): this split's share of the rows the new token (position kv_len - 1) sees, cut into
    NUM_SPLITS equal chunks at run time: a short context spreads over every split (one block each)
    instead of filling the first split's blocks one after another while the others idle. Measured on
    the H200 (2026-12-01, ``bench/decode_ab.py``): chunks of at least 128 or 256 rows (fewer busy splits
    at a short context) were no faster, Llama-3-8B fp8 batch 1 2.797 and 2.850 against 2.774 ms."""
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(kv_len - WINDOW, 0)
    chunk = (kv_len - first + NUM_SPLITS - 1) // NUM_SPLITS
    lo = first + split * chunk
    return lo, tl.minimum(lo + chunk, kv_len)


@triton.jit
def _prefetch_rows_l2(k_ptr, v_ptr, lo, hi, ROW_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      LINES: tl.constexpr):
    """Ask L2 for LINES 128-byte lines of K and V rows [lo, min(hi, lo + BLOCK_N)) (rows ROW_STRIDE
    elements apart from k_ptr and v_ptr; an empty range asks for row 0)."""
    ELEM: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
    rows = tl.maximum(tl.minimum(lo + tl.arange(0, BLOCK_N), hi - 1), 0).to(tl.int64)
    cols = tl.minimum(tl.arange(0, LINES) * (128 // ELEM), HEAD_DIM - 1)
    offs = rows[:, None] * ROW_STRIDE + cols[None, :]
    prefetch_l2(k_ptr + offs)
    prefetch_l2(v_ptr + offs)


@triton.jit
def _attend_rows(q, kt_ptrs, v_ptrs, lo, hi, qk_scale, mask_d,
                 HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Online softmax of q [BLOCK_G, BLOCK_D] over cache rows [lo, hi): (acc, m_i, l_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # every block holds at least one visible row, so m_i is finite after the first one
    for start_n in range(lo, hi, BLOCK_N):
        mask_n = start_n + offs_n < hi
        kt = tl.load(kt_ptrs + start_n * (HKV * HEAD_DIM), mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n * (HKV * HEAD_DIM), mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_split(acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, b, heads, split, mask_g, offs_d, mask_d,
                 HQ: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The output (one split) or this split's normalised partial output and log2-sum-exp2
    (part_out [B, HQ, NUM_SPLITS, D], part_lse [B, HQ, NUM_SPLITS]; -inf when it saw no row)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (b * HQ + heads[:, None]) * HEAD_DIM + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        row = (b * HQ + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(part_lse_ptr + row, lse, mask=mask_g)


@triton.jit
def _prefill_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, start, end, pos_m, hi, qk_scale,  #
                   HKV: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,  #
                   HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr,  #
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  #
                   k_desc=None, v_desc=None, kv_row0=0, kv_col=0, TMA: tl.constexpr = False):
    """Online softmax over key blocks start, start + BLOCK_N, ... < end. MASKED=False: every key of
    these blocks is visible to every query of the block (no bounds, causal or window checks).

    With TMA (``BLOCK_D == HEAD_DIM``), K and V blocks come through the tensor descriptors of the caches viewed
    as [S * L, HKV * HEAD_DIM], rows ``kv_row0 + n`` (the sequence's slot), columns from ``kv_col`` (its kv
    head). A diagonal block's rows past ``hi`` (the next slot's, or beyond the cache: zero-filled) are masked
    out of the scores and zeroed in V: uninitialised cache rows may hold NaN, and 0 * NaN is NaN.

    The row maximum is taken on the unscaled scores (qk_scale > 0) and ``p = exp2(s * qk_scale - m)`` is one
    FMA an element; the head dimension is masked only where BLOCK_D pads it. Both measured on one H200
    (2026-12-03, ``bench/attention_tma_lab.py``, 32/8 heads of 128, causal): 2048 tokens 0.090 ms against
    0.093 before, 4096 tokens 0.312 against 0.325."""
    offs_n = tl.arange(0, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    mask_d = tl.arange(0, BLOCK_D) < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        pos_n = start_n + offs_n
        kt_at = kt_ptrs + start_n * (HKV * HEAD_DIM)
        v_at = v_ptrs + start_n * (HKV * HEAD_DIM)
        if TMA:
            kt = tl.trans(k_desc.load([kv_row0 + start_n, kv_col]))
            v = v_desc.load([kv_row0 + start_n, kv_col])
            if MASKED:
                mask_n = pos_n < hi
                v = tl.where(mask_n[:, None], v, 0.0)
        elif MASKED:
            mask_n = pos_n < hi
            if EVEN_D:
                kt = tl.load(kt_at, mask=mask_n[None, :], other=0.0)
                v = tl.load(v_at, mask=mask_n[:, None], other=0.0)
            else:
                kt = tl.load(kt_at, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
                v = tl.load(v_at, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        elif EVEN_D:
            kt = tl.load(kt_at)
            v = tl.load(v_at)
        else:
            kt = tl.load(kt_at, mask=mask_d[:, None], other=0.0)
            v = tl.load(v_at, mask=mask_d[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32, unscaled
        if MASKED:
            visible = mask_n[None, :] & (pos_n[None, :] <= pos_m[:, None])
            if HAS_WINDOW:
                visible = visible & (pos_n[None, :] > pos_m[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if HAS_WINDOW:
            # a row may see nothing in this block and nothing before (window edge): shift by 0 then, so its p
            # and alpha are exp2(-inf) = 0, not NaN. Without a window every (valid) row sees a key in its first
            # block: the causal diagonal's blocks start at or before the block's first query position.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s * qk_scale - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


# ---------------------------------------------------------------------------------------------
# wrappers: check, allocate, launch (pure functions of shapes, dtypes and static arguments)


# The prefill grid's order: heads fastest from the last query block (the blocks with the most keys first),
# or query blocks fastest from the first. On one H200 (2026-12-01, bench/attention_lab.py --orders, causal,
# one sequence, 32/8 heads of 128, bf16): 2048 tokens 0.093 ms against 0.111, 4096 0.331 against 0.360.
PREFILL_LONGEST_FIRST = True

# ``decode_attention(..., early_dependents=True)`` at one sequence: the attention's last kernel (the merge, or the
# split kernel when one split writes the output) lets the next kernel (the o projection's GEMV, which preloads
# its weights: ``triton_fp8_gemv.PRELOAD_MAX_BYTES``) launch before it waits (``pdl.pdl_enter_early``), so those
# loads overlap the attention. The compiler asks for it (``early_launch_o_proj``); False turns it off everywhere
# (A/B). Measured in ``triton_fp8_gemv``'s comment; with it, one split and no merge kernel (``MAX_SPLITS = 1``)
# took 2.518 against 2.518 ms with up to 32 splits and the merge (Llama-3-8B fp8 batch 1, one H200, 2026-12-02,
# ``bench/decode_ab.py``, medians of three interleaved rounds; the benchmark's 128-256-row contexts).
MERGE_EARLY_DEPENDENTS = True

# The prefill kernel loads q, K and V through TMA tensor descriptors (where the head dimension is a power of two):
# on one H200 (2026-12-03, bench/attention_tma_lab.py, 32/8 heads of 128, causal, with the FMA softmax) 0.082 ms
# at 2048 tokens against 0.090 with pointer loads, 0.284 against 0.312 at 4096. False: pointer loads (A/B).
PREFILL_TMA = True

MAX_SPLITS = 32  # decode splits at most (``bench/ablate.py --set`` varies it)
# Measured and not kept (2026-12-02, one H200, ``bench/decode_ab.py``, medians of three interleaved rounds): no merge
# kernel, the last split of each kv head to finish (an acq_rel count a kv head) merging the group's partials
# itself. Qwen3-30B-A3B batch 1: 2.662 against 2.550 ms; the split kernel then added 7.5 us a layer against 5.1
# for split + merge: the last program's count and its split-by-split merge take longer than the kernel boundary.


def default_splits(L: int, batch_kv_heads: int = 1) -> int:
    """Decode splits for a cache of L rows and B * HKV (batch_kv_heads) programs per split.

    Doubles the splits while each keeps >= 128 rows, the grid stays within 256 programs (~2 per
    SM of an H200) and there are at most 32. Measured on the H200 (bf16, HQ/HKV/D = 32/8/128,
    CUDA graphs): B=1 L=32768 with 32 splits reads the cache at 3.6 TB/s (1 split: 0.2 TB/s);
    B=8 L=4096 at 4-8 splits 3.5-3.65 TB/s; B=32 L=4096 is best at 1 split (4.4 TB/s).
    """
    splits = 1
    while splits < MAX_SPLITS and L // (2 * splits) >= 128 and batch_kv_heads * splits * 2 <= 256:
        splits *= 2
    return splits


def _block_d(D: int) -> int:
    return max(16, next_pow2(D))


def _decode_config(D: int) -> tuple[int, int, int]:
    """BLOCK_N, num_warps, num_stages of the split kernel (measured on the H200 for D = 128)."""
    if D <= 32:  # toy head sizes (tests): small blocks, so loops, edges and splits are exercised
        return 16, 4, 2
    return (128 if D <= 128 else 64), 4, 2


def _prefill_config(D: int, max_q_len: int) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps, num_stages: the best of seven to eleven configs measured on the
    H200 (causal, 2048 and 4096 tokens, bf16, D = 64, 128 and 256). Constant over each power-of-two bucket
    of ``max_q_len`` ((2^(k-1), 2^k]): ``aot.scenarios`` records one prefill a bucket."""
    if D <= 32:  # toy head sizes (tests), as in decode
        bm, bn, nw, ns = 16, 16, 4, 2
    elif D <= 128:  # longest first: 64 x 64 best at 2048 tokens (0.093 ms; 128 x 128 0.099), 128 x 128 at 4096
        # (0.321 ms; 64 x 64 0.335); the switch at a power-of-two bucket's edge, as the AOT build records them
        bm, bn, nw, ns = (128, 128, 8, 3) if max_q_len > 4096 else (64, 64, 4, 3)
    else:  # D = 256: 364 TFLOP/s (SDPA 579); 8 warps halve that
        bm, bn, nw, ns = 64, 32, 4, 2
    return min(bm, max(16, next_pow2(max_q_len))), bn, nw, ns


def _check_cache(q, k_cache, v_cache, slots, kv_lens, HQ, D):
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache/v_cache must be [S, L, HKV, D] alike, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    HKV = k_cache.shape[2]
    assert k_cache.shape[3] == D, f"head_dim mismatch: q {D}, cache {k_cache.shape[3]}"
    assert HQ % HKV == 0, f"query heads {HQ} not a multiple of kv heads {HKV}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.is_contiguous(), f"{name} must be contiguous"
    B = slots.shape[0]
    assert slots.dtype == kv_lens.dtype == torch.int32, "slots and kv_lens must be int32"
    assert slots.shape == kv_lens.shape == (B,), f"slots {tuple(slots.shape)} / kv_lens {tuple(kv_lens.shape)}"
    return B, HKV


def _window(sliding_window):
    assert sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}"
    return sliding_window


def _layout(k_cache, HQ: int, sliding_window) -> dict:
    """The template parameters of an attention kernel: head layout, cache rows, window."""
    L, HKV, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    return dict(HQ=HQ, HKV=HKV, HEAD_DIM=D, L=L, WINDOW=_window(sliding_window), BLOCK_D=_block_d(D))


def decode_attention(q, k_cache, v_cache, slots, kv_lens, scale: float, sliding_window: int | None = None,
                     num_splits: int | None = None, early_dependents: bool = False):
    """q [B, HQ, D] (the token at position kv_lens[b] - 1) -> out [B, HQ, D].

    Launches the split kernel and, with more than one split, the merge kernel; with ``early_dependents``
    and one sequence, the last of them (the merge, or the split kernel alone) lets the next kernel launch before
    it waits (``MERGE_EARLY_DEPENDENTS``)."""
    assert q.dim() == 3, f"q must be [B, HQ, D], got {tuple(q.shape)}"
    B, HQ, D = q.shape
    Bc, HKV = _check_cache(q, k_cache, v_cache, slots, kv_lens, HQ, D)
    assert Bc == B, f"{B} query rows but {Bc} sequences"
    L = k_cache.shape[1]
    NUM_SPLITS = default_splits(L, B * HKV) if num_splits is None else num_splits
    assert 1 <= NUM_SPLITS <= L, f"num_splits must be in [1, {L}], got {NUM_SPLITS}"
    BLOCK_N, num_warps, num_stages = _decode_config(D)
    layout = _layout(k_cache, HQ, sliding_window)
    out = torch.empty((B, HQ, D), dtype=q.dtype, device=q.device)
    if NUM_SPLITS > 1:
        part_out = torch.empty((B, HQ, NUM_SPLITS, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, HQ, NUM_SPLITS), dtype=torch.float32, device=q.device)
    else:  # the split kernel writes out directly; scratch pointers are unused
        part_out = part_lse = out
    split_kernel = kernel_templates.kernel("decode_attention", "decode_split_kernel", **layout,
                                           BLOCK_G=max(16, next_pow2(HQ // HKV)))
    lines = next_pow2(cdiv(D * k_cache.element_size(), 128)) if DECODE_PREFETCH_KV else 0
    early = early_dependents and MERGE_EARLY_DEPENDENTS and B == 1
    launch(split_kernel, (B, HKV, NUM_SPLITS), [q, k_cache, v_cache, slots, kv_lens, out, part_out, part_lse,
                                                float(scale)],
           dict(NUM_SPLITS=NUM_SPLITS, BLOCK_N=BLOCK_N, PREFETCH_LINES=lines,
                **({"EARLY_DEPENDENTS": True} if early and NUM_SPLITS == 1 else {})),
           num_warps=num_warps, num_stages=num_stages)
    if NUM_SPLITS > 1:
        reduce_kernel = kernel_templates.kernel("decode_merge", "decode_reduce_kernel", HQ=HQ, HEAD_DIM=D,
                                                BLOCK_D=layout["BLOCK_D"])
        launch(reduce_kernel, (B, HQ), [part_out, part_lse, out],
               dict(NUM_SPLITS=NUM_SPLITS, BLOCK_S=next_pow2(NUM_SPLITS),
                    **({"EARLY_DEPENDENTS": True} if early else {})),
               num_warps=1, num_stages=1)
    return out


def prefill_attention(q, k_cache, v_cache, slots, kv_lens, q_start, max_q_len: int, scale: float,
                      sliding_window: int | None = None):
    """q [T, HQ, D], sequence b's tokens q[q_start[b]:q_start[b+1]] -> out [T, HQ, D].

    ``max_q_len`` bounds every sequence's token count (it sizes the grid).
    """
    assert q.dim() == 3, f"q must be [T, HQ, D], got {tuple(q.shape)}"
    T, HQ, D = q.shape
    B, HKV = _check_cache(q, k_cache, v_cache, slots, kv_lens, HQ, D)
    assert q_start.dtype == torch.int32 and q_start.shape == (B + 1,), (
        f"q_start must be int32 [B + 1] = [{B + 1}], got {q_start.dtype} {tuple(q_start.shape)}")
    assert max_q_len >= 1, f"max_q_len must be >= 1, got {max_q_len}"
    BLOCK_M, BLOCK_N, num_warps, num_stages = _prefill_config(D, max_q_len)

    out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    kernel = kernel_templates.kernel("prefill_attention", "prefill_kernel", **_layout(k_cache, HQ, sliding_window))
    blocks = cdiv(max_q_len, BLOCK_M)
    constexprs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    # an artifact built before the order existed pins a kernel without LONGEST_FIRST: its grid, its binary
    takes_order = "LONGEST_FIRST" in kernel.arg_names
    longest_first = PREFILL_LONGEST_FIRST and takes_order
    if takes_order:
        constexprs["LONGEST_FIRST"] = longest_first
    grid = (HQ, B, blocks) if longest_first else (blocks, B, HQ)
    args = [q, k_cache, v_cache, slots, kv_lens, q_start, out, float(scale)]
    if "k_desc" in kernel.arg_names:  # an artifact built before TMA pins a kernel without descriptors
        args += _prefill_descriptors(q, k_cache, v_cache, BLOCK_M, BLOCK_N)
    launch(kernel, grid, args, constexprs, num_warps=num_warps, num_stages=num_stages)
    return out


def _prefill_descriptors(q, k_cache, v_cache, BLOCK_M: int, BLOCK_N: int) -> list:
    """The prefill kernel's q, K and V tensor descriptors (TMA loads), or three Nones (pointer loads): TMA where
    ``PREFILL_TMA`` is on, the head dimension needs no padding to a power of two, the tensors are 16-byte aligned
    and the cache's rows index in 32 bits."""
    T, HQ, D = q.shape
    S, L, HKV, _ = k_cache.shape
    if not (PREFILL_TMA and D == _block_d(D) and D * q.element_size() >= 16 and S * L < 2**31 and T < 2**31
            and not (q.data_ptr() % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16)):
        return [None, None, None]
    return [_descriptor(q, T, HQ * D, BLOCK_M, D), _descriptor(k_cache, S * L, HKV * D, BLOCK_N, D),
            _descriptor(v_cache, S * L, HKV * D, BLOCK_N, D)]


_DESCRIPTORS: dict[tuple, object] = {}  # validated descriptors of a meta tensor, by dtype, shape and block


def _descriptor(t: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int):
    """A ``TensorDescriptor`` of the contiguous ``t`` seen as [rows, cols], block [block_rows, block_cols]: a copy of
    one validated for a meta tensor of that dtype, shape and block, its base set to that view of ``t`` (the caller
    checks the alignment). Building and validating a descriptor costs the host ~5 us and a prefill launches this kernel
    once a layer; the copy ~1 us."""
    key = (t.dtype, rows, cols, block_rows, block_cols)
    template = _DESCRIPTORS.get(key)
    if template is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if len(_DESCRIPTORS) >= 1024:  # one a prompt length seen: start over now and then
            _DESCRIPTORS.clear()
        template = _DESCRIPTORS[key] = TensorDescriptor(torch.empty(1, dtype=t.dtype, device="meta"), [rows, cols],
                                                        [cols, 1], [block_rows, block_cols])
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = t.view(rows, cols)  # as ``TensorDescriptor.from_tensor`` of the view would hold it
    return desc
