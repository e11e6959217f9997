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

``--resident`` asks instead how much a GEMV gains from bytes already in L2, the launches alike:

    own:    ask(w_i: a region of its rows), delay(--resident-delay-us), GEMV(w_i)
    other:  ask(w_j: the same region of another copy), delay, GEMV(w_i)

where ``ask`` is a prefetch every 128 bytes (a line), every 32 (a sector), or plain loads of the region, and
the GEMVs are the decode step's fp8 ones as shipped (gate/up with its SiLU epilogue on interleaved rows, down
weight-only). The delay (the printed figure is the measured one) lets the lines land while HBM is otherwise
idle; "other" costs the same launches and traffic and leaves nothing of w_i in L2. Regions are
``col:bytes:rows``: bytes [col, +bytes) of rows [0, rows).

Measured on one H200 (2026-12-03, 10.6 us delay), what the gate/up GEMV (32.4 us alone) gains: 16.8 MB as
bytes 512-1535 of its first 16384 rows (4.0 us at the copy rate) 0.62 us prefetched a line at a time, 0.48 a
sector at a time, 2.32 read by loads; as whole rows of its first 4096 rows -0.56 / -0.49 / 0.47; 14.7 MB as
the first 512 B of every row 0.44 / 0.46 / 1.08. The down GEMV (16.8 us), 16.8 MB of whole rows: 0.59 / 0.51 /
0.96. Bytes in L2 buy a streaming GEMV at most about half their HBM time, and prefetch instructions far less.
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
def _region(w_ptr, N: tl.constexpr, ROW_BYTES: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr,
            STEP: tl.constexpr):
    """Addresses every STEP bytes of bytes [0, P) of rows [pid * ROWS, +ROWS) (capped at row N - 1) of a
    row-major byte matrix [N, ROW_BYTES]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, P // STEP) * STEP
    return w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * ROW_BYTES + cols[None, :]


@triton.jit
def _prefetch_kernel(w_ptr, N: tl.constexpr, ROW_BYTES: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr,
                     STEP: tl.constexpr = 128):
    """Ask L2 for ``_region``: one prefetch every STEP bytes."""
    ptrs = _region(w_ptr, N, ROW_BYTES, P, ROWS, STEP)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _touch_kernel(w_ptr, out_ptr, N: tl.constexpr, ROW_BYTES: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr):
    """``_region`` read with plain loads, as int32 words summed into out[pid]."""
    v = tl.load(_region(w_ptr, N, ROW_BYTES, P, ROWS, 4).to(tl.pointer_type(tl.int32)))
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(v, axis=1), axis=0))


@triton.jit
def _delay_kernel(out_ptr, iters):
    x = tl.load(out_ptr)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(out_ptr, x)


def prefetch(w: torch.Tensor, p: int, col: int = 0, rows: int | None = None, step: int = 128) -> None:
    """Ask L2 for bytes [col, col + p) of rows [0, rows) (every row by default) of ``w``, a prefetch every
    ``step`` bytes."""
    wb = w.view(torch.uint8)
    n, row = wb.shape
    rows = n if rows is None else rows
    _prefetch_kernel[(triton.cdiv(rows, 8),)](wb[:, col:], N=rows, ROW_BYTES=row, P=p, ROWS=8, STEP=step,
                                              num_warps=4)


def prefetch32(w: torch.Tensor, p: int, col: int = 0, rows: int | None = None) -> None:
    """``prefetch`` with one prefetch every 32 bytes (an L2 sector) instead of every 128 (a line)."""
    prefetch(w, p, col, rows, step=32)


_TOUCHED = {}  # touch's sums by grid size: one buffer each, so a captured graph replays into the same memory


def touch(w: torch.Tensor, p: int, col: int = 0, rows: int | None = None) -> None:
    """``prefetch``'s region read into registers (plain loads) instead of asked of L2."""
    wb = w.view(torch.uint8)
    n, row = wb.shape
    rows = n if rows is None else rows
    grid = triton.cdiv(rows, 8)
    out = _TOUCHED.setdefault(grid, torch.zeros(grid, dtype=torch.int32, device=w.device))
    _touch_kernel[(grid,)](wb[:, col:], out, N=rows, ROW_BYTES=row, P=p, ROWS=8, num_warps=4)


def resident(args, delay_for) -> None:
    """``--resident``: each shipped fp8 GEMV after a region of its own weight was brought into L2 (three ways),
    against the same launches bringing in another copy's."""
    k = 4096
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    it = delay_for(args.resident_delay_us)
    scratch = torch.zeros(1, device="cuda")
    delay = lambda: _delay_kernel[(1,)](scratch, it, num_warps=1)  # noqa: E731
    print(f"delay {time_us(lambda i: delay(), 32):.1f} us", flush=True)
    cases = {"gate_up": (28672, 4096, lambda w, s: triton_fp8.qlinear_small_m(x, w, s, epilogue="silu_mul",
                                                                               interleave=64)),
             "down": (4096, 14336, lambda w, s: triton_fp8.qlinear_small_m(h, w, s))}
    names = (args.shapes or ",".join(cases)).split(",")
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"--resident times {' and '.join(cases)}, not {', '.join(unknown)}")
    for name in names:
        n, kk, gemv = cases[name]
        q, s = quantize_fp8(torch.randn(n, kk) * kk ** -0.5, "channel")
        copies = max(3, copies_for(n * kk))
        ws, s = [q.cuda().clone() for _ in range(copies)], s.cuda()
        alone = time_us(lambda i: gemv(ws[i % copies], s), 32)
        base = time_us(lambda i: (delay(), gemv(ws[i % copies], s)), 32)
        print(f"fp8 {name} [{n}, {kk}] {n * kk / 1e6:.1f} MB: alone {alone:.2f} us, after the delay {base:.2f}",
              flush=True)
        for region in args.regions.split(","):
            col, p, rows = (int(v) for v in region.split(":"))
            if col + p > kk or rows > n:
                print(f"  region {region}: past the [{n}, {kk}] weight, skipped", flush=True)
                continue
            mb = p * rows / 1e6
            for label, ask in (("prefetch", prefetch), ("prefetch32", prefetch32), ("loads", touch)):
                own = time_us(lambda i: (ask(ws[i % copies], p, col, rows), delay(), gemv(ws[i % copies], s)), 32)
                other = time_us(lambda i: (ask(ws[(i + 1) % copies], p, col, rows), delay(),
                                           gemv(ws[i % copies], s)), 32)
                print(f"  {label}: bytes [{col}, +{p}) of {rows} rows ({mb:.1f} MB, {mb / 4.2:.1f} us at 4.2 TB/s): "
                      f"own {own:.2f} other {other:.2f} us: the GEMV {other - own:+.2f} us faster", flush=True)
        del ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-us", default="3,6")
    ap.add_argument("--shapes", default=None, help="default: qkv,o,gate_up,down; with --resident gate_up,down")
    ap.add_argument("--p", default="2048,4096,8192,16384", help="bytes a row to prefetch")
    ap.add_argument("--resident", action="store_true", help="time GEMVs with part of their bytes in L2 (above)")
    ap.add_argument("--resident-delay-us", type=float, default=10.0)
    ap.add_argument("--regions", default="512:1024:16384,0:4096:4096,0:4096:8192,0:2048:16384,0:4096:12288",
                    help="--resident: col:bytes:rows, comma-separated")
    args = ap.parse_args()
    scratch = torch.zeros(1, device="cuda")

    def delay_for(us: float) -> int:  # calibrate the spin's iterations to ~us
        lo = 256
        t = time_us(lambda i: _delay_kernel[(1,)](scratch, lo, num_warps=1), 16)
        return max(1, int(lo * us / t))

    if args.resident:
        resident(args, delay_for)
        return

    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for name in (args.shapes or "qkv,o,gate_up,down").split(","):
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
