"""cublas.linear (the large-token-count linear) against torch_ref.linear: the residual in the GEMM's
epilogue (addmm) where there is no bias, the torch composition otherwise; runs on meta tensors (AOT)."""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import cublas, torch_ref


@pytest.mark.parametrize("bias,residual,prologue", [(False, True, None), (True, True, None), (False, True, "silu_mul"),
                                                    (True, False, None), (False, False, None)])
def test_cublas_linear_matches_reference(bias, residual, prologue):
    g = torch.Generator().manual_seed(0)
    m, n, k = 40, 24, 32
    x = torch.randn(m, 2 * k if prologue else k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if residual else None
    y = cublas.linear(x, w, b, r, prologue)
    torch.testing.assert_close(y, torch_ref.linear(x, w, b, r, prologue), rtol=1e-5, atol=1e-5)
    meta = cublas.linear(*(t.to("meta") if t is not None else None for t in (x, w, b, r)), prologue)
    assert meta.shape == (m, n) and meta.device.type == "meta"
