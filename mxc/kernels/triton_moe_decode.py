"""Fused MoE for a few tokens (decode): one GEMV per (token, chosen expert) pair, no sort.

``triton_moe.fused_moe`` sorts the T * k assignments by expert and runs grouped GEMMs on
16-row tiles: right once experts get several rows, but at batch-1 decode every expert gets one
row, and the sort costs three launches and the top-k sum a fourth, per layer. On the H200 a
Qwen3-30B-A3B step (48 layers, k = 8 of 128 experts) took 4.04 ms against a 1.44 ms bandwidth
floor, bound by ~21 launches a layer rather than bytes. Here, two kernels:

1. ``_pair_up_kernel`` (grid (T * k, cdiv(I, BLOCK_N))): program (pair p = t * k + j, n-tile):
   ``h[p, n] = silu(x[t] @ gate_e[n]^T) * (x[t] @ up_e[n]^T)``, e = ids[t, j], as a batch-1
   GEMV (``triton_gemv.dot_gate_up_rows``: fp32 partial products, one reduction at the end;
   weights widened right after the load, fp8 scaled per row at the end).
2. ``_pair_down_sum_kernel`` (grid (T, cdiv(H, BLOCK_N))): program (t, n-tile): for j < k in
   order, ``y_j = (h[t * k + j] @ down_e[n]^T) * weights[t, j]`` and their fp32 sum, rounded
   once: the top-k sum happens in registers (no ``y [T * k, H]``, no sum kernel), then the
   residual stream is added where ``fuse_linear_io`` folded the layer's add in (no add kernel).
   ``_pair_down_tile_kernel`` does the same with the k experts' rows in one tile (the default
   for a power-of-two k: measured faster, see ``config_for``).

The rounding is ``triton_moe``'s (itself the reference's): gate and up rounded to the dtype,
silu in fp32 rounded, the product rounded; each expert's output rounded, times its weight, rounded
to the weights' dtype (x's, or fp32 for Mixtral's fp32 weights: torch's promotion, ``moe_ref``); the
k terms summed in fp32 and rounded once. Weights are read once per pair: tokens sharing an expert read
it again, so this path is for a few tokens only (``candidates.MOE_PAIR_MAX_TOKENS``). Expert ids
outside [0, E) contribute nothing (their pair reads expert 0), as ``triton_moe`` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, launch, next_pow2
from mxc.kernels.pdl import pdl_enter
from mxc.kernels.triton_gemv import dot_gate_up_rows, dot_rows

@triton.jit
def _pair_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr,
                    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALE: tl.constexpr = False,
                    UNROLL: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    t = pair // TOP_K
    ty = x_ptr.dtype.element_ty
    e = tl.load(ids_ptr + pair)
    e = tl.where((e >= 0) & (e < E), e, 0)  # an invalid id reads expert 0; the down kernel drops it
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % I  # rows past I re-read valid rows; only the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * (2 * I * H) + rn[:, None] * H + offs_k[None, :]
    if BLOCK_SCALE:  # fp8 block scales [E, 2I / 128, cdiv(H, 128)]: the tiles dequantized as they are loaded
        KB: tl.constexpr = (H + 127) // 128
        s_e = s_ptr + e * (2 * I // 128 * KB)
        gate, up = dot_gate_up_rows(x_ptr + t * H + offs_k, g_ptrs, g_ptrs + I * H, H, BLOCK_N, BLOCK_K,
                                    s_e + (rn // 128) * KB, s_e + ((I + rn) // 128) * KB, UNROLL=UNROLL)
    else:
        gate, up = dot_gate_up_rows(x_ptr + t * H + offs_k, g_ptrs, g_ptrs + I * H, H, BLOCK_N, BLOCK_K,
                                    UNROLL=UNROLL)
    if s_ptr is not None and not BLOCK_SCALE:  # fp8 row scales [E, 2I]
        gate = gate * tl.load(s_ptr + e * (2 * I) + rn).to(tl.float32)
        up = up * tl.load(s_ptr + e * (2 * I) + I + rn).to(tl.float32)
    gate = gate.to(ty).to(tl.float32)
    up = up.to(ty).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
    tl.store(h_ptr + pair * I + offs_n, (act * up).to(ty), mask=offs_n < I)


@triton.jit
def _store_out(out_ptr, r_ptr, offs, mask, total):
    """The k-term sum rounded once to the output dtype; with a residual (``r_ptr`` not None), then
    r + that in fp32, rounded (``torch_ref.add``, as ``fuse_linear_io`` folded it)."""
    ty = out_ptr.dtype.element_ty
    out = total.to(ty)
    if r_ptr is not None:
        out = (tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(ty)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _pair_down_sum_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, ids_ptr, r_ptr, out_ptr,
                          E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALE: tl.constexpr = False,
                          UNROLL: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    ty = h_ptr.dtype.element_ty
    wty = weights_ptr.dtype.element_ty  # each product rounded to it: x's dtype, or fp32 weights' (unrounded)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)
    KB: tl.constexpr = (I + 127) // 128  # BLOCK_SCALE: column blocks of a down matrix
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        valid = (e >= 0) & (e < E)
        e = tl.where(valid, e, 0)
        w_ptrs = w_ptr + e * (H * I) + rn[:, None] * I + offs_k[None, :]
        if BLOCK_SCALE:  # fp8 block scales [E, cdiv(H, 128), cdiv(I, 128)]
            y = dot_rows(h_ptr + pair * I + offs_k, w_ptrs, I, BLOCK_N, BLOCK_K,
                         s_ptrs=s_ptr + e * ((H + 127) // 128 * KB) + (rn // 128) * KB, UNROLL=UNROLL)
        else:
            y = dot_rows(h_ptr + pair * I + offs_k, w_ptrs, I, BLOCK_N, BLOCK_K, UNROLL=UNROLL)
        if s_ptr is not None and not BLOCK_SCALE:  # fp8 row scales [E, H]
            y = y * tl.load(s_ptr + e * H + rn).to(tl.float32)
        wt = tl.load(weights_ptr + pair).to(tl.float32)
        total += tl.where(valid, (y.to(ty).to(tl.float32) * wt).to(wty).to(tl.float32), 0.0)
    _store_out(out_ptr, r_ptr, t * H + offs_n, offs_n < H, total)


@triton.jit
def _pair_down_tile_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, ids_ptr, r_ptr, out_ptr,
                           E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALE: tl.constexpr = False,
                           UNROLL: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """``_pair_down_sum_kernel`` with the k experts in one [TOP_K * BLOCK_N, BLOCK_K] tile a step
    (row r = expert j * BLOCK_N + n): k times the bytes in flight of an expert-by-expert loop, whose
    short reductions (I of 768) stall on each expert's first loads. Same rounding and order: the
    k terms are picked out of the tile in order (adding zeros is exact)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    ty = h_ptr.dtype.element_ty
    wty = weights_ptr.dtype.element_ty  # each product rounded to it: x's dtype, or fp32 weights' (unrounded)
    ROWS: tl.constexpr = TOP_K * BLOCK_N
    r = tl.arange(0, ROWS)
    j = r // BLOCK_N
    n = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    rn = n % H
    pair = t * TOP_K + j
    e = tl.load(ids_ptr + pair)  # [ROWS]: each row's expert (L1 hits after the first)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (e * (H * I) + rn * I)[:, None] + offs_k[None, :]
    x_ptrs = h_ptr + (pair * I)[:, None] + offs_k[None, :]  # each row's own pair input
    if BLOCK_SCALE:  # fp8 block scales [E, cdiv(H, 128), cdiv(I, 128)]
        KB: tl.constexpr = (I + 127) // 128
        y = dot_rows(x_ptrs, w_ptrs, I, ROWS, BLOCK_K, X_PER_ROW=True,
                     s_ptrs=s_ptr + e * ((H + 127) // 128 * KB) + (rn // 128) * KB, UNROLL=UNROLL)
    else:
        y = dot_rows(x_ptrs, w_ptrs, I, ROWS, BLOCK_K, X_PER_ROW=True, UNROLL=UNROLL)  # [ROWS]
    if s_ptr is not None and not BLOCK_SCALE:  # fp8 row scales [E, H]
        y = y * tl.load(s_ptr + e * H + rn).to(tl.float32)
    wt = tl.load(weights_ptr + pair).to(tl.float32)
    z = tl.where(valid, (y.to(ty).to(tl.float32) * wt).to(wty).to(tl.float32), 0.0)
    z2 = tl.reshape(z, (TOP_K, BLOCK_N))
    jj = tl.arange(0, TOP_K)[:, None]
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        total += tl.sum(tl.where(jj == i, z2, 0.0), axis=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_out(out_ptr, r_ptr, t * H + offs_n, offs_n < H, total)


@dataclass(frozen=True)
class PairConfig:
    BLOCK_N: int = 16
    BLOCK_K: int = 512
    num_warps: int = 8
    TILE: bool = False  # down only: the k experts in one tile (``_pair_down_tile_kernel``; power-of-two k)
    UNROLL: bool = False  # the K loop unrolled (``triton_gemv.dot_gate_up_rows`` / ``dot_rows``; default: up only)


UNROLL_MAX_STEPS = 16  # a pair kernel's K loop is unrolled up to this many steps (``_default_configs``: which ones)
UNROLL_SCALED = True  # fp8 (row- or block-scaled) experts: both kernels' loops (measured: ``_default_configs``)

# Field overrides of the default configs by (hidden, inter, "up" or "down"), applied after the rules: what
# ``bench/decode_ab.py`` variants set to time other tiles in the whole step.
OVERRIDES: dict[tuple[int, int, str], dict] = {}


def config_for(hidden: int, inter: int, dtype: torch.dtype, top_k: int = 8,
               scales: str | None = None) -> tuple[PairConfig, PairConfig]:
    """``_default_configs``, then ``OVERRIDES``. ``scales``: the experts' fp8 scales, "row" or "block" (128x128),
    or None for unscaled experts."""
    up, down = _default_configs(hidden, inter, dtype, top_k, scales)
    up = replace(up, **OVERRIDES.get((hidden, inter, "up"), {}))
    down = replace(down, **OVERRIDES.get((hidden, inter, "down"), {}))
    return up, down


def _default_configs(hidden: int, inter: int, dtype: torch.dtype, top_k: int = 8,
                     scales: str | None = None) -> tuple[PairConfig, PairConfig]:
    """(up, down) configs. Measured on the H200 at the Qwen3-30B-A3B shape, one token, bf16
    (``bench/moe_lab.py``, 2026-11-30; up + down per layer): the batch-1 GEMV's shape for both
    (16 rows, 1 KB steps, 8 warps) 32.1 us; up with 16 rows, 512 B steps, 4 warps and the tiled
    down with 2 rows per expert (16-row tiles for k = 8), 256 B steps, 4 warps 25.5 us
    (2.96 TB/s of expert weights). The down loop's best was 31.5 us. Elements per step stay
    those of x's dtype (fp8 experts too: measured below). A k that is not a power of two takes the loop.
    In the whole batch-1 step (2026-12-02, ``bench/decode_ab.py``, medians of three interleaved rounds): 2.556 ms
    against the down tile's 512 B steps 2.675, its 4 rows an expert 2.621, and up's 8 rows 2.580. The down tile's
    whole [16, 768] weights loaded before the PDL wait (the router's ids read early: written two kernels ahead)
    measured 2.537 / 2.580 ms at 4 / 8 warps ([8, 768]: 2.546) against 2.542: few of its 1024 programs fit beside
    the gate/up kernel's, so most still load after it (2026-12-02; removed). The down kernel's first programs
    asking L2, before the wait, for all of the token's k down matrices (25 MB; 1024 / 2048 / 4096 lines a program):
    2.712 / 2.713 / 2.754 ms against 2.544. The streamed lines slow the gate/up kernel running beside them (it
    added 18.9 us a layer instead of 15.1) for 0.35 us gained by the down kernel (2026-12-02; removed). Held in
    shared memory instead, by 256 Gluon programs of 112 KB that fit beside the gate/up kernel, the early loads
    pay: 1.6-1.7 us a layer in a 32-layer chain on an H100, but only at a max shared-memory carveout, which costs
    the whole step 1.1 us a layer: about 1.7% of the step, not wired (``bench/moe_down_smem_lab.py``, 2026-12-07).
    Larger up steps, fewer round trips a program: 1 KB steps 2.690 ms (8 warps 2.616), 2 KB at 8 warps 2.712, 32
    rows at 8 warps 2.566, against 2.538 for these defaults (2026-12-02, same method).
    The up kernel's K loop unrolled (``UNROLL``, at most ``UNROLL_MAX_STEPS`` steps; the same sums): router + experts
    + RMSNorm, 32 layers in a PDL graph (``bench/moe_fused_lab.py``, 2026-12-04), 28.51 us a layer against 29.44
    rolled; the down kernel's loop unrolled as well, 30.86, so the bf16 down config keeps its loop (in the whole
    bf16 step, ``bench/decode_ab.py``, 2026-12-04: 2.585 against 2.467 ms). fp8 experts
    gain from both (``UNROLL_SCALED``), in the whole Qwen3-30B-A3B fp8 step (``bench/decode_ab.py``, interleaved
    rounds, 2026-12-04): gate/up unrolled 2.072 against 2.145 ms (channel scales) and 2.097 against 2.170
    (block128); both unrolled 1.984 against gate/up only 2.067 (channel), and 2.013 against neither 2.178
    (block128). Their steps stay those of bf16 experts (gate/up 256 columns, down 128): 512-column gate/up steps
    measured 2.148 and 256-column down steps 2.139, against 2.067 (channel). bf16 experts at the fp8 experts' bytes
    a step (half the columns) do not gain as fp8's do (2026-12-04, same bench, five rounds): down at 64 columns
    unrolled 2.552, gate/up at 128 columns (16 unrolled steps) 2.738, both 2.829, against 2.469 ms."""
    elems = 256 // torch.empty((), dtype=dtype).element_size()  # 256 B of x
    up = PairConfig(BLOCK_N=16, BLOCK_K=max(16, min(2 * elems, next_pow2(hidden))), num_warps=4)
    up = replace(up, UNROLL=cdiv(hidden, up.BLOCK_K) <= UNROLL_MAX_STEPS)
    if top_k & (top_k - 1) == 0:
        down = PairConfig(BLOCK_N=2, BLOCK_K=max(16, min(elems, next_pow2(inter))), num_warps=4,
                          TILE=True)
    else:
        down = PairConfig(BLOCK_N=16, BLOCK_K=max(16, min(4 * elems, next_pow2(inter))))
    if scales == "block":  # steps inside one 128-column block: one scale a row (``bench/moe_lab.py``: against
        # the row-scale steps)
        up, down = (replace(c, BLOCK_K=min(c.BLOCK_K, 128)) for c in (up, down))
    if scales is not None:  # fp8 experts: both loops unrolled, or neither
        up, down = (replace(c, UNROLL=UNROLL_SCALED and cdiv(n, c.BLOCK_K) <= UNROLL_MAX_STEPS)
                    for c, n in ((up, hidden), (down, inter)))
    return up, down


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, *, s_gate_up: torch.Tensor | None = None,
              s_down: torch.Tensor | None = None, residual: torch.Tensor | None = None,
              configs: tuple[PairConfig, PairConfig] | None = None):
    """``triton_moe.fused_moe`` for a few tokens (same arguments and checks; see the module doc).
    Never reads device values on the host; runs on ``meta`` tensors."""
    from mxc.kernels.triton_moe import check_inputs

    T, H, E, I, top_k = check_inputs(x, weights, ids, w_gate_up, w_down, s_gate_up, s_down, residual)
    blocks = dict(BLOCK_SCALE=True) if s_gate_up is not None and s_gate_up.dim() == 3 else {}
    scales = None if s_gate_up is None else "block" if blocks else "row"
    up, down = configs if configs is not None else config_for(H, I, x.dtype, top_k, scales)
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    launch(_pair_up_kernel, (T * top_k, cdiv(I, up.BLOCK_N)), [x, w_gate_up, s_gate_up, ids, h],
           dict(E=E, H=H, I=I, TOP_K=top_k, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, **blocks,
                **({"UNROLL": True} if up.UNROLL else {})),
           num_warps=up.num_warps, num_stages=1)
    tile = down.TILE and top_k & (top_k - 1) == 0  # a tile's rows are a power of two
    launch(_pair_down_tile_kernel if tile else _pair_down_sum_kernel, (T, cdiv(H, down.BLOCK_N)),
           [h, w_down, s_down, weights, ids, residual, out],
           dict(E=E, H=H, I=I, TOP_K=top_k, BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, **blocks,
                **({"UNROLL": True} if down.UNROLL else {})),
           num_warps=down.num_warps, num_stages=1)
    return out
