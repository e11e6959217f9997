"""Decode and prefill linears of the Llama-3-8B shape, kernel by kernel, on one GPU.

Times each variant as decode runs it (``gemv_tuning.time_us``: a CUDA graph of back-to-back
calls over weight copies covering 4x the L2) and prints microseconds and weight TB/s:
  bf16 GEMV: plain, and the MLP down projection fused (SiLU-and-mul prologue + residual
    epilogue) against unfused (silu_mul kernel, GEMV, add kernel);
  fp8 GEMV: the default config, the other activation-quantization mode, w @ x^T on e4m3 wgmma
    (SWAP_AB) and ``--tune`` winners;
  prefill (M = 2048): bf16 cuBLAS, fp8 ``torch._scaled_mm`` alone, with mxc's activation
  quantization, and the Triton fp8 GEMM.
``--quant-lab`` times only the activation-quantize kernels at --quant-m rows (2048) for the four
launches of a Llama-3-8B fp8 prefill layer: one program a row (``_quant_rows_kernel``) against the
tiled large-M kernel (``_quant_tile_kernel``) as ``_time_us`` times them, us and GB/s, and whether they
agree bit for bit; then the tiled kernel's warps (decode M) or rows a program and warps (prefill M).
Usage: python bench/linear_lab.py [--m 1,8,32] [--tune-fp8 o,down] [--quant-lab [--quant-m 2048]]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import fp8_gemm, triton_fp8, triton_fp8_quant, triton_gemv  # noqa: E402
from mxc.kernels.gemv_tuning import LLAMA3_8B_SHAPES, copies_for, time_us, tune, tune_fp8, weight_copies  # noqa: E402
from mxc.loaders.quantize import quantize_fp8  # noqa: E402

SHAPES = {k: v for k, v in LLAMA3_8B_SHAPES.items() if k != "lm_head"}


def row(name, us, nbytes, note=""):
    print(f"{name:44s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s  {note}", flush=True)


def bf16_gemv(ms):
    for name, (n, k) in SHAPES.items():
        ws = weight_copies(n, k, torch.bfloat16)
        nbytes = n * k * 2
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row(f"bf16 {name} M={m}", time_us(lambda x_, w_: triton_gemv.linear_small_m(x_, w_), x, ws), nbytes,
                str(triton_gemv.config_for(triton_gemv.bucket(m), n, k, torch.bfloat16)))
        del ws


def fp8_weights(n, k):
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    q, s = quantize_fp8(w.cpu(), "channel")
    copies = copies_for(n * k)
    return [q.cuda().clone() for _ in range(copies)], s.cuda()


def fp8_gemv(ms, tune, tune_ms):
    for name, (n, k) in SHAPES.items():
        ws, s = fp8_weights(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = triton_fp8.config_for(triton_gemv.bucket(m), n, k, torch.bfloat16, "channel")
            run = lambda x_, w_: triton_fp8.qlinear_small_m(x_, w_, s, config=cfg)  # noqa: E731
            row(f"fp8 {name} M={m} default", time_us(run, x, ws), n * k, str(cfg))
            if cfg.SWAP_AB:  # against the widening kernel it replaced (v1 at one row, the 32-row v3 tile)
                alt = triton_fp8.QGemvConfig(16, 1024, 1, False, True, 8, 1, cfg.QUANT_BLOCK_K) if m == 1 else \
                    triton_fp8.QGemvConfig(32, 512, 1, True, True, 4, 4, cfg.QUANT_BLOCK_K)
                alt = triton_gemv.fill_gpu(alt, n, k)
                label = "widening weights (SWAP_AB off)"
            else:
                alt = triton_fp8.QGemvConfig(**{**cfg.__dict__, "PREQUANT": not cfg.PREQUANT})
                label = f"PREQUANT={alt.PREQUANT}"
            run = lambda x_, w_: triton_fp8.qlinear_small_m(x_, w_, s, config=alt)  # noqa: E731
            row(f"fp8 {name} M={m} {label}", time_us(run, x, ws), n * k, str(alt))
            for bn in (64, 128):  # w @ x^T on e4m3 wgmma, split K to fill the GPU
                swap = triton_fp8.QGemvConfig(bn, 256, 1, True, True, 4, 4, cfg.QUANT_BLOCK_K, SWAP_AB=True)
                swap = replace(swap, SPLIT_K=triton_gemv.split_k_for(-(-n // bn), k, 256))
                run = lambda x_, w_: triton_fp8.qlinear_small_m(x_, w_, s, config=swap)  # noqa: E731
                row(f"fp8 {name} M={m} SWAP_AB BLOCK_N={bn}", time_us(run, x, ws), n * k, str(swap))
            if name == "down":
                x2 = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
                r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                run = lambda x_, w_: triton_fp8.qlinear_small_m(x_, w_, s, None, r, prologue="silu_mul")  # noqa: E731
                row(f"fp8 down M={m} fused silu_mul+residual", time_us(run, x2, ws), n * k)
        if name in tune:
            for m in tune_ms:
                cfg, us = tune_fp8(n, k, torch.bfloat16, triton_gemv.bucket(m))
                row(f"fp8 {name} M={m} tuned", us, n * k, str(cfg))
        del ws


def prefill(m=2048):
    from triton.testing import do_bench

    for name, (n, k) in SHAPES.items():
        flops = 2 * m * n * k
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q, s = quantize_fp8(w.cpu(), "channel")
        q, s = q.cuda(), s.cuda()
        xq, xs = triton_fp8_quant._prequantize(x, m, k, False, triton_fp8_quant._quant_block(k))
        cases = {
            "bf16 cuBLAS": lambda: torch.nn.functional.linear(x, w),
            "fp8 _scaled_mm alone": lambda: torch._scaled_mm(xq, q.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                                             out_dtype=torch.bfloat16),
            "fp8 quantize rows (Triton)": lambda: triton_fp8_quant._prequantize(x, m, k, False, triton_fp8_quant._quant_block(k)),
            "fp8 fp8_gemm.scaled_mm (as built)": lambda: fp8_gemm.scaled_mm(x, q, s),
            "fp8 Triton qlinear_gemm": lambda: triton_fp8.qlinear_gemm(x, q, s),
        }
        for case, fn in cases.items():
            us = do_bench(fn, warmup=10, rep=50) * 1e3
            print(f"prefill {name} M={m} {case:34s} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)


# the activation quantizations of a Llama-3-8B fp8 prefill layer: name -> (K, prologue)
QUANT_SHAPES = {"qkv in (RMSNorm)": (4096, "rms_norm"), "o in": (4096, None),
                "gate_up in (RMSNorm)": (4096, "rms_norm"), "down in (SiLU-and-mul)": (14336, "silu_mul")}


QUANT_SWEEP = [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)]  # (rows a program, warps) at prefill M


def _same(a, b) -> bool:
    """xq and xs of two quantizations equal bit for bit."""
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].view(torch.int32),
                                                                                       b[1].view(torch.int32))


def quant_lab(m=2048):
    """One program a row against the tiled kernel at M = m for each launch in QUANT_SHAPES (bf16), timed
    as ``_time_us`` does (CUDA events over a CUDA graph of back-to-back calls cycling through copies
    of x covering 4x the L2: no launch gaps, x from HBM): us, GB/s of the bytes' floor (x read once,
    the norm weight once, xq and xs written once) and a bit-for-bit check of xq and xs."""
    q = triton_fp8_quant
    total = {False: 0.0, True: 0.0}
    for name, (k, prologue) in QUANT_SHAPES.items():
        silu, rms = prologue == "silu_mul", prologue == "rms_norm"
        x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16) * 2
        x[:, :7] *= 8
        copies = copies_for(x.numel() * 2)
        xs_in = [x] + [x.clone() for _ in range(copies - 1)]
        g = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16) if rms else None
        nbytes = x.numel() * 2 + (k * 2 if rms else 0) + m * k + m * 4
        block = q._quant_block(k)
        out = {}
        for tiled in (False, True):
            fn = lambda _, x_, t=tiled: q._prequantize(x_, m, k, silu, block, g, 1e-5, tiled=t)  # noqa: E731
            out[tiled] = fn(None, x)
            us = time_us(fn, None, xs_in)
            total[tiled] += us
            label = "tiled (_quant_tile_kernel)" if tiled else "one program a row (_quant_rows_kernel)"
            cfg = q._tile_config(k, silu, rms) if tiled else (block, q._quant_warps(block))
            print(f"quantize {name:24s} M={m} {label:40s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s  {cfg}",
                  flush=True)
        if m <= 32:  # decode: the tiled kernel's warps (one program a row either way)
            base = q._tile_config
            for warps in (4, 8, 16, 32):
                q._tile_config = lambda k_, s_, r_, w_=warps: base(k_, s_, r_)[:2] + (w_,)
                try:
                    fn = lambda _, x_: q._prequantize(x_, m, k, silu, block, g, 1e-5, tiled=True)  # noqa: E731
                    us = time_us(fn, None, xs_in)
                finally:
                    q._tile_config = base
                print(f"quantize {name:24s} M={m} {'tiled, ' + str(warps) + ' warps':40s} {us:8.1f} us "
                      f"{nbytes / us / 1e3:7.0f} GB/s", flush=True)
        else:  # prefill: the tiled kernel's rows a program and warps
            base = q._tile_config
            shipped = base(k, silu, rms)
            for block_m, warps in QUANT_SWEEP:
                if rms and block_m > 1 or (block_m, warps) == (shipped[0], shipped[2]):
                    continue  # RMSNorm: one row a program
                q._tile_config = lambda k_, s_, r_, b_=block_m, w_=warps: (b_, base(k_, s_, r_)[1], w_)
                try:
                    fn = lambda _, x_: q._prequantize(x_, m, k, silu, block, g, 1e-5, tiled=True)  # noqa: E731
                    bq, bs = fn(None, x)
                    us = time_us(fn, None, xs_in)
                    same = _same(out[True], (bq, bs))
                except Exception as e:  # out of registers / shared memory
                    print(f"quantize {name:24s} M={m} tiled {block_m} rows, {warps} warps: failed "
                          f"{str(e).splitlines()[0][:60]}", flush=True)
                    continue
                finally:
                    q._tile_config = base
                print(f"quantize {name:24s} M={m} {f'tiled, {block_m} rows, {warps} warps':40s} {us:8.1f} us "
                      f"{nbytes / us / 1e3:7.0f} GB/s  same bits as shipped: {same}", flush=True)
        print(f"quantize {name:24s} M={m} bit-identical: {_same(out[False], out[True])}", flush=True)
        del xs_in
    print(f"quantize, the four launches of a layer: rows {total[False]:.1f} us, tiled {total[True]:.1f} us "
          f"(x32 layers: {total[False] * 32 / 1e3:.2f} ms -> {total[True] * 32 / 1e3:.2f} ms)", flush=True)


# Per-rank shapes at tensor parallelism tp: column-parallel linears (qkv, gate_up) split N, row-parallel
# ones (o, down) split K.
_COLUMN = ("qkv", "gate_up")


def tp_shapes(tp: int) -> dict[str, tuple[int, int]]:
    return {name: (n // tp, k) if name in _COLUMN else (n, k // tp) for name, (n, k) in SHAPES.items()}


def tune_tp(tp: int, m: int = 1):
    """The bf16 GEMV at tp=N's per-rank Llama-3-8B shapes: the default config against ``tune``'s best
    (entries for ``triton_gemv.MEASURED``)."""
    from mxc.kernels import triton_gemv

    for name, (n, k) in tp_shapes(tp).items():
        ws = weight_copies(n, k, torch.bfloat16)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        default = triton_gemv.config_for(triton_gemv.bucket(m), n, k, torch.bfloat16)
        us0 = time_us(lambda x_, w_: triton_gemv.linear_small_m(x_, w_), x, ws)
        cfg, us = tune(n, k, torch.bfloat16, triton_gemv.bucket(m), ws=ws)
        nbytes = n * k * 2
        print(f"tp={tp} {name:8s} {n}x{k} M={m}: default {us0:6.1f} us ({nbytes / us0 / 1e6:.2f} TB/s) {default}; "
              f"tuned {us:6.1f} us ({nbytes / us / 1e6:.2f} TB/s) {cfg}", flush=True)
        del ws


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,8,32")
    p.add_argument("--tune-fp8", default="", help="shapes to tune the fp8 GEMV for (comma list)")
    p.add_argument("--tune-m", default="1", help="M buckets to tune at")
    p.add_argument("--skip", default="", help="sections to skip: bf16,fp8,prefill")
    p.add_argument("--quant-lab", action="store_true", help="only the activation-quantize A/B at --quant-m rows")
    p.add_argument("--quant-m", type=int, default=2048)
    p.add_argument("--tune-tp", type=int, default=0, help="only: tune the bf16 GEMV at tp=N's per-rank shapes (M=1)")
    a = p.parse_args()
    if a.tune_tp:
        tune_tp(a.tune_tp)
        return
    if a.quant_lab:
        quant_lab(a.quant_m)
        return
    ms = [int(v) for v in a.m.split(",")]
    skip = set(a.skip.split(","))
    if "bf16" not in skip:
        bf16_gemv(ms)
    if "fp8" not in skip:
        fp8_gemv(ms, set(a.tune_fp8.split(",")) - {""}, [int(v) for v in a.tune_m.split(",")])
    if "prefill" not in skip:
        prefill()


if __name__ == "__main__":
    main()
