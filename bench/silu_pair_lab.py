"""The fp8 prefill MLP's middle with SiLU-and-mul in the CUTLASS gate/up GEMM's epilogue (``bench/csrc/silu_pair_gemm.cu``).

From the gate/up linear's quantized input (xq, xs) to the down linear's (hq, hs), Llama-3-8B shapes (hidden 4096,
intermediate 14336):

- shipped: the CUTLASS gate/up GEMM (``cutlass_fp8``'s library, bf16 [M, 28672] out), then the quantize kernel
  with the SiLU-and-mul prologue (``triton_fp8_quant._prequantize``);
- pair: the same mainloop over the merged weight with gate and up rows interleaved, its epilogue storing h [M, 14336]
  and its row maxima per tile, then ``quantize_max`` (below: xq from the maxima, column blocks in parallel).

Checks h, the maxima and the quantized output against the shipped chain's, bit for bit, then times both and their
pieces, each call captured in a CUDA graph, the variants taking turns call by call (``--layers`` distinct weights in
turn, more bytes than L2). The lab library is compiled on a machine with nvcc (``--compile``) and carried:

    python bench/silu_pair_lab.py --compile            # on the CPU machine: build/silu_pair/silu_pair_gemm.so
    MXC_CUTLASS_LIBRARY=... python bench/silu_pair_lab.py [--m 2048]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mxc.kernels import cutlass_fp8, triton_elementwise, triton_fp8_quant  # noqa: E402
from mxc.kernels.triton_fp8_quant import _quant_recip, _row_scale  # noqa: E402

HIDDEN, INTER = 4096, 14336
LIBRARY = ROOT / "build" / "silu_pair" / "silu_pair_gemm.so"
VARIANTS = {"": (), "_store8": ("-DSILU_PAIR_STORE8",)}  # library name suffix -> nvcc flags (8-byte stores of h)


@triton.jit
def _quant_max_kernel(h_ptr, pmax_ptr, xq_ptr, xs_ptr, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Row ``program_id(0)``'s columns of xq = e4m3(h / xs), xs = max(amax / 448, 1e-12) from the row's P partial
    maxima; the first column block stores xs. Bit for bit the quantize kernel's result on h."""
    row = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    h = tl.load(h_ptr + row * K + offs_k, mask=k_ok, other=0.0)  # first: issued before the maxima's reduction
    offs_p = tl.arange(0, BLOCK_P)
    xs = _row_scale(tl.max(tl.load(pmax_ptr + row * P + offs_p, mask=offs_p < P, other=0.0), axis=0))
    if pid_k == 0:
        tl.store(xs_ptr + row, xs)
    y = tl.div_rn(1.0, xs)
    nxs = tl.where(y == 0.0, 0.0, -xs)
    tl.store(xq_ptr + row * K + offs_k, _quant_recip(h.to(tl.float32), nxs, y), mask=k_ok)


def quantize_max(h, pmax, block_k=2048, num_warps=4):
    M, K = h.shape
    xq = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=h.device)
    xs = torch.empty((M,), dtype=torch.float32, device=h.device)
    P = pmax.shape[1]
    _quant_max_kernel[(M, triton.cdiv(K, block_k))](h, pmax, xq, xs, K=K, P=P, BLOCK_P=triton.next_power_of_2(P),
                                                    BLOCK_K=block_k, num_warps=num_warps)
    return xq, xs


def compile_library(out=LIBRARY, flags=()) -> Path:
    from mxc.kernels import nvcc

    src = (ROOT / "bench" / "csrc" / "silu_pair_gemm.cu").read_text()
    return nvcc.compile_so(src, out, what="the SiLU-pair GEMM lab", include_dirs=cutlass_fp8.include_dirs(),
                           extra_flags=flags)


def interleave(t: torch.Tensor) -> torch.Tensor:
    """The merged [gate; up] rows (or row scales) of t [2I, ...] as gate_0, up_0, gate_1, up_1, ..."""
    i = t.shape[0] // 2
    return torch.stack((t[:i], t[i:]), dim=1).reshape(t.shape).contiguous()


def open_library(path):
    lib = ctypes.CDLL(str(path))
    p, i, z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.silu_pair_gemm.argtypes = [p, p, p, p, p, p, i, i, i, p, z, p]
    lib.silu_pair_gemm.restype = i
    lib.silu_pair_gemm_workspace.argtypes = [i, i, i]
    lib.silu_pair_gemm_workspace.restype = z
    return lib


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call); returns its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def paired(variants: dict, reps: int) -> dict[str, float]:
    """Median us of each variant (a list of replays, one a layer), the variants taking turns call by call."""
    names = list(variants)
    ev = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
          for n in names}
    for r in range(reps):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            a, b = ev[n][r]
            fns = variants[n]
            a.record()
            fns[r % len(fns)]()
            b.record()
    torch.cuda.synchronize()
    return {n: statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev[n]) for n in names}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true", help="build the lab library here (nvcc) and stop")
    p.add_argument("--library", action="append", help="lab libraries to time (default: those --compile builds)")
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.compile:
        for suffix, flags in VARIANTS.items():
            print(f"built {compile_library(LIBRARY.with_name(LIBRARY.stem + suffix + '.so'), flags)}")
        return
    M, dev, N, K = args.m, "cuda", 2 * INTER, HIDDEN
    shipped_gemm = cutlass_fp8.use(os.environ[cutlass_fp8.PREBUILT_ENV])
    paths = args.library or [str(LIBRARY.with_name(LIBRARY.stem + suffix + ".so")) for suffix in VARIANTS]
    libs = {Path(path).stem: open_library(path) for path in paths if Path(path).exists()}
    ws_shipped = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
    ws_pair = torch.empty(max(1, *(lib.silu_pair_gemm_workspace(M, N, K) for lib in libs.values())),
                          dtype=torch.uint8, device=dev)
    torch.manual_seed(0)
    xq = (torch.randn(M, K, device=dev) * 2).to(torch.float8_e4m3fn)
    xs = torch.rand(M, device=dev) / 50 + 0.01
    ws = [(torch.randn(N, K, device=dev) * 3).to(torch.float8_e4m3fn) for _ in range(args.layers)]
    ss = [torch.rand(N, device=dev) / 100 + 0.005 for _ in range(args.layers)]
    # interleaved rows: gate_0, up_0, gate_1, up_1, ...
    ws_il = [interleave(w) for w in ws]
    ss_il = [interleave(s) for s in ss]
    gu = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    h = torch.empty(M, INTER, dtype=torch.bfloat16, device=dev)
    pmax = torch.empty(M, N // 128, dtype=torch.float32, device=dev)
    block = triton_fp8_quant._quant_block(INTER)

    def gate_up(i):
        shipped_gemm(xq.data_ptr(), ws[i].data_ptr(), xs.data_ptr(), ss[i].data_ptr(), gu.data_ptr(), M, N, K,
                     stream=torch.cuda.current_stream().cuda_stream, workspace=ws_shipped.data_ptr(),
                     workspace_bytes=ws_shipped.numel())

    def pair(i, lib):
        status = lib.silu_pair_gemm(xq.data_ptr(), ws_il[i].data_ptr(), xs.data_ptr(), ss_il[i].data_ptr(),
                                    h.data_ptr(), pmax.data_ptr(), M, N, K, ws_pair.data_ptr(), ws_pair.numel(),
                                    torch.cuda.current_stream().cuda_stream)  # (the capture's stream in a graph)
        if status:
            raise RuntimeError(f"silu_pair_gemm: status {status}")

    print(f"M = {M}, {torch.cuda.get_device_name()}; shipped CUTLASS {shipped_gemm.name}")
    gate_up(0)
    h_ref = triton_elementwise.silu_mul(gu)
    q_ref, s_ref = triton_fp8_quant._prequantize(gu, M, INTER, True, block)
    for name, lib in libs.items():
        h.zero_()
        pair(0, lib)
        torch.cuda.synchronize()
        diff = (h.view(torch.int16) != h_ref.view(torch.int16)).float().mean().item()
        rel = ((h.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
        tiles = h.float().abs().view(M, N // 128, 64).amax(-1)
        q, s = quantize_max(h, pmax)
        same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        print(f"  {name}: h against the SiLU kernel on the shipped GEMM's output: {diff:.2e} of elements differ, max "
              f"|diff| {rel:.1e} of the scale; row maxima {'exact' if torch.equal(tiles, pmax) else 'DIFFER'}; "
              f"quantized {'bit for bit' if same else 'DIFFERS'}")

    chains = {"shipped: CUTLASS gate/up + SiLU quantize": [
        graphed(lambda i=i: (gate_up(i), triton_fp8_quant._prequantize(gu, M, INTER, True, block)))
        for i in range(args.layers)]}
    pieces = {"CUTLASS gate/up (shipped)": [graphed(lambda i=i: gate_up(i)) for i in range(args.layers)]}
    for name, lib in libs.items():
        chains[f"{name} GEMM + quantize_max"] = [graphed(lambda i=i, lib=lib: (pair(i, lib), quantize_max(h, pmax)))
                                                 for i in range(args.layers)]
        pieces[f"{name} GEMM"] = [graphed(lambda i=i, lib=lib: pair(i, lib)) for i in range(args.layers)]
    pieces["SiLU quantize (shipped)"] = [graphed(lambda: triton_fp8_quant._prequantize(gu, M, INTER, True, block))]
    pieces["quantize_max"] = [graphed(lambda: quantize_max(h, pmax))]
    flops = 2 * M * N * K
    for title, group in (("chains", chains), ("pieces", pieces)):
        times = {n: [] for n in group}
        for _ in range(args.rounds):
            for n, t in paired(group, args.reps).items():
                times[n].append(t)
        print(f"{title} (us, medians of calls taking turns; rounds)")
        for n, ts in times.items():
            extra = f"  {flops / statistics.median(ts) / 1e6:5.0f} TFLOP/s" if "GEMM" in n or "gate/up (" in n else ""
            print(f"  {n:45s} {statistics.median(ts):7.1f}  {' '.join(f'{t:6.1f}' for t in ts)}{extra}")
        if title == "chains":
            base, *rest = (statistics.median(v) for v in times.values())
            for n, t in zip(list(times)[1:], rest):
                print(f"  {n}: saved a layer {base - t:+.1f} us, over 32 layers {(base - t) * 32 / 1e3:+.2f} ms")


if __name__ == "__main__":
    main()
