"""The fp8 prefill's GEMMs, kernel by kernel: what SiLU-and-mul in the gate/up GEMM's epilogue would save.

Today a Llama-3-8B fp8 prefill layer runs the merged gate/up GEMM ([M, 4096] x [28672, 4096]^T, CUTLASS,
bf16 out: 2 x 117 MB at M = 2048 written), then one quantize kernel that reads both halves, applies
``silu(gate) * up`` (an exp and an IEEE division an element) and writes the e4m3 down input. The
alternative: the gate GEMM alone (N = 14336), then the up GEMM with an epilogue that reads the gate
output as its C operand and writes ``h = silu(C) * up`` (half the bytes), then the plain quantize of h.
The library's residual kernel (C read by TMA, added) stands in for that epilogue here: same operand
traffic, less arithmetic. Times each piece (``triton.testing.do_bench``, L2 cleared between calls) and
both totals, and every prefill GEMM shape of the layer on the library's kernel (with and without the
residual) against ``torch._scaled_mm``. Needs the CUTLASS library: ``MXC_CUTLASS_LIBRARY`` names it.

    python bench/prefill_lab.py [--m 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import cutlass_fp8, triton_fp8_quant  # noqa: E402

HIDDEN, INTER = 4096, 14336


def us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    args = p.parse_args()
    M, dev = args.m, "cuda"
    gemm = cutlass_fp8.use(os.environ[cutlass_fp8.PREBUILT_ENV])
    stream = torch.cuda.current_stream().cuda_stream
    xq = torch.randn(M, HIDDEN, device=dev).to(torch.float8_e4m3fn)
    xs = torch.rand(M, device=dev) + 0.5
    w = torch.randn(2 * INTER, HIDDEN, device=dev).to(torch.float8_e4m3fn)
    ws = torch.rand(2 * INTER, device=dev) / 100
    gu = torch.empty(M, 2 * INTER, dtype=torch.bfloat16, device=dev)
    g = torch.empty(M, INTER, dtype=torch.bfloat16, device=dev)
    h = torch.empty(M, INTER, dtype=torch.bfloat16, device=dev)
    workspace = torch.empty(1 << 24, dtype=torch.uint8, device=dev)

    def run(a, sa, b, sb, y, residual=0):
        """y = the library's GEMM of a [M, K] and b [N, K] (+ residual, a pointer)."""
        gemm(a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(), y.data_ptr(), M, b.shape[0], a.shape[1],
             stream=stream, workspace=workspace.data_ptr(), workspace_bytes=workspace.numel(), residual=residual)

    w_gate, w_up, s_gate, s_up = w[:INTER], w[INTER:], ws[:INTER], ws[INTER:]
    merged = us(lambda: run(xq, xs, w, ws, gu))
    gate = us(lambda: run(xq, xs, w_gate, s_gate, g))
    up_c = us(lambda: run(xq, xs, w_up, s_up, h, residual=g.data_ptr()))
    up_plain = us(lambda: run(xq, xs, w_up, s_up, h))
    block = triton_fp8_quant._quant_block(INTER)
    q_silu = us(lambda: triton_fp8_quant._prequantize(gu, M, INTER, True, block))
    q_plain = us(lambda: triton_fp8_quant._prequantize(h, M, INTER, False, block))
    flops = 2 * M * 2 * INTER * HIDDEN
    print(f"M = {M}, {torch.cuda.get_device_name()}, CUTLASS {gemm.name}")
    print(f"gate/up merged, N = {2 * INTER}:       {merged:7.1f} us  {flops / merged / 1e6:5.0f} TFLOP/s")
    print(f"gate alone, N = {INTER}:              {gate:7.1f} us")
    print(f"up alone, N = {INTER}:                {up_plain:7.1f} us")
    print(f"up with the gate output as C:        {up_c:7.1f} us  (the epilogue's operand traffic)")
    print(f"quantize with SiLU-and-mul, [M, 2x{INTER}]: {q_silu:6.1f} us")
    print(f"quantize of h, [M, {INTER}]:          {q_plain:7.1f} us")
    # every prefill GEMM of the layer: the library's kernel (with the residual where the model folds it) against
    # cuBLASLt's (torch._scaled_mm, row-wise scales) at the same shape
    for name, n, k, res in (("qkv", 6144, HIDDEN, False), ("o", HIDDEN, HIDDEN, True),
                            ("gate_up", 2 * INTER, HIDDEN, False), ("down", HIDDEN, INTER, True)):
        a = torch.randn(M, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(M, device=dev) + 0.5, torch.rand(n, device=dev) / 100
        y = torch.empty(M, n, dtype=torch.bfloat16, device=dev)
        c = torch.randn(M, n, device=dev).to(torch.bfloat16)
        # (each closure is timed at once, inside this iteration)
        t_cut = us(lambda: run(a, sa, b, sb, y))
        t_res = us(lambda: run(a, sa, b, sb, y, residual=c.data_ptr()))
        t_mm = us(lambda: torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :],
                                           out_dtype=torch.bfloat16))
        f = 2 * M * n * k
        print(f"{name:8s} N={n:5d} K={k:5d}: CUTLASS {t_cut:6.1f} us {f / t_cut / 1e6:5.0f} TFLOP/s, with the "
              f"residual {t_res:6.1f}{' (used)' if res else ''}; _scaled_mm {t_mm:6.1f} us {f / t_mm / 1e6:5.0f}")
    today, split = merged + q_silu, gate + up_c + q_plain
    print(f"today (merged GEMM + SiLU quantize): {today:7.1f} us a layer")
    print(f"split (gate, up with C, quantize h): {split:7.1f} us a layer  ({(today - split) * 32 / 1e3:+.2f} ms "
          f"over 32 layers saved)")


if __name__ == "__main__":
    main()
