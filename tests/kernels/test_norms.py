"""Triton norm kernels (``rms_norm``, ``add_rms_norm``) vs their torch references.

Each kernel runs (Triton's interpreter on the CPU) over ragged shapes and the model dtypes, writing into views
of larger NaN-filled buffers so that stray stores show up. The kernels reproduce the reference's roundings:
outputs agree within one unit in the last place (float32 within its tolerance), the new residual bit for bit;
rows whose mean square is of the order of eps check that eps counts. Bad inputs are refused.
"""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import torch_ref
from mxc.kernels.triton_norm import add_rms_norm, rms_norm
from tests.kernels.kernel_checks import DTYPES, EPS, ROWS, WIDTHS, assert_padding_untouched, assert_ulp, ids, padded
from tests.kernels.kernel_checks import on_device  # noqa: F401 (autouse fixture)


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
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(4), EPS), "weight has 4 features"),
    (lambda: add_rms_norm(torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8), EPS), "residual"),
])
def test_norms_reject_bad_inputs(call, message):
    with pytest.raises(AssertionError, match=message):
        call()
