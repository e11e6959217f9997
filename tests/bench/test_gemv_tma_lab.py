"""bench/gemv_tma_lab.py's TMA-fed fp8 GEMV (a lab, timed on the GPU): its products in the interpreter, against
the product of the dequantized operands, with and without split K, at one token and a ragged three."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gemv_tma_lab as lab  # noqa: E402

from mxc.kernels import triton_fp8_quant  # noqa: E402
from mxc.loaders.quantize import quantize_fp8  # noqa: E402


@pytest.mark.parametrize("m,split", [(1, 1), (3, 2)])
def test_tma_gemv_matches_the_dequantized_product(m, split):
    g = torch.Generator().manual_seed(m)
    n, k = 128, 512
    q, s = quantize_fp8(torch.randn(n, k, generator=g) * k ** -0.5, "channel")
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    xq, xs = triton_fp8_quant._prequantize(x, m, k, False, triton_fp8_quant._quant_block(k))
    ref = (xq.float() * xs[:, None]) @ (q.float() * s[:, None]).T
    got = lab.tma_gemv(x, q, s, 64, 256, split, 3, 4).float()
    torch.testing.assert_close(got, ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())
