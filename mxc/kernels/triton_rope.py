"""Fused q/k norm + rotary embedding + KV-cache write on the GPU (a generated Triton kernel), and its cos/sin tables.

``rope_qkv_write`` takes the merged projection ``qkv`` [T, (HQ + 2*HKV) * D]
(q heads, then k heads, then v heads), ``positions`` [T] int64 and fp32 tables
``cos``/``sin`` [P, R/2] (from ``rope_tables``), and for every token:
optionally RMS-normalises each q and k head over D (Qwen3 ``q_norm``/``k_norm``
[D]) or the whole q and k projections (OLMoE: [HQ*D] and [HKV*D]), rotates the
first R features of every q and k head with the Hugging Face rotate-half
convention (features R..D pass through), returns q [T, HQ, D] and writes k and
the untouched v into row ``cache_loc[t]`` of the caches viewed as [S*L, HKV, D].
Up to ``GROUPED_MAX_TOKENS`` tokens (decode), without a norm or with the per-head one,
program (t, g) of a (T, HKV) grid handles kv group g of token t: its HQ/HKV q heads as
one [HQ/HKV, D] tile, k head g and v head g, so a decode step of a few tokens spreads
over T*HKV programs instead of T. More tokens (prefill), and the norm over the whole
projections (it needs every head of the token), take one program per token.

Numerics reproduce ``torch_ref`` (``split``/``heads``/``rms_norm``/``rope``) op
for op in the model dtype: the normalised head is rounded before and after the
weight multiply, cos/sin are rounded to the model dtype as ``rope.cos_sin``
returns them, and ``x*cos``, ``rotate_half(x)*sin`` and their sum are each
rounded, all computed in fp32. (The interpreter matches the reference bit for bit;
on the GPU, Triton's default fp fusion contracts ``round(x*cos) + round(...)`` into
one fma, which can differ from eager torch by an ulp of the larger product.)

The kernel is rendered per head layout from
``kernels/templates/rope_qkv_write.py.j2``; the q/k norm variant (none, per
head: one kv group per program, or over the whole projection: one token's heads are
one tile, so it is one reduction over the tile) is a template branch. A program
loads the position and cache row before ``pdl_enter`` (step inputs, written before the
step starts), then cos/sin and all its loads of qkv and the norm weights, then computes,
then stores: the loads overlap. The helpers below split a head tile's work that way
(``rope_cos_sin``, ``load_heads``, ``load_norm_weight``, then ``norm_rope``); the
rotate-half partner of each feature is loaded a second time (same cache lines) instead
of shuffling registers, and every operand is loaded at its tile's shape so that no
layout conversion (shared memory and barriers) comes between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels import kernel_templates
from mxc.kernels import rope as rope_ref
from mxc.kernels.launch import launch, next_pow2


# Token counts up to this many spread each token over its kv groups (a (T, HKV) grid: decode); more
# tokens (prefill) take one program per token, which measured faster there (H200, Llama-3-8B shape,
# 2048 tokens: 491 us a prefill against 680 us for the (T, HKV) grid).
GROUPED_MAX_TOKENS = 32


@triton.jit
def rope_cos_sin(cos_row, sin_row, R: tl.constexpr, BLOCK_NH: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fp32 cos and sin of one position over a [BLOCK_NH, BLOCK_D] tile of heads: feature i < R
    reads entry i % (R/2) of the [R/2] table rows (cos 1, sin 0 from R on). Loaded at the tile's shape
    (each row the same addresses), so they come in the layout of the heads they multiply, with no
    conversion through shared memory."""
    offs_d = tl.arange(0, BLOCK_D)[None, :] + 0 * tl.arange(0, BLOCK_NH)[:, None]
    rot = offs_d < R
    offs_f = offs_d % (R // 2)
    return (tl.load(cos_row + offs_f, mask=rot, other=1.0).to(tl.float32),
            tl.load(sin_row + offs_f, mask=rot, other=0.0).to(tl.float32))


@triton.jit
def load_heads(x_ptr, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_NH: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """NH heads of D features at ``x_ptr`` and their rotate-half partners (feature i < R/2 pairs with
    i + R/2, R/2 <= i < R with i - R/2; 0 from R on), loaded as they are: two [BLOCK_NH, BLOCK_D]."""
    HALF: tl.constexpr = R // 2
    offs_h = tl.arange(0, BLOCK_NH)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NH) & (offs_d < D)
    offs_partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    return (tl.load(x_ptr + offs_h * D + offs_d, mask=mask, other=0.0),
            tl.load(x_ptr + offs_h * D + offs_partner, mask=mask & (offs_d < R), other=0.0))


@triton.jit
def load_norm_weight(w_ptr, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_NH: tl.constexpr,
                     BLOCK_D: tl.constexpr, NORM_WHOLE: tl.constexpr):
    """A q/k norm weight over a [BLOCK_NH, BLOCK_D] tile of heads and at their rotate-half partners,
    fp32: per head a [D] weight (every row the same), NORM_WHOLE an [NH * D] one."""
    HALF: tl.constexpr = R // 2
    offs_h = tl.arange(0, BLOCK_NH)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NH) & (offs_d < D)
    offs_partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    if NORM_WHOLE:
        offs_w, offs_wp = offs_h * D + offs_d, offs_h * D + offs_partner
    else:
        offs_w, offs_wp = 0 * offs_h + offs_d, 0 * offs_h + offs_partner
    return (tl.load(w_ptr + offs_w, mask=mask, other=0.0).to(tl.float32),
            tl.load(w_ptr + offs_wp, mask=mask & (offs_d < R), other=0.0).to(tl.float32))


@triton.jit
def norm_rope(x, xp, w, wp, cos, sin, eps, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
              BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, NORM_WHOLE: tl.constexpr):
    """Norm (optional: per head, or with NORM_WHOLE over all NH * D features) and rotate heads ``x`` and
    their partners ``xp`` (``load_heads``) with weights ``w``/``wp`` (``load_norm_weight``) and ``cos``/
    ``sin`` (``rope_cos_sin``), rounding to x's dtype where the reference does: [BLOCK_NH, BLOCK_D] fp32."""
    DT = x.dtype
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    rot = offs_d < R
    first = offs_d < R // 2
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if HAS_NORM:
        if NORM_WHOLE:  # one RMS over the token's whole projection (masked lanes hold 0)
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (NH * D) + eps)
        else:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BLOCK_NH, 1]
        x = ((x * rstd).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)
        xp = ((xp * rstd).to(DT).to(tl.float32) * wp).to(DT).to(tl.float32)
    c = cos.to(DT).to(tl.float32)
    s = sin.to(DT).to(tl.float32)
    xc = (x * c).to(DT).to(tl.float32)
    xs = (tl.where(first, -xp, xp) * s).to(DT).to(tl.float32)
    return tl.where(rot, xc + xs, x)


def rope_tables(spec: dict, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [max_positions, rotary_dim // 2] for a normalised rope ``spec``, attention scaling included.

    Computed on ``device`` with the same ops as ``rope.cos_sin`` (``position * inv_freq``, cos/sin,
    times the scaling), so the kernel reads exactly the reference's fp32 values on that device.
    ``dynamic`` frequencies depend on the batch's longest position: no fixed table exists for them.
    """
    if spec["type"] == "dynamic":
        raise ValueError("rope_tables: 'dynamic' rope frequencies change with the sequence length; "
                         "no fixed cos/sin table exists")
    inv, scaling = rope_ref.inv_freq(spec)
    positions = torch.arange(max_positions, dtype=torch.int64, device=device)
    freqs = positions[:, None].float() * inv.to(device=device, dtype=torch.float)[None, :]  # [P, R/2]
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()


def rope_qkv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, cache_loc: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   out: torch.Tensor | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Norm (optional) + rotate q and k of ``qkv``, write k/v into the caches at ``cache_loc``; return q [T, HQ, D].

    ``num_warps`` overrides the default (``bench/small_lab.py`` times them).

    ``k_cache``/``v_cache`` [S, L, HKV, D] give HKV and D; HQ follows from ``qkv``'s width.
    ``positions`` must lie in [0, P) and ``cache_loc`` in [0, S*L): not checked (device values).
    """
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"rope_qkv_write: k_cache/v_cache must both be [S, L, HKV, D], got {tuple(k_cache.shape)} "
        f"and {tuple(v_cache.shape)}")
    HKV, D = k_cache.shape[2], k_cache.shape[3]
    assert qkv.dim() == 2 and qkv.is_contiguous(), "rope_qkv_write: qkv must be a contiguous [T, (HQ+2*HKV)*D]"
    T, width = qkv.shape
    assert width % D == 0 and width // D > 2 * HKV, (
        f"rope_qkv_write: qkv width {width} is not (HQ + 2*{HKV}) * {D} for any HQ >= 1")
    HQ = width // D - 2 * HKV
    assert HQ % HKV == 0, f"rope_qkv_write: {HQ} q heads are not a multiple of {HKV} kv heads"
    assert cos.dim() == 2 and cos.shape == sin.shape, (
        f"rope_qkv_write: cos/sin must both be [P, R/2], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32, "rope_qkv_write: cos/sin must be float32"
    R = 2 * cos.shape[1]
    assert 2 <= R <= D, f"rope_qkv_write: rotary dim {R} must be in [2, head_dim {D}]"
    assert positions.shape == (T,) and positions.dtype == torch.int64, "rope_qkv_write: positions must be int64 [T]"
    assert cache_loc.shape == (T,) and cache_loc.dtype == torch.int64, "rope_qkv_write: cache_loc must be int64 [T]"
    assert k_cache.dtype == qkv.dtype and v_cache.dtype == qkv.dtype, (
        f"rope_qkv_write: caches must hold qkv's dtype {qkv.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    assert (q_norm is None) == (k_norm is None), "rope_qkv_write: give both q_norm and k_norm or neither"
    has_qk_norm = q_norm is not None
    whole = has_qk_norm and q_norm.shape != (D,)  # over the whole projections (OLMoE), not per head
    if has_qk_norm:
        for name, w, n in (("q_norm", q_norm, HQ), ("k_norm", k_norm, HKV)):
            want = (n * D,) if whole else (D,)
            assert w.shape == want and w.dtype == qkv.dtype and w.is_contiguous(), (
                f"rope_qkv_write: {name} must be contiguous {qkv.dtype} {list(want)} (q_norm [{D}]: per head, "
                f"[{HQ * D}]: whole projection), got {w.dtype} {tuple(w.shape)}")
    for name, t in (("positions", positions), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("cache_loc", cache_loc)):
        assert t.is_contiguous(), f"rope_qkv_write: {name} must be contiguous (kernels take no strides)"
        assert t.device == qkv.device, f"rope_qkv_write: {name} on {t.device}, qkv on {qkv.device}"
    if out is None:
        out = torch.empty((T, HQ, D), dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (T, HQ, D) and out.dtype == qkv.dtype and out.is_contiguous(), (
        f"rope_qkv_write: out must be contiguous {qkv.dtype} [{T}, {HQ}, {D}], got {out.dtype} {tuple(out.shape)}")

    block_d = next_pow2(D)
    norm_args = [q_norm, k_norm] if has_qk_norm else []
    qk_norm = "whole" if whole else "head" if has_qk_norm else "none"
    if whole or T > GROUPED_MAX_TOKENS:  # one program per token, [heads, D] tiles
        block_hq = next_pow2(HQ)
        warps = max(1, min(8, block_hq * block_d // 512))
        kernel = kernel_templates.kernel("rope_qkv_write", "rope_qkv_write_kernel", HQ=HQ, HKV=HKV, D=D, R=R,
                                         BLOCK_HQ=block_hq, BLOCK_HKV=next_pow2(HKV),
                                         BLOCK_D=block_d, QK_NORM=qk_norm)
        grid = (T,)
    else:  # one kv group per program: its HQ/HKV q heads, its k and v head
        group = HQ // HKV
        block_g = next_pow2(group)
        warps = max(1, min(4, block_g * block_d // 256))
        kernel = kernel_templates.kernel("rope_qkv_write", "rope_qkv_write_kernel", HQ=HQ, HKV=HKV, D=D, R=R,
                                         GROUP=group, BLOCK_G=block_g, BLOCK_D=block_d, QK_NORM=qk_norm)
        grid = (T, HKV)
    launch(kernel, grid, [qkv, positions, cos, sin, *norm_args, out, k_cache, v_cache, cache_loc]
           + ([float(eps)] if has_qk_norm else []), {}, num_warps=num_warps or warps, num_stages=1)
    return out
