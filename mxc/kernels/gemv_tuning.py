"""Timing and tuning the GEMVs on a real GPU: what ``MEASURED`` tables come from (not used by builds or tests).

Owns the measuring side of ``triton_gemv`` (bf16/fp16/fp32 weights) and ``triton_fp8_gemv`` (e4m3 weights):
``weight_copies`` (enough copies of a weight to cover 4x the L2, so every call reads HBM), ``time_us`` (a
CUDA graph of back-to-back calls timed by ``do_bench``: as decode runs them), the candidate configs and
``tune`` / ``tune_fp8`` (each candidate timed, wrong results and compile failures skipped), and ``bench``
(default or tuned configs against cuBLAS on the Llama-3-8B shapes). The kernel-autotune cache on the road
ahead will run these and store their winners where ``config_for`` reads ``MEASURED`` today.

    python -m mxc.kernels.gemv_tuning [--shapes qkv,o] [--m 1,8] [--tune]
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from mxc.kernels import fp8_ref, triton_fp8_gemv, triton_fp8_quant, triton_gemv
from mxc.kernels.launch import cdiv
from mxc.kernels.triton_fp8_gemv import QGemvConfig
from mxc.loaders.quantize import quantize_fp8


def candidates(m_bucket: int, dtype: torch.dtype) -> list[triton_gemv.GemvConfig]:
    """Configs ``tune`` tries (SPLIT_K is added per shape): v1 at M = 1, v3 from 16, both v2 and
    v3 between. v1 keeps acc2 (BLOCK_N * BLOCK_K fp32 per program) within 128 registers a thread."""
    vec = triton_gemv._vec(dtype)
    paths = (False,) if m_bucket == 1 else (True,) if m_bucket >= 16 else (False, True)
    v1 = [triton_gemv.GemvConfig(bn, steps * 32 * vec, 1, False, nw, 1)  # num_stages: no effect measured
          for bn in (8, 16, 32) for steps in (1, 2, 4) for nw in (4, 8)
          if bn * steps * 32 * vec <= 128 * 32 * nw]
    v2 = [triton_gemv.GemvConfig(bn, steps * 32 * vec, 1, False, 4, 1) for bn in (16, 32) for steps in (1, 2)]
    v3 = [triton_gemv.GemvConfig(bn, steps * 32 * vec, 1, True, nw, ns)
          for bn in (16, 32, 64) for steps in (1, 2) for nw in (4, 8) for ns in (3, 4, 5)]
    return [c for dot in paths for c in (v3 if dot else v1 if m_bucket == 1 else v2)]


L2_BYTES = 60 << 20  # H200


def copies_for(nbytes: int) -> int:
    """How many copies of an ``nbytes`` tensor cover 4x the L2, so that cycling through them reads HBM."""
    return max(1, -(-4 * L2_BYTES // nbytes))


def weight_copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Enough copies of a random [n, k] weight to cover 4x the L2, so each call reads HBM."""
    nbytes = n * k * torch.empty((), dtype=dtype).element_size()
    return [(torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype) for _ in range(copies_for(nbytes))]


def time_us(fn, x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    """Microseconds per ``fn(x, w)``: ``triton.testing.do_bench`` of a CUDA graph of back-to-back
    calls cycling through ``ws`` (as decode runs them: no launch gaps, weights from HBM; one
    L2 flush per replay instead of one per call)."""
    from triton.testing import do_bench

    calls = min(64, max(2, len(ws), -(-(2 << 30) // (ws[0].numel() * ws[0].element_size()))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capture
        for w in ws[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    return do_bench(graph.replay, warmup=5, rep=40) * 1e3 / calls


def _best(bases, n: int, k: int, run, ok, x: torch.Tensor, ws: list[torch.Tensor], verbose: bool, **fixed):
    """Time each base config with SPLIT_K 1 and with ``split_k_for``'s choice for its BLOCK_N (``fixed``
    fields set too): ``run(x, w, cfg)`` once, checked by ``ok(y)``, then ``time_us``; a wrong result, a
    compile failure or running out of resources skips it. Returns ``(best_config, best_us)``."""
    nbytes = ws[0].numel() * ws[0].element_size()
    best, tried = (None, float("inf")), set()
    for base in bases:
        for split in sorted({1, triton_gemv.split_k_for(cdiv(n, base.BLOCK_N), k, base.BLOCK_K)}):
            cfg = replace(base, SPLIT_K=split, **fixed)
            if cfg in tried:
                continue
            tried.add(cfg)
            try:
                y = run(x, ws[0], cfg)
                torch.cuda.synchronize()
                if not ok(y):
                    raise RuntimeError("wrong result")
                us = time_us(lambda x_, w_, cfg=cfg: run(x_, w_, cfg), x, ws)
            except Exception as e:  # out of resources, compile failures: skip the candidate
                if verbose:
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if verbose:
                print(f"  {us:8.1f} us {nbytes / us / 1e6:6.2f} TB/s  {cfg}", flush=True)
            if us < best[1]:
                best = (cfg, us)
    return best


def tune(n: int, k: int, dtype: torch.dtype, m_bucket: int, *, configs=None, verbose: bool = False,
         ws: list[torch.Tensor] | None = None):
    """Time candidate configs of ``triton_gemv.linear_small_m`` on the current GPU (``_best``); return
    ``(best_config, best_us)``."""
    ws = ws if ws is not None else weight_copies(n, k, dtype)
    x = torch.randn(m_bucket, k, device="cuda").to(dtype)
    ref = torch.nn.functional.linear(x.float(), ws[0].float())
    return _best(configs if configs is not None else candidates(m_bucket, dtype), n, k,
                 lambda x_, w_, cfg: triton_gemv.linear_small_m(x_, w_, config=cfg),
                 lambda y: torch.allclose(y.float(), ref, atol=5e-2, rtol=5e-2), x, ws, verbose)


LLAMA3_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                    "down": (4096, 14336), "lm_head": (128256, 4096)}


def bench(shapes, buckets, dtype, *, do_tune=False, verbose=False):
    """Default (or tuned) configs vs torch (cuBLAS) on the given shapes: weight bytes / time per
    call (``time_us``); "of copy" is the share of the copy ceiling measured in the same run."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / do_bench(functools.partial(dst.copy_, src), warmup=10, rep=50) / 1e9
    del src, dst
    print(f"device-to-device copy: {copy:.2f} TB/s (read + write)")
    print(f"{'shape':8} {'M':>3} {'mxc us':>8} {'TB/s':>6} {'torch us':>9} {'TB/s':>6} {'of copy':>7}  config")
    for name in shapes:
        n, k = LLAMA3_8B_SHAPES[name]
        ws = weight_copies(n, k, dtype)
        nbytes = n * k * ws[0].element_size()
        for mb in buckets:
            cfg = triton_gemv.config_for(mb, n, k, dtype)
            if do_tune:
                cfg, _ = tune(n, k, dtype, mb, verbose=verbose, ws=ws)
            x = torch.randn(mb, k, device="cuda").to(dtype)
            y = triton_gemv.linear_small_m(x, ws[0], config=cfg)
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            assert torch.allclose(y.float(), ref, atol=5e-2, rtol=5e-2), (name, mb)
            t = time_us(lambda x_, w_: triton_gemv.linear_small_m(x_, w_, config=cfg), x, ws)
            tt = time_us(torch.nn.functional.linear, x, ws)
            print(f"{name:8} {mb:3d} {t:8.1f} {nbytes / t / 1e6:6.2f} {tt:9.1f} {nbytes / tt / 1e6:6.2f} "
                  f"{nbytes / t / 1e6 / copy:7.0%}  {cfg}", flush=True)
        del ws


def fp8_candidates(m_bucket: int, granularity: str) -> list[QGemvConfig]:
    """Configs ``tune_fp8`` tries (SPLIT_K added per shape): v1 at M = 1, v3 from 16, v1/v2 and v3
    between; fused and prequantized activations for each (and v1 weight-only, as ``config_for`` runs it
    at one row, also under REDUCE_STEPS); v3 with SWAP_AB at every bucket."""
    block = granularity == "block128"
    swap = [QGemvConfig(bn, bk, 1, True, True, 4, ns, SWAP_AB=True) for bn in (64, 128) for bk in (128, 256, 512)
            for ns in (3, 4, 5) if not (block and bk > 128)]
    v1 = [QGemvConfig(bn, bk, 1, False, pq, nw, 1, WEIGHT_ONLY=wo) for bn in (8, 16, 32) for bk in (512, 1024, 2048)
          for nw in (4, 8) for pq, wo in ((False, False), (True, False), (False, True)) if bn * bk <= 128 * 32 * nw]
    v1 += [QGemvConfig(bn, bk, 1, False, False, 8, 1, WEIGHT_ONLY=True, REDUCE_STEPS=True) for bn in (8, 16)
           for bk in (1024, 2048, 4096)]
    v2 = [QGemvConfig(bn, bk, 1, False, pq, 4, 1) for bn in (16, 32) for bk in (512, 1024) for pq in (False, True)]
    v3 = [QGemvConfig(bn, bk, 1, True, pq, nw, ns) for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512)
          for nw in (4, 8) for ns in (3, 4, 5) for pq in (False, True) if not (block and bk > 128)]
    return (v1 if m_bucket == 1 else v3 if m_bucket >= 16 else v2 + v3) + swap


def tune_fp8(n: int, k: int, dtype: torch.dtype, m_bucket: int, granularity: str = "channel", *, configs=None,
             verbose: bool = False):
    """Time ``fp8_candidates`` of ``triton_fp8.qlinear_small_m`` on the current GPU (``_best``, over e4m3
    weight copies covering 4x the L2); return ``(best_config, best_us)``."""
    q, s = quantize_fp8(torch.randn(n, k) * k ** -0.5, granularity)
    s = s.cuda()
    ws = [q.cuda().clone() for _ in range(copies_for(n * k))]
    x = torch.randn(m_bucket, k, device="cuda").to(dtype)
    refs = [fp8_ref.qlinear(x, ws[0], s, granularity=granularity, weight_only=wo).float() for wo in (False, True)]
    return _best(configs if configs is not None else fp8_candidates(m_bucket, granularity), n, k,
                 lambda x_, w_, cfg: triton_fp8_gemv.qlinear_small_m(x_, w_, s, granularity=granularity, config=cfg),
                 lambda y: any(bool((y.float() - r).abs().max() <= 2e-2 * r.abs().max()) for r in refs), x, ws,
                 verbose, QUANT_BLOCK_K=triton_fp8_quant._quant_block(k))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="benchmark (or --tune) linear_small_m on Llama-3-8B shapes")
    ap.add_argument("--shapes", default=",".join(LLAMA3_8B_SHAPES))
    ap.add_argument("--m", default=",".join(map(str, triton_gemv.M_BUCKETS)))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    bench(a.shapes.split(","), [int(m) for m in a.m.split(",")], getattr(torch, a.dtype),
          do_tune=a.tune, verbose=a.verbose)
