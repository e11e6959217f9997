"""The fp8 prefill's MLP middle: the shipped chain against the SiLU-and-mul epilogue GEMM (``triton_fp8_silu_gemm``).

From the gate/up linear's quantized input (xq, xs) to the down linear's (hq, hs), Llama-3-8B shapes (hidden 4096,
intermediate 14336), per layer:

- shipped: the CUTLASS gate/up GEMM (bf16 [M, 28672] out), then the quantize kernel with the SiLU-and-mul
  prologue (``triton_fp8_quant._prequantize``);
- silu-gemm: the Triton GEMM with SiLU-and-mul in its epilogue (bf16 h [M, 14336] and row maxima out), then
  ``quantize_max``; over tile configs.

Each variant runs ``--layers`` distinct weights in turn (more bytes than L2) back to back, ``--reps`` calls timed
with CUDA events, in ``--rounds`` interleaved rounds (the GPU's power limit moves every figure over a run; the
medians of the rounds are compared). Also each piece alone, ``torch._scaled_mm`` on the merged GEMM, and the
variants' outputs against the shipped chain's. Needs the CUTLASS library: ``MXC_CUTLASS_LIBRARY`` names it.

    python bench/silu_gemm_lab.py [--m 2048] [--configs all|default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import cutlass_fp8, triton_fp8_quant  # noqa: E402
from mxc.kernels import triton_fp8_silu_gemm as sg  # noqa: E402

HIDDEN, INTER = 4096, 14336
C = sg.SiluGemmConfig
CONFIGS = {
    "default": C(),
    "128x64x128 w8 s3 g8": C(GROUP_M=8),
    "128x64x128 w8 s4 g16": C(num_stages=4, GROUP_M=16),
    "128x128x128 w8 s3 g16": C(BLOCK_N=128, GROUP_M=16),
    "128x128x64 w8 s4 g16": C(BLOCK_N=128, BLOCK_K=64, num_stages=4, GROUP_M=16),
    "128x128x64 w8 s5 g16": C(BLOCK_N=128, BLOCK_K=64, num_stages=5, GROUP_M=16),
    "256x64x128 w8 s3 g8": C(BLOCK_M=256, GROUP_M=8),
    "64x128x128 w4 s4 g32": C(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, GROUP_M=32),
}


def silu_quant_wait(x, block_k=2048, num_warps=4):
    """``triton_fp8_quant._silu_quant_wait`` into new outputs."""
    M, K = x.shape[0], x.shape[1] // 2
    xq = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((M,), dtype=torch.float32, device=x.device)
    triton_fp8_quant._silu_quant_wait(x, M, K, xq, xs, block_k, num_warps)
    return xq, xs


def graphed(fn, layers: int):
    """fn(layer) for each layer captured as a CUDA graph; returns replay(layer) (host launch costs out of the way)."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    graphs = []
    for i in range(layers):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(i)
        graphs.append(g)
    return lambda i: graphs[i].replay()


def timed(fn, layers: int, reps: int) -> float:
    """us a call of fn(layer) over ``reps`` back-to-back calls cycling the layers."""
    for i in range(layers):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(i % layers)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def paired(variants: dict, layers: int, reps: int) -> dict[str, float]:
    """Median us a call of each variant, the variants taking turns call by call (each call between its own two
    events, back to back with the others'), so that every variant sees the same clocks."""
    names = list(variants)
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for n in names}
    for n in names:
        for i in range(layers):
            variants[n](i)
    for r in range(reps):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]  # rotate who goes first
            a, b = events[n][r]
            a.record()
            variants[n](r % layers)
            b.record()
    torch.cuda.synchronize()
    return {n: statistics.median(a.elapsed_time(b) * 1e3 for a, b in events[n]) for n in names}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="all", help="all, or names of CONFIGS joined by ';'")
    p.add_argument("--quant-only", action="store_true", help="only the quantize kernels")
    args = p.parse_args()
    M, dev = args.m, "cuda"
    gemm = cutlass_fp8.use(os.environ[cutlass_fp8.PREBUILT_ENV])
    stream = torch.cuda.current_stream().cuda_stream
    workspace = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
    torch.manual_seed(0)
    xq = (torch.randn(M, HIDDEN, device=dev) * 2).to(torch.float8_e4m3fn)
    xs = torch.rand(M, device=dev) / 50 + 0.01
    ws = [(torch.randn(2 * INTER, HIDDEN, device=dev) * 3).to(torch.float8_e4m3fn) for _ in range(args.layers)]
    ss = [torch.rand(2 * INTER, device=dev) / 100 + 0.005 for _ in range(args.layers)]
    gu = torch.empty(M, 2 * INTER, dtype=torch.bfloat16, device=dev)
    block = triton_fp8_quant._quant_block(INTER)

    def cutlass_gate_up(i):
        gemm(xq.data_ptr(), ws[i].data_ptr(), xs.data_ptr(), ss[i].data_ptr(), gu.data_ptr(), M, 2 * INTER, HIDDEN,
             stream=stream, workspace=workspace.data_ptr(), workspace_bytes=workspace.numel())

    def shipped(i):
        cutlass_gate_up(i)
        return triton_fp8_quant._prequantize(gu, M, INTER, True, block)

    names = list(CONFIGS) if args.configs == "all" else args.configs.split(";")
    variants = {"shipped": shipped}
    for name in names:
        variants[f"silu-gemm {name}"] = (lambda cfg: lambda i: sg.silu_mul_quantized(xq, xs, ws[i], ss[i],
                                                                                       config=cfg))(CONFIGS[name])
    print(f"M = {M}, {torch.cuda.get_device_name()}, CUTLASS {gemm.name}, {args.layers} layers' weights, "
          f"{args.reps} calls a round, {args.rounds} rounds")

    cutlass_gate_up(0)
    if not args.quant_only:
        # the outputs against the shipped chain's (the same inputs; the GEMMs sum in other orders)
        ref_q, ref_s = shipped(0)
        ref = ref_q.float() * ref_s[:, None]
        for name, fn in variants.items():
            q, s = fn(0)
            got = q.float() * s[:, None]
            codes = (q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean().item()
            print(f"  {name:28s} max |diff| / max |ref| {((got - ref).abs().max() / ref.abs().max()).item():.2e}, "
                  f"codes differing {codes:.2e}, scales rel {((s - ref_s).abs() / ref_s).max().item():.1e}")

        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, t in paired(variants, args.layers, args.reps).items():
                times[name].append(t)
        base = statistics.median(times["shipped"])
        print(f"{'variant (calls taking turns)':30s} {'median us':>9s}  rounds                 saved over 32 layers")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:30s} {med:9.1f}  {' '.join(f'{t:6.1f}' for t in ts)}   {(base - med) * 32 / 1e3:+.2f} ms")

        # the pieces: the GEMMs taking turns, then the quantize kernels taking turns
        flops = 2 * M * 2 * INTER * HIDDEN
        gemms = {"CUTLASS gate/up": cutlass_gate_up,
                 "_scaled_mm gate/up": lambda i: torch._scaled_mm(xq, ws[i].t(), scale_a=xs[:, None],
                                                                  scale_b=ss[i][None, :], out_dtype=torch.bfloat16)}
        for name in names:
            gemms[f"silu-gemm {name}"] = (lambda cfg: lambda i: sg.silu_gemm(xq, xs, ws[i], ss[i], config=cfg))(
                CONFIGS[name])
        for name, t in paired(gemms, args.layers, args.reps).items():
            print(f"  {name:30s} {t:6.1f} us ({flops / t / 1e6:4.0f} TFLOP/s)")
    h, pmax = sg.silu_gemm(xq, xs, ws[0], ss[0])
    ref_q, ref_s = triton_fp8_quant._prequantize(gu, M, INTER, True, block)
    for block_k, warps in ((1024, 4), (2048, 4), (4096, 8), (2048, 8)):
        q, s_ = silu_quant_wait(gu, block_k, warps)
        torch.cuda.synchronize()
        same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s_, ref_s)
        print(f"  the waiting SiLU quantize, {block_k} columns a program: {'bit for bit' if same else 'DIFFERS'}")
    quants = {"SiLU quantize (shipped)": lambda i: triton_fp8_quant._prequantize(gu, M, INTER, True, block)}
    for block_k, warps in ((1024, 4), (2048, 4), (4096, 8), (2048, 8)):
        quants[f"SiLU quantize waiting, {block_k} cols, {warps} warps"] = (lambda b, w: lambda i: silu_quant_wait(gu, b, w))(
            block_k, warps)
    for block_k, warps in ((1024, 4), (2048, 4), (4096, 8)):
        quants[f"quantize_max {block_k} cols, {warps} warps"] = (
            lambda b, w: lambda i: sg.quantize_max(h, pmax, b, w))(block_k, warps)
    quants = {name: graphed(fn, 1) for name, fn in quants.items()}
    for name, t in paired(quants, 1, args.reps).items():
        nbytes = gu.numel() * 2 + h.numel() if name.startswith("SiLU") else h.numel() * 3 + pmax.numel() * 4
        print(f"  {name:30s} {t:6.1f} us ({nbytes / t / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
