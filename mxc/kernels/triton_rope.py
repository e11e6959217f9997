"""Triton fused q/k norm + rotary embedding + KV-cache write, and its cos/sin tables.

``rope_qkv_write`` takes the merged projection ``qkv`` [T, (HQ + 2*HKV) * D]
(q heads, then k heads, then v heads), ``positions`` [T] int64 and fp32 tables
``cos``/``sin`` [P, R/2] (from ``rope_tables``), and for every token:
optionally RMS-normalises each q and k head over D (Qwen3 ``q_norm``/``k_norm``
[D]) or the whole q and k projections (OLMoE: [HQ*D] and [HKV*D]), rotates the
first R features of every q and k head with the Hugging Face rotate-half
convention (features R..D pass through), returns q [T, HQ, D] and writes k and
the untouched v into row ``cache_loc[t]`` of the caches viewed as [S*L, HKV, D].
One program handles one token: all its heads at once, as [heads, D] tiles.

Numerics reproduce ``torch_ref`` (``split``/``heads``/``rms_norm``/``rope``) op
for op in the model dtype: the normalised head is rounded before and after the
weight multiply, cos/sin are rounded to the model dtype as ``rope.cos_sin``
returns them, and ``x*cos``, ``rotate_half(x)*sin`` and their sum are each
rounded, all computed in fp32. (The interpreter matches the reference bit for bit;
on the GPU, Triton's default fp fusion contracts ``round(x*cos) + round(...)`` into
one fma, which can differ from eager torch by an ulp of the larger product.)

Versions:
- ``rope_qkv_write_kernel``: one token per program; ``HAS_QK_NORM`` adds the
  per-head norm, with ``QK_NORM_WHOLE`` the whole-projection norm (one token's
  heads are one tile, so it is one reduction over the tile). The rotate-half partner of each feature is loaded a second
  time (same cache lines) instead of shuffling registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels import rope as rope_ref
from mxc.kernels.launch import launch
from mxc.kernels.pdl import pdl_enter


@triton.jit
def norm_rope_heads(x_ptr, w_ptr, cos_ptr, sin_ptr, eps,
                     NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_NH: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, NORM_WHOLE: tl.constexpr):
    """Load NH heads of D features at ``x_ptr``, norm (optional: per head with a [D] weight, or with
    NORM_WHOLE over all NH * D features with an [NH * D] weight) and rotate them: [BLOCK_NH, BLOCK_D] fp32."""
    HALF: tl.constexpr = R // 2
    offs_h = tl.arange(0, BLOCK_NH)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NH) & (offs_d < D)
    rot = offs_d < R
    first = offs_d < HALF
    # rotate_half: feature i < R/2 pairs with -x[i + R/2], feature R/2 <= i < R with x[i - R/2]
    offs_partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    x = tl.load(x_ptr + offs_h * D + offs_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + offs_h * D + offs_partner, mask=mask & rot, other=0.0).to(tl.float32)
    if HAS_NORM:
        if NORM_WHOLE:  # one RMS over the token's whole projection (masked lanes hold 0)
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (NH * D) + eps)
            w = tl.load(w_ptr + offs_h * D + offs_d, mask=mask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + offs_h * D + offs_partner, mask=mask & rot, other=0.0).to(tl.float32)
        else:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BLOCK_NH, 1]
            w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + offs_partner, mask=rot, other=0.0).to(tl.float32)
        x = ((x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        xp = ((xp * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * wp).to(x_ptr.dtype.element_ty).to(tl.float32)
    offs_f = offs_d % HALF
    c = tl.load(cos_ptr + offs_f, mask=rot, other=1.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    s = tl.load(sin_ptr + offs_f, mask=rot, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    xc = (x * c).to(x_ptr.dtype.element_ty).to(tl.float32)
    xs = (tl.where(first, -xp, xp) * s).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(rot, xc + xs, x)


@triton.jit
def rope_qkv_write_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                          q_ptr, k_cache_ptr, v_cache_ptr, cache_loc_ptr, eps,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_QK_NORM: tl.constexpr, QK_NORM_WHOLE: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    loc = tl.load(cache_loc_ptr + t)
    cos_row = cos_ptr + pos * (R // 2)
    sin_row = sin_ptr + pos * (R // 2)
    row_ptr = qkv_ptr + t * ((HQ + 2 * HKV) * D)

    q = norm_rope_heads(row_ptr, q_norm_ptr, cos_row, sin_row, eps, HQ, D, R, BLOCK_HQ, BLOCK_D, HAS_QK_NORM,
                         QK_NORM_WHOLE)
    offs_hq = tl.arange(0, BLOCK_HQ)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    tl.store(q_ptr + t * (HQ * D) + offs_hq * D + offs_d, q.to(q_ptr.dtype.element_ty),
             mask=(offs_hq < HQ) & (offs_d < D))

    k = norm_rope_heads(row_ptr + HQ * D, k_norm_ptr, cos_row, sin_row, eps, HKV, D, R, BLOCK_HKV, BLOCK_D,
                         HAS_QK_NORM, QK_NORM_WHOLE)
    offs_hkv = tl.arange(0, BLOCK_HKV)[:, None]
    mask_kv = (offs_hkv < HKV) & (offs_d < D)
    offs_cache = loc * (HKV * D) + offs_hkv * D + offs_d  # flat row ``loc`` of [S*L, HKV, D]
    tl.store(k_cache_ptr + offs_cache, k.to(k_cache_ptr.dtype.element_ty), mask=mask_kv)

    v = tl.load(row_ptr + (HQ + HKV) * D + offs_hkv * D + offs_d, mask=mask_kv, other=0.0).to(tl.float32)
    tl.store(v_cache_ptr + offs_cache, v.to(v_cache_ptr.dtype.element_ty), mask=mask_kv)


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
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Norm (optional) + rotate q and k of ``qkv``, write k/v into the caches at ``cache_loc``; return q [T, HQ, D].

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

    block_d = triton.next_power_of_2(D)
    block_hq, block_hkv = triton.next_power_of_2(HQ), triton.next_power_of_2(HKV)
    num_warps = max(1, min(8, block_hq * block_d // 512))
    # without q/k norm their pointers are unused: pass qkv in their place.
    launch(rope_qkv_write_kernel, (T,),
           [qkv, positions, cos, sin, q_norm if has_qk_norm else qkv, k_norm if has_qk_norm else qkv,
            out, k_cache, v_cache, cache_loc, float(eps)],
           dict(HQ=HQ, HKV=HKV, D=D, R=R, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_D=block_d,
                HAS_QK_NORM=has_qk_norm, QK_NORM_WHOLE=whole),
           num_warps=num_warps, num_stages=1)
    return out
