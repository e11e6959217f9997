"""The SiLU-pair GEMM lab (bench/silu_pair_lab.py): its weight interleave and its CUDA source.

The epilogue pairs accumulator columns 2j and 2j + 1 as gate j and up j, so the lab must store the merged weight's
rows (and their scales) in that order. Compiling the source for sm_90a keeps the lab from rotting (skipped without
nvcc); it runs on the GPU in the lab itself, bit for bit against the shipped chain.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import silu_pair_lab  # noqa: E402

from mxc.kernels import nvcc  # noqa: E402


def test_interleave_puts_up_j_after_gate_j():
    i, k = 6, 3
    merged = torch.arange(2 * i * k).view(2 * i, k)
    out = silu_pair_lab.interleave(merged)
    assert torch.equal(out[0::2], merged[:i]) and torch.equal(out[1::2], merged[i:])
    assert torch.equal(silu_pair_lab.interleave(torch.arange(2 * i))[:4], torch.tensor([0, i, 1, i + 1]))


@pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")
@pytest.mark.parametrize("suffix", list(silu_pair_lab.VARIANTS))
def test_lab_kernel_compiles_for_sm90a_without_spills(suffix, tmp_path, recwarn):
    so = silu_pair_lab.compile_library(tmp_path / f"silu_pair_gemm{suffix}.so", silu_pair_lab.VARIANTS[suffix])
    assert so.is_file() and so.stat().st_size > 0
    assert not [w for w in recwarn if "spill" in str(w.message)]
