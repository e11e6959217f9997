"""The persistent attention block lab (bench/attn_block_lab.py): its weight layout and its CUDA source.

The kernel reads a weight row's 16-byte chunk c (of every 128 bytes) at c ^ (row & 7) in shared memory; the lab's
``swizzle`` must store it there, or the products are wrong on the GPU only. Compiling the source for sm_90a keeps
the lab from rotting (skipped without nvcc); it runs on the GPU in the lab itself, against the kernel chain.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import attn_block_lab  # noqa: E402

from mxc.kernels import nvcc  # noqa: E402


def kernel_offset(row: int, k: int) -> int:
    """Where the kernel's ldmatrix reads byte k of a row (``gemv_tiles``: off = (k & ~127) + ((chunk ^ row) << 4))."""
    return (k & ~127) + ((((k & 127) >> 4) ^ (row & 7)) << 4) + (k & 15)


@pytest.mark.parametrize("rows,cols", [(16, 128), (48, 256), (40, 384)])
def test_swizzle_puts_each_byte_where_the_kernel_reads_it(rows, cols):
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=g)
    stored = attn_block_lab.swizzle(w.view(torch.float8_e4m3fn)).view(torch.uint8)
    read = torch.tensor([[int(stored[r, kernel_offset(r, k)]) for k in range(cols)] for r in range(rows)],
                        dtype=torch.uint8)
    assert torch.equal(read, w)
    assert not torch.equal(stored, w)  # rows 1..7 are permuted


@pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")
def test_lab_kernel_compiles_for_sm90a_without_spills(tmp_path, recwarn):
    so = attn_block_lab.compile_library(str(tmp_path / "attn_block_fp8.so"))
    assert so.is_file() and so.stat().st_size > 0
    assert not [w for w in recwarn if "spill" in str(w.message)]
