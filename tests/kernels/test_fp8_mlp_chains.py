"""The fp8 MLP's kernel chains (``cuda_ops.rms_norm_mlp_*``) on an interleaved gate/up weight (``interleave_gate_up``)
against the halves layout, and without the residual (a tensor-parallel rank's part): the Triton chains on the CPU
(Triton interpreter), bit for bit; the CUTLASS and cuBLASLt chains are tested on the GPU
(``tests/gpu/test_cutlass_fp8_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import cuda_ops
from mxc.loaders.convert import interleave_rows
from mxc.loaders.quantize import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mlp(hidden=64, inter=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, hidden, generator=g).to(torch.float16)
    norm = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.float16)
    w_gu, s_gu = quantize_fp8(torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5, "channel")
    w_d, s_d = quantize_fp8(torch.randn(hidden, inter, generator=g) / inter ** 0.5, "channel")
    return [t.to(DEVICE) for t in (x, norm, w_gu, s_gu, w_d, s_d)]


@pytest.mark.parametrize("chain,rows", [("rms_norm_mlp_gemm", 40), ("rms_norm_mlp_small_m", 5)])
@pytest.mark.parametrize("residual", [True, False])
def test_an_interleaved_chain_equals_the_halves_chain(chain, rows, residual):
    """The same MLP with gate/up rows (and their scales) interleaved in blocks of 64 gives the halves' output bit for
    bit: each kernel of the chain reads the layout (the Triton GEMM chain's SiLU-quantize prologue; the GEMV's
    SiLU epilogue), and ``residual=False`` leaves x out."""
    x, norm, w_gu, s_gu, w_d, s_d = _mlp()
    x = x[:rows].contiguous()
    fn = getattr(cuda_ops, chain)
    halves = fn(x, norm, w_gu, s_gu, w_d, s_d, 1e-5, "channel", residual=residual)
    inter = fn(x, norm, interleave_rows(w_gu, 64).contiguous(), interleave_rows(s_gu, 64).contiguous(), w_d, s_d,
               1e-5, "channel", interleave=64, residual=residual)
    assert torch.equal(inter, halves)
    with_x = fn(x, norm, w_gu, s_gu, w_d, s_d, 1e-5, "channel")
    assert residual or not torch.equal(halves, with_x)  # the flag changes the result: the test can fail
