"""Does asking L2 for the next GEMV's weights early pay? A decode-like chain, measured on one GPU.

Decode runs GEMV -> small latency-bound kernels (norm, RoPE, attention, quantize) -> GEMV. Under
PDL a GEMV prefetches only the first bytes of its own rows, and only while the one kernel right
ahead of it runs; HBM idles through the rest of the small kernels. This lab times, in a CUDA graph
of back-to-back iterations (weights cycling through copies covering 4x the L2, plain launches):

    base:      GEMV(w_i), delay
    prefetch:  GEMV(w_i), prefetch(w_{i+1}: the first P bytes of every row), delay

``delay`` is one program spinning for about as long as the small kernels between two GEMVs
(``--delay-us``); ``prefetch`` is a kernel of 8-row programs that only issue ``prefetch.global.L2``
and exit (in the product the GEMV's own programs would issue them at their end). It prints us per
iteration and the saving, per shape and P. Usage: python bench/prefetch_lab.py [--delay-us 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxc.kernels import triton_fp8, triton_gemv  # noqa: E402
from mxc.kernels.gemv_tuning import LLAMA3_8B_SHAPES, copies_for  # noqa: E402
from mxc.loaders.quantize import quantize_fp8  # noqa: E402
from moe_lab import time_us  # noqa: E402  (a CUDA graph of back-to-back calls, timed by do_bench)


@triton.jit
def _prefetch_kernel(w_ptr, N: tl.constexpr, ROW_BYTES: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr):
    """Ask L2 for bytes [0, P) of rows [pid * ROWS, +ROWS) of a row-major byte matrix [N, ROW_BYTES]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, P // 128) * 128
    ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * ROW_BYTES + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _delay_kernel(out_ptr, iters):
    x = tl.load(out_ptr)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(out_ptr, x)


def prefetch(w: torch.Tensor, p: int) -> None:
    wb = w.view(torch.uint8)
    n, row = wb.shape
    _prefetch_kernel[(triton.cdiv(n, 8),)](wb, N=n, ROW_BYTES=row, P=p, ROWS=8, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-us", default="3,6")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--p", default="2048,4096,8192,16384", help="bytes a row to prefetch")
    args = ap.parse_args()
    scratch = torch.zeros(1, device="cuda")

    def delay_for(us: float) -> int:  # calibrate the spin's iterations to ~us
        lo = 256
        t = time_us(lambda i: _delay_kernel[(1,)](scratch, lo, num_warps=1), 16)
        return max(1, int(lo * us / t))

    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for name in args.shapes.split(","):
            n, k = LLAMA3_8B_SHAPES[name]
            nbytes = n * k * (1 if dtype == torch.float8_e4m3fn else 2)
            copies = max(2, copies_for(nbytes))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            if dtype == torch.float8_e4m3fn:
                q, s = quantize_fp8(torch.randn(n, k) * k ** -0.5, "channel")
                ws, s = [q.cuda().clone() for _ in range(copies)], s.cuda()
                gemv = lambda w: triton_fp8.qlinear_small_m(x, w, s)  # noqa: E731
                label = "fp8"
            else:
                ws = [(torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype) for _ in range(copies)]
                gemv = lambda w: triton_gemv.linear_small_m(x, w)  # noqa: E731
                label = "bf16"
            alone = time_us(lambda i: gemv(ws[i % copies]), 32)
            print(f"{label} {name} [{n}, {k}] {nbytes / 1e6:.1f} MB: GEMV alone {alone:.1f} us "
                  f"({nbytes / alone / 1e6:.2f} TB/s)", flush=True)
            for d_us in [float(v) for v in args.delay_us.split(",")]:
                it = delay_for(d_us)
                delay = lambda: _delay_kernel[(1,)](scratch, it, num_warps=1)  # noqa: E731
                t_delay = time_us(lambda i: delay(), 32)
                base = time_us(lambda i: (gemv(ws[i % copies]), delay()), 32)
                line = f"  delay {t_delay:4.1f} us: GEMV + delay {base:5.1f} us"
                for p in [int(v) for v in args.p.split(",")]:
                    row = k * (1 if dtype == torch.float8_e4m3fn else 2)
                    if p > row:
                        continue
                    t = time_us(lambda i: (gemv(ws[i % copies]), prefetch(ws[(i + 1) % copies], p), delay()), 32)
                    line += f" | P={p // 1024}K ({p * n / 1e6:.0f} MB) {t:5.1f} ({base - t:+.1f})"
                print(line, flush=True)
            del ws


if __name__ == "__main__":
    main()
