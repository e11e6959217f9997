"""Triton elementwise kernels (``silu_mul``, ``embedding``, ``add``) vs their torch references.

Each kernel runs (Triton's interpreter on the CPU) over ragged shapes and the model dtypes, writing into views
of larger NaN-filled buffers so that stray stores show up. ``silu_mul`` reproduces the reference's roundings and
agrees within one unit in the last place, its ``interleave`` layout bit for bit with the halves kernel on the
de-interleaved rows (and rendered as a kernel of its own); ``embedding`` and ``add`` agree bit for bit. Bad
inputs are refused.
"""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import torch_ref
from mxc.kernels.triton_elementwise import add, embedding, silu_mul
from tests.kernels.kernel_checks import (DTYPES, WIDTHS, assert_padding_untouched, assert_ulp, ids, meta, padded,
                                         record, rendered)
from tests.kernels.kernel_checks import on_device  # noqa: F401 (autouse fixture)


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


def test_silu_mul_interleave_renders_its_own_kernel():
    """The layout is a render-time constant: interleave 0 renders the halves kernel (no PAIR_BLOCK in its source,
    the same kernel as the default call); B > 0 another kernel, launched alike."""
    _, halves_kernel, _, _ = record(lambda: silu_mul(meta(5, 2 * 1152)))
    assert record(lambda: silu_mul(meta(5, 2 * 1152), interleave=0))[1] is halves_kernel
    assert "PAIR_BLOCK" not in rendered(halves_kernel)
    out, kernel, grid, cx = record(lambda: silu_mul(meta(5, 2 * 1152), interleave=64))
    assert kernel is not halves_kernel and (kernel.fn.__name__, grid, cx) == ("silu_mul_kernel", (5, 2), {})
    assert "I: tl.constexpr = 1152\n    BLOCK_N: tl.constexpr = 1024\n    PAIR_BLOCK: tl.constexpr = 64" in \
        rendered(kernel)
    assert out.shape == (5, 1152)


@pytest.mark.parametrize("interleave", [48, 128, -64, 1.5])
def test_silu_mul_rejects_bad_interleave(interleave):
    """interleave must be 0 or a power of two dividing I (192 here)."""
    with pytest.raises(ValueError, match="interleave must be 0"):
        silu_mul(torch.randn(2, 2 * 192), interleave=interleave)


@pytest.mark.parametrize("call, message", [
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
    (lambda: silu_mul(torch.randn(4, 7)), "even"),
    (lambda: embedding(torch.zeros(3, dtype=torch.int32), torch.randn(5, 8)), "int64"),
    (lambda: add(torch.randn(4, 8), torch.randn(4, 8).half()), "must match"),
])
def test_elementwise_reject_bad_inputs(call, message):
    with pytest.raises(AssertionError, match=message):
        call()
