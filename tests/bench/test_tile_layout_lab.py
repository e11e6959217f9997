"""bench/tile_layout_lab: the tile-major copy holds each [bn, bk] tile contiguously, and the lab kernel gives the
same bits from it as from the row-major weight, both equal to the torch product."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import tile_layout_lab  # noqa: E402


def test_tile_major_puts_each_tile_in_one_piece():
    w = torch.arange(8 * 12).view(8, 12)
    t = tile_layout_lab.tile_major(w, 4, 4).view(-1)
    for p in range(2):  # tile (p, j) at (p * 3 + j) * 16
        for j in range(3):
            start = (p * 3 + j) * 16
            assert torch.equal(t[start:start + 16], w[p * 4:(p + 1) * 4, j * 4:(j + 1) * 4].reshape(-1))
    assert t.numel() == w.numel()


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel under the Triton interpreter")
@pytest.mark.parametrize("n,k,bn,bk", [(128, 96, 64, 32), (64, 256, 64, 64)])
def test_lab_kernel_rows_and_tiles_agree(n, k, bn, bk):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.float8_e4m3fn)
    xq = torch.randn(1, k, generator=g).to(torch.float8_e4m3fn)
    xs = torch.tensor([0.02])
    s = torch.rand(n, generator=g) * 0.01 + 0.001
    outs = []
    for tiled in (False, True):
        out = torch.empty(1, n, dtype=torch.float32)
        wl = tile_layout_lab.tile_major(w, bn, bk) if tiled else w
        tile_layout_lab.run_lab(xq, xs, wl, s, out, bn, bk, 2, tiled)
        outs.append(out)
    want = (xq.float() @ w.float().T) * xs * s
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
