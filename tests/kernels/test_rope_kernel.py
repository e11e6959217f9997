"""The Triton rope kernel (``rope_tables``, ``rope_qkv_write``) vs the torch references.

``rope_qkv_write`` runs (Triton's interpreter on the CPU) over every rope type and the model dtypes, with and
without the q/k norm (per head or over the whole projections), grouped by kv head (decode) and one program a token
(prefill), writing q into a view of a larger NaN-filled buffer and k/v into NaN-filled caches at scattered rows, so
that stray stores show up. q and k agree with the reference within the dtype's tolerance, v bit for bit, NaN left
in every cache row not written; where the kernel reproduces the reference's roundings (no norm, or the q/k norm in
the interpreter) within one unit in the last place. The cos/sin tables equal the reference's; heads whose mean
square is of the order of eps check that eps counts. On the ``meta`` device: the grid at GROUPED_MAX_TOKENS and the
num_warps override. Bad inputs are refused.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import rope as rope_ref
from mxc.kernels import torch_ref
from mxc.kernels.triton_rope import GROUPED_MAX_TOKENS, rope_qkv_write, rope_tables
from mxc.models.rope_config import normalize_rope
from tests.kernels.kernel_checks import (DEVICE, DTYPES, EPS, ROPE_CONFIGS, assert_close, assert_padding_untouched,
                                         assert_ulp, ids, meta, padded, record, rope_spec)
from tests.kernels.kernel_checks import on_device  # noqa: F401 (autouse fixture)

P = 2048  # table rows; positions are drawn from all of them
SLOTS, MAX_LEN = 2, 6  # caches [SLOTS, MAX_LEN, HKV, D]: 12 rows, at most 7 written


# (rope type, dtype, T, D, partial rotary, (HQ, HKV), q/k norm): every type with every dtype, with and
# without q/k norm; the other axes rotate through the cases so each value meets several types and dtypes.
# D=48 and 6/3 heads leave masked lanes in the [heads, D] tiles (blocks of 64 and 8/4).
ROPE_CASES = [
    (kind, dtype, (7, 3, 1, 5)[i % 4], (16, 48, 64, 32)[(i // 2 + i // 8) % 4], (i // 2 + i // 8) % 2 == 1,
     ((4, 2), (4, 1), (6, 3))[i % 3], qk_norm)
    for i, (dtype, kind, qk_norm) in enumerate(itertools.product(DTYPES, ROPE_CONFIGS, (None, "head")))
] + [  # q/k norm over the whole projections (OLMoE), with masked heads and features
    ("default", dtype, 5, 48, False, heads, "whole") for dtype in DTYPES for heads in ((6, 3), (4, 1))
] + [  # kv groups of 1, 8 and 3 q heads (one program each), D 80 and 96, T = 1 and several, every norm variant
    ("default", torch.bfloat16, T, D, partial, heads, qk_norm)
    for (T, D, partial, heads), qk_norm in itertools.product(
        ((1, 80, True, (3, 3)), (4, 96, False, (16, 2)), (1, 96, False, (12, 4)), (3, 80, True, (6, 2))),
        (None, "head", "whole"))
] + [  # more than GROUPED_MAX_TOKENS tokens (prefill): one program per token for every norm variant
    ("default", torch.bfloat16, 33, 48, True, (6, 2), qk_norm) for qk_norm in (None, "head")
]


def rope_reference(qkv, positions, spec, k_cache, v_cache, cache_loc, q_norm, k_norm, HQ, HKV, D, eps=EPS):
    """torch_ref composition: split, (whole-projection norm), heads, (per-head norm), cos_sin + apply_rope,
    k/v into the caches."""
    q, k, v = torch_ref.split(qkv, (HQ * D, HKV * D, HKV * D))
    whole = q_norm is not None and q_norm.shape != (D,)
    if whole:
        q, k = torch_ref.rms_norm(q, q_norm, eps), torch_ref.rms_norm(k, k_norm, eps)
    q, k, v = (torch_ref.heads(t, D) for t in (q, k, v))
    if q_norm is not None and not whole:
        q, k = torch_ref.rms_norm(q, q_norm, eps), torch_ref.rms_norm(k, k_norm, eps)
    cos, sin = rope_ref.cos_sin(spec, positions, qkv.dtype)
    q, k = rope_ref.apply_rope(q, cos, sin), rope_ref.apply_rope(k, cos, sin)
    k_cache.view(-1, HKV, D)[cache_loc] = k
    v_cache.view(-1, HKV, D)[cache_loc] = v
    return q


@pytest.mark.parametrize("kind, dtype, T, D, partial, heads, qk_norm", ROPE_CASES,
                         ids=[f"{c[0]}-{ids(c[1])}-T{c[2]}-D{c[3]}{'-partial' if c[4] else ''}-hq{c[5][0]}kv{c[5][1]}"
                              f"{'-qknorm-' + c[6] if c[6] else ''}" for c in ROPE_CASES])
def test_rope_qkv_write(kind, dtype, T, D, partial, heads, qk_norm):
    HQ, HKV = heads
    torch.manual_seed(T * 100 + D)
    spec = rope_spec(kind, D, partial)
    cos, sin = rope_tables(spec, P, DEVICE)
    assert cos.shape == (P, spec["rotary_dim"] // 2)
    qkv = (torch.randn(T, (HQ + 2 * HKV) * D) * 2).to(dtype)
    positions = torch.randint(0, P, (T,))  # arbitrary order, repeats allowed
    slots = max(SLOTS, -(-T // MAX_LEN) + 1)  # room for T rows and some never written
    cache_loc = torch.randperm(slots * MAX_LEN)[:T]
    q_norm = (1 + 0.1 * torch.randn(HQ * D if qk_norm == "whole" else D)).to(dtype) if qk_norm else None
    k_norm = (1 + 0.1 * torch.randn(HKV * D if qk_norm == "whole" else D)).to(dtype) if qk_norm else None
    k_cache, v_cache = (torch.full((slots, MAX_LEN, HKV, D), float("nan"), dtype=dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    buf, q = padded((T, HQ, D), dtype)

    assert rope_qkv_write(qkv, positions, cos, sin, k_cache, v_cache, cache_loc, q_norm, k_norm, EPS, out=q) is q
    q_ref = rope_reference(qkv, positions, spec, k_ref, v_ref, cache_loc, q_norm, k_norm, HQ, HKV, D)

    assert_close(q, q_ref, dtype)
    assert_close(k_cache, k_ref, dtype, equal_nan=True)  # NaN exactly in the rows not written
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    assert_padding_untouched(buf)
    if not qk_norm and DEVICE == "cpu":
        # No fp32 reduction in between: every rounding is the reference's. On the GPU, Triton's default
        # fp fusion turns round(x*cos) + round(rot*sin) into one fma (more exact than torch's two roundings).
        assert_ulp(q, q_ref)


@pytest.mark.parametrize("T, qk_norm", [(3, "head"), (GROUPED_MAX_TOKENS + 1, "head"), (3, "whole")])
def test_rope_qkv_write_norm_eps_counts(T, qk_norm):
    """q/k heads whose mean square is of the order of eps, grouped (decode) and one program a token (prefill,
    and the whole-projection norm): the kernel's eps moves them by far more than the tolerance (EPS = 1e-6 on
    unit heads does not)."""
    torch.manual_seed(5)
    q, q_ref, k_cache, k_ref, _ = _normed_rope_case(torch.float32, qk_norm, 4, 2, 32, T, scale=0.1, eps=1e-2,
                                                    slots=-(-T // MAX_LEN) + 1)
    assert_close(q, q_ref, torch.float32)
    assert_close(k_cache, k_ref, torch.float32, equal_nan=True)


def _normed_rope_case(dtype, qk_norm, HQ, HKV, D, T, scale, eps, slots=SLOTS):
    """The RoPE kernel with q/k norms (per ``head`` or over the ``whole`` projection) against the reference, on T
    tokens of random qkv times ``scale`` at random positions and cache rows: (q, q_ref, k_cache, k_ref, cache_loc),
    the caches NaN but where written."""
    spec = rope_spec("default", D, partial=False)
    cos, sin = rope_tables(spec, P, DEVICE)
    qkv = (scale * torch.randn(T, (HQ + 2 * HKV) * D)).to(dtype)
    positions = torch.randint(0, P, (T,))
    cache_loc = torch.randperm(slots * MAX_LEN)[:T]
    q_norm = (1 + 0.1 * torch.randn(HQ * D if qk_norm == "whole" else D)).to(dtype)
    k_norm = (1 + 0.1 * torch.randn(HKV * D if qk_norm == "whole" else D)).to(dtype)
    k_cache, v_cache = (torch.full((slots, MAX_LEN, HKV, D), float("nan"), dtype=dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = rope_qkv_write(qkv, positions, cos, sin, k_cache, v_cache, cache_loc, q_norm, k_norm, eps)
    q_ref = rope_reference(qkv, positions, spec, k_ref, v_ref, cache_loc, q_norm, k_norm, HQ, HKV, D, eps=eps)
    return q, q_ref, k_cache, k_ref, cache_loc


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU contracts round(x*cos) + round(...) into one fma")
@pytest.mark.parametrize("qk_norm", ["head", "whole"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
def test_rope_qkv_write_norm_rounds_like_the_reference(dtype, qk_norm):
    """With the q/k norm, every rounding of the reference (normalised head, then times the weight, then the
    rope products and sum) is the kernel's: in the interpreter q and k agree with it bit for bit but for the
    rare element where the fp32 sum of squares, taken in another order, flips a rounding (0 to 2 of 3072
    here); skipping one rounding moves about one element in six. test_rope_qkv_write's tolerances miss it."""
    HKV, D = 2, 64
    torch.manual_seed(9)
    q, q_ref, k_cache, k_ref, cache_loc = _normed_rope_case(dtype, qk_norm, 8, HKV, D, 6, scale=2, eps=EPS)
    k, k_want = k_cache.view(-1, HKV, D)[cache_loc], k_ref.view(-1, HKV, D)[cache_loc]
    for got, want in ((q, q_ref), (k, k_want)):
        assert_ulp(got, want)
        assert int((got != want).sum()) <= got.numel() // 100, "more roundings differ than the sum order explains"


@pytest.mark.parametrize("kind", ROPE_CONFIGS)
def test_rope_tables_match_cos_sin(kind):
    spec = rope_spec(kind, 32, partial=True)
    cos, sin = rope_tables(spec, 300, DEVICE)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (300, 8)
    ref_cos, ref_sin = rope_ref.cos_sin(spec, torch.arange(300), torch.float32)  # [P, R], cat(freqs, freqs)
    assert torch.equal(cos, ref_cos[:, :8]) and torch.equal(sin, ref_sin[:, :8])


def test_rope_tables_refuse_dynamic():
    spec = normalize_rope({"max_position_embeddings": 64, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 16)
    with pytest.raises(ValueError, match="dynamic"):
        rope_tables(spec, 64, DEVICE)


def test_rope_qkv_write_grid_at_grouped_max_tokens():
    """Up to GROUPED_MAX_TOKENS tokens a (T, HKV) grid, one kv group a program; one more token, one program a
    token."""
    cos, sin = rope_tables(rope_spec("default", 48, partial=False), 64, "meta")
    for T, grid in ((GROUPED_MAX_TOKENS, (GROUPED_MAX_TOKENS, 2)), (GROUPED_MAX_TOKENS + 1, (GROUPED_MAX_TOKENS + 1,))):
        _, _, got, _ = record(lambda: rope_qkv_write(
            meta(T, (6 + 2 * 2) * 48), meta(T, dtype=torch.int64), cos, sin, meta(3, 64, 2, 48),
            meta(3, 64, 2, 48), meta(T, dtype=torch.int64), None, None, EPS))
        assert got == grid, T


@pytest.mark.parametrize("T", [5, 40])
def test_rope_qkv_write_num_warps_overrides(T):
    cos, sin = rope_tables(rope_spec("default", 48, partial=False), 64, "meta")
    warps = []
    with launch_mod.using(lambda kernel, grid, args, constexprs, nw, ns: warps.append(nw)):
        for num_warps in (None, 16):
            rope_qkv_write(meta(T, (6 + 2 * 2) * 48), meta(T, dtype=torch.int64), cos, sin, meta(3, 64, 2, 48),
                           meta(3, 64, 2, 48), meta(T, dtype=torch.int64), None, None, EPS, num_warps=num_warps)
    assert warps[0] != 16 and warps[1] == 16  # the default is not 16 warps: the override shows


def _rope_call(**change):
    """rope_qkv_write on valid arguments (T 2, HQ 4, HKV 2, D 16, R 16) but for ``change``."""
    cos, sin = rope_tables(rope_spec("default", 16, False), 8, DEVICE)
    args = dict(qkv=torch.randn(2, 8 * 16), positions=torch.zeros(2, dtype=torch.int64), cos=cos, sin=sin,
                k_cache=torch.empty(1, 4, 2, 16), v_cache=torch.empty(1, 4, 2, 16),
                cache_loc=torch.arange(2), q_norm=None, k_norm=None, eps=EPS)
    return rope_qkv_write(**{**args, **change})


@pytest.mark.parametrize("call, message", [
    (lambda: _rope_call(v_cache=torch.empty(1, 4, 1, 16)), "k_cache/v_cache must both be"),
    (lambda: _rope_call(qkv=torch.randn(8 * 16, 2).t()), "qkv must be a contiguous"),
    (lambda: _rope_call(qkv=torch.randn(2, 4 * 16)), "HQ >= 1"),
    (lambda: _rope_call(qkv=torch.randn(2, 7 * 16)), "not a multiple"),
    (lambda: _rope_call(cos=torch.zeros(8, 9), sin=torch.zeros(8, 9)), "rotary dim 18"),
    (lambda: _rope_call(sin=torch.zeros(8, 8, dtype=torch.float64)), "cos/sin must be float32"),
    (lambda: _rope_call(cos=torch.zeros(8, 8).t()), "cos must be contiguous"),
    (lambda: _rope_call(positions=torch.zeros(2, dtype=torch.int32)), "positions must be int64"),
    (lambda: _rope_call(cache_loc=torch.arange(2, dtype=torch.int32)), "cache_loc must be int64"),
    (lambda: _rope_call(v_cache=torch.empty(1, 4, 2, 16).half()), "caches must hold"),
    (lambda: _rope_call(q_norm=torch.ones(16).half(), k_norm=torch.ones(16).half()), "q_norm must be"),
    (lambda: _rope_call(out=torch.empty(2, 4, 16).half()), "out must be"),
    (lambda: rope_qkv_write(torch.randn(2, 8 * 16), torch.zeros(2, dtype=torch.int64), *rope_tables(
        rope_spec("default", 16, False), 8, DEVICE), torch.empty(1, 4, 2, 16), torch.empty(1, 4, 2, 16),
        torch.zeros(2, dtype=torch.int64), torch.ones(16), None, EPS), "both q_norm and k_norm"),
])
def test_rope_reject_bad_inputs(call, message):
    with pytest.raises(AssertionError, match=message):
        call()
