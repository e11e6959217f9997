"""bench/prefetch_lab's ``--resident`` control: its plain-load kernel reads exactly the region it names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import prefetch_lab  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel under the Triton interpreter")
@pytest.mark.parametrize("col,nbytes,rows", [(512, 1024, 16), (0, 256, 24), (128, 128, 9)])
def test_touch_reads_the_region(col, nbytes, rows):
    """Each program sums bytes [col, +nbytes) of its 8 rows (rows past ``rows`` re-read the last one) as int32
    words: the sums match torch's over the same region, and a change outside the region changes nothing."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (32, 2048), dtype=torch.uint8, generator=g)
    prefetch_lab._TOUCHED.clear()
    prefetch_lab.touch(w, nbytes, col, rows)
    (out,) = prefetch_lab._TOUCHED.values()
    idx = torch.arange(out.numel() * 8).clamp(max=rows - 1)
    words = w[idx, col:col + nbytes].contiguous().view(torch.int32).view(out.numel(), -1)
    want = words.to(torch.int64).sum(1)
    want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # int32 wrap-around, as the kernel sums
    assert torch.equal(out, want)
    before = out.clone()
    w[:, col + nbytes:] ^= 0xFF  # outside the region: the sums stay
    w[:, :col] ^= 0xFF
    w[rows:, :] ^= 0xFF
    prefetch_lab.touch(w, nbytes, col, rows)
    assert torch.equal(out, before)
