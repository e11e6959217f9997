"""Triton norm, rope and elementwise kernels vs their torch references.

Each kernel runs (Triton's interpreter on the CPU) over ragged shapes and the
model dtypes, writing into views of larger NaN-filled buffers (or NaN-filled
caches) so that stray stores show up. Where the kernel reproduces the
reference's roundings, it must agree within one unit in the last place;
elsewhere within the dtype's tolerance. Every wrapper is also run on the
``meta`` device under a recording launcher, as the build does.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import triton
import triton.language as tl

from mxc.kernels import launch as launch_mod
from mxc.kernels import rope as rope_ref
from mxc.kernels import torch_ref
from mxc.kernels import kernel_templates
from mxc.kernels.triton_elementwise import add, embedding, silu_mul
from mxc.kernels.triton_norm import add_rms_norm, rms_norm
from mxc.kernels.triton_rope import GROUPED_MAX_TOKENS, rope_qkv_write, rope_tables
from mxc.models.rope_config import normalize_rope

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}  # relative (and absolute) tolerance
ROWS, WIDTHS = (1, 3, 7), (48, 64, 100)
EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # off the GPU: Triton's interpreter
PAD = 13  # NaN elements on each side of an output view


@pytest.fixture(autouse=True)
def _on_device():
    """Create every test tensor on DEVICE (tests name "meta" explicitly where they want it)."""
    with torch.device(DEVICE):
        yield


def ids(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def padded(shape, dtype):
    """(buffer, view): a contiguous ``shape`` view in the middle of a NaN-filled buffer."""
    n = math.prod(shape)
    buf = torch.full((n + 2 * PAD,), float("nan"), dtype=dtype)
    return buf, buf[PAD:PAD + n].view(shape)


def assert_padding_untouched(buf):
    assert buf[:PAD].isnan().all() and buf[-PAD:].isnan().all(), "kernel wrote outside its output"


def assert_ulp(out, ref, ulps=1):
    """``out`` within ``ulps`` units in the last place (of ``out``'s dtype, at ``ref``'s magnitude) of ``ref``.

    For float32 the fp32 reduction order itself differs by ulps (and a weight multiply carries them on),
    so float32 uses its relative tolerance instead.
    """
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        return assert_close(out, ref, torch.float32)
    fi = torch.finfo(out.dtype)
    o, r = out.double(), ref.double()
    spacing = fi.eps * torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(fi.tiny))))
    err = (o - r).abs()
    bad = ~(err <= ulps * spacing)  # NaN counts as bad
    assert not bad.any(), (f"{int(bad.sum())}/{bad.numel()} elements off by more than {ulps} ulp; "
                           f"worst {float((err / spacing).nan_to_num(float('inf')).max()):.2f} ulp")


def assert_close(out, ref, dtype, equal_nan=False):
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=equal_nan)


# --- the interpreter patch of conftest.py ------------------------------------------------------------


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * N + offs[None, :])
    tl.store(c_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, b))


def test_interpreter_rounds_bf16_like_torch():
    torch.manual_seed(0)
    a, b = torch.randn(4, 100).bfloat16(), torch.randn(4, 100).bfloat16()
    out = add(a, b)
    assert torch.equal(out, a + b)  # round to nearest even, as torch and the GPU do
    exact = a.float() + b.float()
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    assert not torch.equal(out, truncated), "test inputs do not tell rounding from truncation"
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime import interpreter
        assert "_patch_interpreter" in interpreter._convert_float.__qualname__, "conftest.py did not patch"


def test_interpreter_fp8_rounds_and_saturates():
    a = torch.tensor([[400.0, -400.0, 1.0, 3.0]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[100.0, -100.0, 0.1, 0.25]]).to(torch.float8_e4m3fn)  # 1 + 0.1 rounds up to 1.125
    expected = (a.float() + b.float()).clamp(-448, 448).to(torch.float8_e4m3fn)  # 448 = largest e4m3fn
    assert torch.equal(add(a, b).float(), expected.float())


def test_interpreter_dot_upcasts_bf16():
    torch.manual_seed(0)
    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


# --- norms -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("T", ROWS)
def test_rms_norm(T, H, dtype):
    torch.manual_seed(T * 1000 + H)
    x = (torch.randn(T, H) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(H)).to(dtype)
    buf, out = padded((T, H), dtype)
    assert rms_norm(x, w, EPS, out=out) is out
    assert_ulp(out, torch_ref.rms_norm(x, w, EPS))
    assert_padding_untouched(buf)
    assert_ulp(rms_norm(x, w, EPS), torch_ref.rms_norm(x, w, EPS))  # allocates its output


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_rms_norm_per_head(dtype):
    """Qwen3 q/k norm: x [T, heads, D] normalised over D."""
    torch.manual_seed(1)
    x = torch.randn(3, 5, 24).to(dtype)
    w = (1 + 0.1 * torch.randn(24)).to(dtype)
    assert_ulp(rms_norm(x, w, EPS), torch_ref.rms_norm(x, w, EPS))


def test_rms_norm_fp32_weight_promotes():
    torch.manual_seed(2)
    x, w = torch.randn(3, 48).bfloat16(), 1 + 0.1 * torch.randn(48)
    out, ref = rms_norm(x, w, EPS), torch_ref.rms_norm(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    assert_ulp(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("T", ROWS)
def test_add_rms_norm(T, H, dtype):
    torch.manual_seed(T * 1000 + H + 7)
    x, r = torch.randn(T, H).to(dtype), (torch.randn(T, H) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(H)).to(dtype)
    buf, out = padded((T, H), dtype)
    rbuf, new_r = padded((T, H), dtype)
    got_r, got = add_rms_norm(x, r, w, EPS, out=out, residual_out=new_r)
    assert got_r is new_r and got is out
    s = torch_ref.add(x, r)
    assert torch.equal(new_r, s)
    assert_ulp(out, torch_ref.rms_norm(s, w, EPS))
    assert_padding_untouched(buf)
    assert_padding_untouched(rbuf)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_rms_norm_eps_counts(dtype, residual):
    """Rows whose mean square is of the order of eps: the kernel's eps moves them by far more than an ulp
    (with EPS = 1e-6 and unit rows it is below the bf16 rounding, so the tests above would miss it)."""
    torch.manual_seed(4)
    eps = 1e-2
    x = (0.1 * torch.randn(3, 64)).to(dtype)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    if residual:
        r = (0.1 * torch.randn(3, 64)).to(dtype)
        s, out = add_rms_norm(x, r, w, eps)
        assert torch.equal(s, torch_ref.add(x, r))
        x = s
    else:
        out = rms_norm(x, w, eps)
    assert_ulp(out, torch_ref.rms_norm(x, w, eps))


def test_add_rms_norm_in_place_residual():
    torch.manual_seed(3)
    x, r = torch.randn(3, 100).bfloat16(), torch.randn(3, 100).bfloat16()
    s = torch_ref.add(x, r)
    new_r, out = add_rms_norm(x, r, torch.ones(100).bfloat16(), EPS, residual_out=r)
    assert new_r is r and torch.equal(r, s)
    assert_ulp(out, torch_ref.rms_norm(s, torch.ones(100).bfloat16(), EPS))


def test_add_rms_norm_fp32_weight_promotes():
    """The new residual keeps the model dtype; only the normalised output takes the promoted dtype."""
    torch.manual_seed(6)
    x, r, w = torch.randn(3, 48).bfloat16(), torch.randn(3, 48).bfloat16(), 1 + 0.1 * torch.randn(48)
    new_r, out = add_rms_norm(x, r, w, EPS)
    s = torch_ref.add(x, r)
    assert new_r.dtype == torch.bfloat16 and torch.equal(new_r, s)
    ref = torch_ref.rms_norm(s, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    assert_ulp(out, ref)


# --- elementwise -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("I", WIDTHS + (1100,))  # 1100: two column blocks of 1024
@pytest.mark.parametrize("T", (1, 7))
def test_silu_mul(T, I, dtype):
    torch.manual_seed(T * 1000 + I)
    x = (torch.randn(T, 2 * I) * 3).to(dtype)
    buf, out = padded((T, I), dtype)
    assert silu_mul(x, out=out) is out
    assert_ulp(out, torch_ref.silu_mul(x))
    assert_padding_untouched(buf)


def test_silu_mul_3d_rows():
    """Rows are everything but the last dim: x [2, 3, 2I] is 6 rows."""
    torch.manual_seed(8)
    x = torch.randn(2, 3, 2 * 48)
    buf, out = padded((2, 3, 48), torch.float32)
    assert silu_mul(x, out=out) is out
    assert_ulp(out, torch_ref.silu_mul(x))
    assert_padding_untouched(buf)


def test_halves_undoes_the_interleave():
    """``torch_ref.halves``, the references' view of the layout: gate column j at (j // B) * 2B + j % B, its up
    column B further."""
    assert torch_ref.halves(torch.arange(8.0), 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("I, B", [(96, 16), (192, 64), (1152, 64)])  # 192: a ragged block; 1152: two column blocks
@pytest.mark.parametrize("T", (1, 5))
def test_silu_mul_interleaved(T, I, B, dtype):
    """With ``interleave`` B the kernel reads x's columns in blocks of B gate then B up: bit for bit the halves
    kernel on the same rows de-interleaved, within an ulp of the torch reference, nothing written outside out."""
    torch.manual_seed(T * 1000 + I + B)
    x = (torch.randn(T, 2 * I) * 3).to(dtype)
    ref_in = torch_ref.halves(x, B)
    assert not torch.equal(ref_in, x)  # I > B: the layouts differ
    buf, out = padded((T, I), dtype)
    assert silu_mul(x, out=out, interleave=B) is out
    assert torch.equal(out, silu_mul(ref_in))
    assert_ulp(out, torch_ref.silu_mul(ref_in))
    assert_padding_untouched(buf)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("H", WIDTHS + (1100,))
@pytest.mark.parametrize("T", (1, 7))
def test_embedding(T, H, dtype):
    torch.manual_seed(T * 1000 + H)
    table = torch.randn(37, H).to(dtype)
    tokens = torch.tensor([36, 0, 5, 5, 17, 36, 2][:T])  # repeated ids, first and last rows
    buf, out = padded((T, H), dtype)
    assert embedding(tokens, table, out=out) is out
    assert torch.equal(out, torch_ref.embedding(tokens, table))
    assert_padding_untouched(buf)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(1, 48), (3, 64), (7, 100), (2, 1100), (2, 3, 5), (17,)], ids=str)
def test_add(shape, dtype):
    torch.manual_seed(len(shape) * 100 + shape[-1])
    a, b = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    buf, out = padded(shape, dtype)
    assert add(a, b, out=out) is out
    assert torch.equal(out, torch_ref.add(a, b))
    assert_padding_untouched(buf)


def test_add_zero_dim():
    a, b = torch.tensor(1.5), torch.tensor(-0.25)
    out = add(a, b)
    assert out.shape == () and torch.equal(out, torch_ref.add(a, b))


# --- rope --------------------------------------------------------------------------------------------

ROPE_CONFIGS = {  # config.json fields, as tests/models/test_rope.py writes them
    "default": {"rope_theta": 10000.0, "max_position_embeddings": 2048},
    "linear": {"rope_theta": 10000.0, "max_position_embeddings": 2048,
               "rope_scaling": {"type": "linear", "factor": 2.0}},
    "yarn": {"rope_theta": 10000.0, "max_position_embeddings": 16384,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    "llama3": {"rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}
P = 2048  # table rows; positions are drawn from all of them
SLOTS, MAX_LEN = 2, 6  # caches [SLOTS, MAX_LEN, HKV, D]: 12 rows, at most 7 written


def rope_spec(kind: str, head_dim: int, partial: bool) -> dict:
    config = dict(ROPE_CONFIGS[kind], partial_rotary_factor=0.5 if partial else 1.0)
    return normalize_rope(config, head_dim)


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
    HQ, HKV, D, eps, dtype = 4, 2, 32, 1e-2, torch.float32
    torch.manual_seed(5)
    spec = rope_spec("default", D, partial=False)
    cos, sin = rope_tables(spec, P, DEVICE)
    qkv = (0.1 * torch.randn(T, (HQ + 2 * HKV) * D)).to(dtype)
    positions = torch.randint(0, P, (T,))
    slots = -(-T // MAX_LEN) + 1
    cache_loc = torch.randperm(slots * MAX_LEN)[:T]
    q_norm = (1 + 0.1 * torch.randn(HQ * D if qk_norm == "whole" else D)).to(dtype)
    k_norm = (1 + 0.1 * torch.randn(HKV * D if qk_norm == "whole" else D)).to(dtype)
    k_cache, v_cache = (torch.full((slots, MAX_LEN, HKV, D), float("nan"), dtype=dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = rope_qkv_write(qkv, positions, cos, sin, k_cache, v_cache, cache_loc, q_norm, k_norm, eps)
    q_ref = rope_reference(qkv, positions, spec, k_ref, v_ref, cache_loc, q_norm, k_norm, HQ, HKV, D, eps=eps)
    assert_close(q, q_ref, dtype)
    assert_close(k_cache, k_ref, dtype, equal_nan=True)


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU contracts round(x*cos) + round(...) into one fma")
@pytest.mark.parametrize("qk_norm", ["head", "whole"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
def test_rope_qkv_write_norm_rounds_like_the_reference(dtype, qk_norm):
    """With the q/k norm, every rounding of the reference (normalised head, then times the weight, then the
    rope products and sum) is the kernel's: in the interpreter q and k agree with it bit for bit but for the
    rare element where the fp32 sum of squares, taken in another order, flips a rounding (0 to 2 of 3072
    here); skipping one rounding moves about one element in six. test_rope_qkv_write's tolerances miss it."""
    HQ, HKV, D, T = 8, 2, 64, 6
    torch.manual_seed(9)
    spec = rope_spec("default", D, partial=False)
    cos, sin = rope_tables(spec, P, DEVICE)
    qkv = (torch.randn(T, (HQ + 2 * HKV) * D) * 2).to(dtype)
    positions = torch.randint(0, P, (T,))
    cache_loc = torch.randperm(SLOTS * MAX_LEN)[:T]
    q_norm = (1 + 0.1 * torch.randn(HQ * D if qk_norm == "whole" else D)).to(dtype)
    k_norm = (1 + 0.1 * torch.randn(HKV * D if qk_norm == "whole" else D)).to(dtype)
    k_cache, v_cache = (torch.full((SLOTS, MAX_LEN, HKV, D), float("nan"), dtype=dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = rope_qkv_write(qkv, positions, cos, sin, k_cache, v_cache, cache_loc, q_norm, k_norm, EPS)
    q_ref = rope_reference(qkv, positions, spec, k_ref, v_ref, cache_loc, q_norm, k_norm, HQ, HKV, D)
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


# --- ahead-of-time recording on the meta device ------------------------------------------------------


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _record(call):
    calls = []
    with launch_mod.using(lambda kernel, grid, args, constexprs, nw, ns: calls.append(
            (kernel, grid, args, constexprs, nw, ns))):
        result = call()
    assert len(calls) == 1, f"expected exactly one launch, got {len(calls)}"
    kernel, grid, args, constexprs, nw, ns = calls[0]
    assert all(isinstance(a, (torch.Tensor, int, float)) for a in args), "launch args: tensors and numbers only"
    assert all(a.device.type == "meta" for a in args if isinstance(a, torch.Tensor))
    return result, kernel, grid, constexprs


def _rendered(kernel) -> str:
    """The source the launched kernel was rendered to."""
    return kernel_templates.source(kernel.fn.__module__)


def test_wrappers_record_one_launch_on_meta():
    """Each wrapper launches one kernel rendered for its sizes (literals in the source, no constexpr
    arguments left but the PDL switch) with tensors and numbers only."""
    x, w = _meta(5, 100), _meta(100)
    out, kernel, grid, cx = _record(lambda: rms_norm(x, w, EPS))
    assert (kernel.fn.__name__, grid, cx) == ("rms_norm_kernel", (5,), {})
    assert "H: tl.constexpr = 100" in _rendered(kernel) and "residual_ptr" not in _rendered(kernel)
    assert out.device.type == "meta" and out.shape == (5, 100)

    (new_r, out), fused, grid, cx = _record(lambda: add_rms_norm(x, _meta(5, 100), w, EPS))
    assert (fused.fn.__name__, grid, cx) == ("rms_norm_kernel", (5,), {}) and fused is not kernel
    assert "residual_ptr" in _rendered(fused)
    assert new_r.shape == out.shape == (5, 100)

    _, head_norm, grid, cx = _record(lambda: rms_norm(_meta(5, 6, 24), _meta(24), EPS))  # per-head q/k norm
    assert grid == (30,) and "H: tl.constexpr = 24\n    BLOCK_H: tl.constexpr = 32" in _rendered(head_norm)
    assert _record(lambda: rms_norm(x, w, EPS))[1] is kernel  # rendered once per specialisation

    spec = rope_spec("llama3", 48, partial=True)
    cos, sin = rope_tables(spec, 64, "meta")
    assert cos.device.type == "meta" and cos.shape == (64, 12)
    for qk_norm in (None, "head", "whole"):
        qn, kn = {None: (None, None), "head": (_meta(48), _meta(48)), "whole": (_meta(6 * 48), _meta(2 * 48))}[qk_norm]
        q, kernel, grid, cx = _record(lambda: rope_qkv_write(
            _meta(5, (6 + 2 * 2) * 48), _meta(5, dtype=torch.int64), cos, sin, _meta(3, 8, 2, 48),
            _meta(3, 8, 2, 48), _meta(5, dtype=torch.int64), qn, kn, EPS))
        # one program per token and kv group; per token when the norm spans all its heads
        assert (kernel.fn.__name__, grid, cx) == ("rope_qkv_write_kernel", (5,) if qk_norm == "whole" else (5, 2), {})
        src = _rendered(kernel)
        assert "HQ: tl.constexpr = 6" in src and "R: tl.constexpr = 24" in src
        assert ("GROUP: tl.constexpr = 3" in src and "BLOCK_G: tl.constexpr = 4" in src) == (qk_norm != "whole")
        assert ("q_norm_ptr" in src) == (qk_norm is not None)
        assert q.shape == (5, 6, 48)
    for qk_norm in (None, "head"):  # prefill's token counts: one program per token
        qn, kn = (_meta(48), _meta(48)) if qk_norm else (None, None)
        q, kernel, grid, cx = _record(lambda: rope_qkv_write(
            _meta(40, (6 + 2 * 2) * 48), _meta(40, dtype=torch.int64), cos, sin, _meta(3, 64, 2, 48),
            _meta(3, 64, 2, 48), _meta(40, dtype=torch.int64), qn, kn, EPS))
        assert grid == (40,) and "BLOCK_HQ: tl.constexpr = 8" in _rendered(kernel)

    out, kernel, grid, cx = _record(lambda: silu_mul(_meta(5, 2 * 1100)))
    assert (kernel.fn.__name__, grid, cx) == ("silu_mul_kernel", (5, 2), {})
    assert "I: tl.constexpr = 1100\n    BLOCK_N: tl.constexpr = 1024" in _rendered(kernel)
    assert out.shape == (5, 1100)

    out, kernel, grid, cx = _record(lambda: embedding(_meta(5, dtype=torch.int64), _meta(256, 100)))
    assert (kernel.fn.__name__, grid) == ("embedding_kernel", (5, 1)) and "H: tl.constexpr = 100" in _rendered(kernel)
    assert out.shape == (5, 100)

    out, kernel, grid, cx = _record(lambda: add(_meta(5, 100), _meta(5, 100)))
    assert (kernel.fn.__name__, grid) == ("add_kernel", (5, 1)) and "N: tl.constexpr = 100" in _rendered(kernel)
    assert out.shape == (5, 100)


def test_rope_qkv_write_grid_at_grouped_max_tokens():
    """Up to GROUPED_MAX_TOKENS tokens a (T, HKV) grid, one kv group a program; one more token, one program a
    token."""
    cos, sin = rope_tables(rope_spec("default", 48, partial=False), 64, "meta")
    for T, grid in ((GROUPED_MAX_TOKENS, (GROUPED_MAX_TOKENS, 2)), (GROUPED_MAX_TOKENS + 1, (GROUPED_MAX_TOKENS + 1,))):
        _, _, got, _ = _record(lambda: rope_qkv_write(
            _meta(T, (6 + 2 * 2) * 48), _meta(T, dtype=torch.int64), cos, sin, _meta(3, 64, 2, 48),
            _meta(3, 64, 2, 48), _meta(T, dtype=torch.int64), None, None, EPS))
        assert got == grid, T


@pytest.mark.parametrize("T", [5, 40])
def test_rope_qkv_write_num_warps_overrides(T):
    cos, sin = rope_tables(rope_spec("default", 48, partial=False), 64, "meta")
    warps = []
    with launch_mod.using(lambda kernel, grid, args, constexprs, nw, ns: warps.append(nw)):
        for num_warps in (None, 16):
            rope_qkv_write(_meta(T, (6 + 2 * 2) * 48), _meta(T, dtype=torch.int64), cos, sin, _meta(3, 64, 2, 48),
                           _meta(3, 64, 2, 48), _meta(T, dtype=torch.int64), None, None, EPS, num_warps=num_warps)
    assert warps[0] != 16 and warps[1] == 16  # the default is not 16 warps: the override shows


def test_silu_mul_interleave_renders_its_own_kernel():
    """The layout is a render-time constant: interleave 0 renders the halves kernel (no PAIR_BLOCK in its source,
    the same kernel as the default call); B > 0 another kernel, launched alike."""
    _, halves_kernel, _, _ = _record(lambda: silu_mul(_meta(5, 2 * 1152)))
    assert _record(lambda: silu_mul(_meta(5, 2 * 1152), interleave=0))[1] is halves_kernel
    assert "PAIR_BLOCK" not in _rendered(halves_kernel)
    out, kernel, grid, cx = _record(lambda: silu_mul(_meta(5, 2 * 1152), interleave=64))
    assert kernel is not halves_kernel and (kernel.fn.__name__, grid, cx) == ("silu_mul_kernel", (5, 2), {})
    assert "I: tl.constexpr = 1152\n    BLOCK_N: tl.constexpr = 1024\n    PAIR_BLOCK: tl.constexpr = 64" in \
        _rendered(kernel)
    assert out.shape == (5, 1152)


@pytest.mark.parametrize("interleave", [48, 128, -64, 1.5])
def test_silu_mul_rejects_bad_interleave(interleave):
    """interleave must be 0 or a power of two dividing I (192 here)."""
    with pytest.raises(ValueError, match="interleave must be 0"):
        silu_mul(torch.randn(2, 2 * 192), interleave=interleave)


def _rope_call(**change):
    """rope_qkv_write on valid arguments (T 2, HQ 4, HKV 2, D 16, R 16) but for ``change``."""
    cos, sin = rope_tables(rope_spec("default", 16, False), 8, DEVICE)
    args = dict(qkv=torch.randn(2, 8 * 16), positions=torch.zeros(2, dtype=torch.int64), cos=cos, sin=sin,
                k_cache=torch.empty(1, 4, 2, 16), v_cache=torch.empty(1, 4, 2, 16),
                cache_loc=torch.arange(2), q_norm=None, k_norm=None, eps=EPS)
    return rope_qkv_write(**{**args, **change})


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm(torch.randn(4, 8).t(), torch.ones(4), EPS), "contiguous"),
    (lambda: rms_norm(torch.randn(3, 0), torch.ones(0), EPS), "non-empty last dim"),
    (lambda: rms_norm(torch.randn(3, 4), torch.ones(8)[::2], EPS), "weight must be a contiguous"),
    (lambda: rms_norm(torch.randn(3, 8), torch.ones(8, device="meta"), EPS), "weight on meta"),
    (lambda: rms_norm(torch.randn(3, 8), torch.ones(8), EPS, out=torch.empty(3, 8).half()), "rms_norm: out must"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(2, 8), torch.ones(8), EPS), "residual must be"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(4, 8, device="meta"), torch.ones(8), EPS),
     "residual on meta"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), EPS,
                          residual_out=torch.empty(4, 8).half()), "residual_out must be"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), EPS, out=torch.empty(4, 8).half()),
     "add_rms_norm: out must"),
    (lambda: silu_mul(torch.randn(8, 4).t()), "x must be contiguous"),
    (lambda: silu_mul(torch.randn(4, 0)), "empty"),
    (lambda: silu_mul(torch.randn(4, 8), out=torch.empty(4, 4).t()), "out must be contiguous"),
    (lambda: silu_mul(torch.randn(4, 8), out=torch.empty(4, 4).half()), "out must be"),
    (lambda: embedding(torch.zeros(6, dtype=torch.int64)[::2], torch.randn(5, 8)), "ids must be a contiguous"),
    (lambda: embedding(torch.zeros(3, dtype=torch.int64), torch.randn(8, 5).t()), "table must be a contiguous"),
    (lambda: embedding(torch.zeros(3, dtype=torch.int64, device="meta"), torch.randn(5, 8)), "ids on meta"),
    (lambda: embedding(torch.zeros(3, dtype=torch.int64), torch.randn(5, 0)), "table rows are empty"),
    (lambda: add(torch.randn(4, 8), torch.randn(8, 4)), "must match"),
    (lambda: add(torch.randn(4, 8), torch.randn(8, 4).t()), "contiguous"),
    (lambda: add(torch.randn(3, 0), torch.randn(3, 0)), "last dim is empty"),
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
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(4), EPS), "weight has 4 features"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8), EPS), "residual"),
    (lambda: silu_mul(torch.randn(4, 7)), "even"),
    (lambda: embedding(torch.zeros(3, dtype=torch.int32), torch.randn(5, 8)), "int64"),
    (lambda: add(torch.randn(4, 8), torch.randn(4, 8).half()), "must match"),
    (lambda: rope_qkv_write(torch.randn(2, 8 * 16), torch.zeros(2, dtype=torch.int64), *rope_tables(
        rope_spec("default", 16, False), 8, DEVICE), torch.empty(1, 4, 2, 16), torch.empty(1, 4, 2, 16),
        torch.zeros(2, dtype=torch.int64), torch.ones(16), None, EPS), "both q_norm and k_norm"),
])
def test_wrappers_reject_bad_inputs(call, message):
    with pytest.raises(AssertionError, match=message):
        call()
