"""The interpreter patch of ``tests/triton_interpreter.py`` (``tests/conftest.py`` applies it), seen through the
kernels.

Under Triton's interpreter (on the CPU) bf16 downcasts round to nearest even like torch and the GPU instead of
truncating, fp8 conversions round and saturate, and ``tl.dot`` upcasts bf16 operands to fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mxc.kernels.triton_elementwise import add
from tests.kernels.kernel_checks import on_device  # noqa: F401 (autouse fixture)


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
        assert "patch_interpreter" in interpreter._convert_float.__qualname__, "conftest.py did not patch"


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
