"""The fp8 prefill GEMMs at few tokens (M = 64..512): CUTLASS configurations for problems with fewer tiles than SMs.

The library's kernel (``cutlass_fp8.BUILD_CONFIG``, 128x128 tiles, a CTA a tile) covers a Llama-3-8B o projection at
M = 64 with 32 CTAs on 132 SMs: 20.6 us against its weights' 3.9 us at the copy bandwidth (H200, 2026-12-01), so
short prefills run at a third of the memory floor. ``--compile DIR`` (on a machine with nvcc) builds each variant
of ``VARIANTS`` into ``DIR/<name>.so``; without it (on the GPU) every library in ``DIR``, the shipped one
(``$MXC_CUTLASS_LIBRARY``) and ``torch._scaled_mm`` are timed over the layer's four GEMM shapes at each ``--m``
(``triton.testing.do_bench``, L2 cleared), with each variant's largest error against ``_scaled_mm``.

    python bench/cutlass_small_m_lab.py --compile build/cutlass_lab     # CPU machine, nvcc
    python bench/cutlass_small_m_lab.py --dir build/cutlass_lab --m 64,128,256,512   # GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import cutlass_fp8  # noqa: E402

VARIANTS = {
    "coop128x128_streamk": dict(tile=(128, 128, 128), cluster=(1, 1, 1), schedule="cooperative", scheduler="streamk"),
    "coop128x64_streamk": dict(tile=(128, 64, 128), cluster=(1, 1, 1), schedule="cooperative", scheduler="streamk"),
    "pp64x128": dict(tile=(64, 128, 128), cluster=(1, 1, 1), schedule="pingpong", fast_accum=True),
    "pp64x64_c1x8": dict(tile=(64, 64, 128), cluster=(1, 8, 1), schedule="pingpong", fast_accum=True),
    "pp64x64": dict(tile=(64, 64, 128), cluster=(1, 1, 1), schedule="pingpong", fast_accum=True),
}
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def compile_all(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def one(item):
        name, cfg = item
        t0 = time.time()
        cutlass_fp8.compile_so(cutlass_fp8.generate(**cfg), out / f"{name}.so")
        return f"{name}: {time.time() - t0:.0f} s"

    sources = [(n, c) for n, c in VARIANTS.items() if not (out / f"{n}.so").exists()]
    with ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2)) as pool:
        for line in pool.map(one, sources):
            print(line, flush=True)


def bench(libs: dict, ms: list[int]) -> None:
    import torch
    from triton.testing import do_bench

    dev = "cuda"
    stream = torch.cuda.current_stream().cuda_stream
    workspace = torch.empty(1 << 26, dtype=torch.uint8, device=dev)
    bw_floor = {}
    print(f"{torch.cuda.get_device_name()}; us (weight bytes / time in TB/s); err: max |y - _scaled_mm| / max |_scaled_mm|")
    for m in ms:
        for name, n, k in SHAPES:
            a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
            sa, sb = torch.rand(m, device=dev) + 0.5, torch.rand(n, device=dev) / 100
            y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            ref = torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)
            t_mm = do_bench(lambda: torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :],
                                                     out_dtype=torch.bfloat16), warmup=25, rep=100) * 1e3
            bw_floor[name] = n * k
            line = f"M={m:4d} {name:7s}: _scaled_mm {t_mm:6.1f} ({n * k / t_mm / 1e6:4.2f})"
            for lib_name, lib in libs.items():
                need = lib.workspace_bytes(m, n, k)
                if need > workspace.numel() or not lib.can_implement(m, n, k):
                    line += f" | {lib_name} -"
                    continue

                def run():
                    lib(a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(), y.data_ptr(), m, n, k,
                        stream=stream, workspace=workspace.data_ptr(), workspace_bytes=workspace.numel())

                y.zero_()
                run()
                err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                t = do_bench(run, warmup=25, rep=100) * 1e3
                line += f" | {lib_name} {t:6.1f} ({n * k / t / 1e6:4.2f}) err {err:.0e}"
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", metavar="DIR", help="build the variants' libraries into DIR (nvcc; no GPU)")
    p.add_argument("--dir", default="build/cutlass_lab", help="the variants' libraries to time")
    p.add_argument("--m", default="64,128,256,512")
    args = p.parse_args()
    if args.compile:
        compile_all(Path(args.compile))
        return
    libs = {}
    if os.environ.get(cutlass_fp8.PREBUILT_ENV):
        libs["shipped"] = cutlass_fp8.load(os.environ[cutlass_fp8.PREBUILT_ENV])
    for so in sorted(Path(args.dir).glob("*.so")):
        libs[so.stem] = cutlass_fp8.load(so)
    bench(libs, [int(m) for m in args.m.split(",")])


if __name__ == "__main__":
    main()
