"""Does the fp8 wgmma GEMV stream faster from tile-major weights? One GEMV at a time, measured on one GPU.

The one-token e4m3 GEMVs (qkv, gate/up: ``triton_fp8_gemv``'s SWAP_AB path) read, each pipeline stage, a
[64 rows, 256 B] weight tile: 64 pieces of 256 B, one every K bytes (4 KB for Llama-3-8B). The weights are
written by the build, so they could be stored tile-major instead: each program's [BLOCK_N, BLOCK_K] tiles one
after another, every stage one contiguous 16 KB piece. A CUDA GEMV lab (2026-12-02) saw its gate/up GEMV go
from 34.1 to 32.3 us with a tile-major layout; the shipped wgmma GEMV was never timed on one.

This lab times, as ``gemv_tuning.time_us`` does (a CUDA graph of back-to-back calls over weight copies covering
4x the L2, plain launches), at one token and the Llama-3-8B shapes:

    shipped:   ``_qgemv_kernel`` with the shipped one-token config (prequantized x, channel scales)
    rows:      the lab kernel (the shipped SWAP_AB loop, nothing else) over the row-major weight
    tiles:     the same kernel over the tile-major copy (the only difference: where a tile's bytes lie)

and checks that rows and tiles give the same bits. Usage: python bench/tile_layout_lab.py [--shapes qkv,gate_up]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import triton_fp8_gemv  # noqa: E402
from mxc.kernels.gemv_tuning import LLAMA3_8B_SHAPES, copies_for, time_us  # noqa: E402
from mxc.kernels.launch import cdiv  # noqa: E402


@triton.jit
def _lab_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr):
    """y[0, cols] = (w[cols] @ xq[0]) * xs * s[cols] on e4m3 wgmma (weights the 64-row side), one row of x."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    if TILED:  # [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]: tile (pid_n, j) at (pid_n * KT + j) * BLOCK_N * BLOCK_K
        KT: tl.constexpr = K // BLOCK_K
        w_ptrs = (w_ptr + pid_n * (KT * BLOCK_N * BLOCK_K) + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K
                  + offs_k[None, :])
        STEP: tl.constexpr = BLOCK_N * BLOCK_K
    else:
        w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
        STEP: tl.constexpr = BLOCK_K
    row_ok = offs_m < 1
    x_ptrs = xq_ptr + offs_m[:, None] * K + offs_k[None, :]
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)
        xq = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        acc_t = tl.dot(w, tl.trans(xq), acc_t)
        w_ptrs += STEP
        x_ptrs += BLOCK_K
    acc = tl.trans(acc_t)
    xs = tl.load(xs_ptr + offs_m, mask=row_ok, other=0.0)
    ws = tl.load(s_ptr + offs_n)
    acc = acc * xs[:, None] * ws[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n < N)[None, :])


def tile_major(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """w [n, k] with its [bn, bk] tiles stored one after another, row of tiles by row of tiles (same shape)."""
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(n, k)


def run_lab(xq, xs, w, s, out, bn: int, bk: int, stages: int, tiled: bool) -> None:
    """out [1, n] = the lab kernel over w [n, k] e4m3 (row-major, or ``tile_major(w, bn, bk)`` with ``tiled``)."""
    n, k = w.shape
    _lab_kernel[(n // bn,)](xq, xs, w, s, out, N=n, K=k, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, TILED=int(tiled),
                            num_warps=4, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--configs", default="64:256:4,64:256:5,64:128:8,64:512:3,128:128:4",
                    help="BLOCK_N:BLOCK_K:stages of the lab kernel")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, Triton {triton.__version__}")
    print(f"{'shape':<10} {'variant':<22} {'us':>7} {'TB/s':>6}")
    for name in args.shapes.split(","):
        n, k = LLAMA3_8B_SHAPES[name]
        nbytes = n * k
        copies = copies_for(nbytes)
        ws = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
        s = torch.rand(n, device="cuda") * 0.01 + 0.001
        xq = (torch.randn(1, k, device="cuda")).to(torch.float8_e4m3fn)
        xs = torch.tensor([0.02], device="cuda")
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

        def row(variant, us):
            print(f"{name:<10} {variant:<22} {us:7.2f} {nbytes / us / 1e6:6.2f}", flush=True)

        cfg = triton_fp8_gemv.config_for(1, n, k, torch.bfloat16, "channel")
        if cfg.USE_DOT:
            consts = dict(N=n, K=k, BLOCK_M=16, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=1, USE_DOT=True,
                          BLOCK_SCALE=False, PREQUANT=True, PROLOGUE_SILU_MUL=False, SWAP_AB=True,
                          HAS_BIAS=False, HAS_RESIDUAL=False)
            if cfg.SPLIT_K == 1:
                def shipped(x, w):
                    triton_fp8_gemv._qgemv_kernel[(cdiv(n, cfg.BLOCK_N), 1)](
                        x, xs, w, s, None, None, y, 1, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                row(f"shipped {cfg.BLOCK_N}x{cfg.BLOCK_K}x{cfg.num_stages}", time_us(shipped, xq, ws))
        for spec in args.configs.split(","):
            bn, bk, st = (int(v) for v in spec.split(":"))
            if n % bn or k % bk:
                continue
            tiled = [tile_major(w, bn, bk) for w in ws]
            outs = {}
            for t, wl in ((0, ws), (1, tiled)):
                out = torch.empty_like(y)

                def lab(x, w, t=t, out=out):
                    run_lab(x, xs, w, s, out, bn, bk, st, bool(t))
                lab(xq, wl[0])
                torch.cuda.synchronize()
                outs[t] = out.clone()
                row(f"{'tiles' if t else 'rows'} {bn}x{bk}x{st}", time_us(lab, xq, wl))
            if not torch.equal(outs[0], outs[1]):
                raise SystemExit(f"{name} {spec}: tile-major output differs from row-major")
            del tiled
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
