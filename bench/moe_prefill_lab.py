"""The sorted fused MoE (``triton_moe.fused_moe``: sort, gate/up GEMM, down GEMM, k-sum) at prefill token counts,
over its tiles: ``config_for``'s defaults are vLLM-style heuristics, never swept on the GPU until this lab.

For each shape (the Qwen3-30B-A3B and Mixtral-8x7B experts), expert weight format (``--weights``: bf16, fp8 with
row scales as ``--quant fp8`` makes, fp8 with an already-fp8 checkpoint's 128x128 block scales; activations bf16) and
token count, every candidate ``MoeConfig`` (``candidates``: tiles whose gate/up stages fit sm_90's shared memory)
is checked (bf16: against ``moe_ref``; fp8: against the default config's output) and timed as a CUDA graph of
back-to-back calls (one set of weights: a prefill's GEMMs are compute-bound, and a decode-sized call's chosen
experts, hundreds of MB, do not fit L2). The kernels are
compiled first in ``--jobs`` processes (Triton's on-disk cache; the binaries do not depend on the token count).
Prints each shape's default and its best ten in TFLOP/s of the expert GEMMs, and the per-expert loop of cuBLAS
GEMMs (``moe_ref``, bf16) for scale.
With ``--against-previous``, only ``config_for``'s choice and the heuristic it replaced (``previous``) are timed.
With ``--decode``, the decode-sized tiles (up to 16 rows an expert: batched decode and short prompts, where
``config_for`` keeps the heuristic) are swept, and each rate is also given in GB/s of the chosen experts' weights
against a device copy. With ``--down``, each token count's default gate/up tile is kept and the down GEMM's own
tiles (``MoeConfig.DOWN``) are swept, with the default against its gate/up tile shared by both GEMMs (with
``--against-previous`` too: only those and the previous heuristic).
Usage: python bench/moe_prefill_lab.py [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 512,2048,8192]
                                       [--weights bf16,channel,block128] [--jobs 8] [--against-previous] [--decode]
                                       [--down]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import copy_bandwidth  # noqa: E402
from moe_lab import time_us  # noqa: E402  (a CUDA graph of back-to-back calls, timed by do_bench)

from mxc.kernels import moe_ref, triton_moe  # noqa: E402
from mxc.kernels.triton_moe import MoeConfig  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}  # E, k, H, I
SMEM = 227 * 1024  # sm_90's shared memory a program


def gate_up_smem(cfg: MoeConfig, itemsize: int = 2) -> int:
    """Bytes of the gate/up GEMM's pipeline: a stage holds an x tile and two weight tiles (gate, up)."""
    return cfg.num_stages * (cfg.BLOCK_M + 2 * cfg.BLOCK_N) * cfg.BLOCK_K * itemsize


def candidates(chunk: int = 1024, decode: bool = False) -> list[MoeConfig]:
    """The tiles swept: BLOCK_M 32-128, BLOCK_N 64-256 (at most 128 x 128 outputs a program: two fp32
    accumulators), BLOCK_K 64/128, 4 or 8 warps, 3-5 stages, where the stages fit. With ``decode`` (up to 16 rows
    an expert, where the GEMMs stream the chosen experts' weights): BLOCK_M 16/32, BLOCK_N 32-128, BLOCK_K
    128/256, 4 or 8 warps, 3-6 stages."""
    out = []
    space = (((16, 32), (32, 64, 128), (128, 256), (4, 8), (3, 4, 5, 6)) if decode
             else ((32, 64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)))
    for bm, bn, bk, warps, stages in itertools.product(*space):
        cfg = MoeConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, CHUNK=chunk)
        if bm * bn <= 128 * 128 and gate_up_smem(cfg) <= SMEM:
            out.append(cfg)
    return out


def down_candidates(base: MoeConfig, weights: str = "bf16") -> list[MoeConfig]:
    """``base`` with GEMM 2's own tiles (``MoeConfig.DOWN``): BLOCK_N 32-256, BLOCK_K 64-256 (at most 128 with block
    scales: a wider step needs a [K, N] tile of scales), 4 or 8 warps, 3-6 stages, where the stages fit; its one
    accumulator at most 128 x 128 at 4 warps, 128 x 256 at 8."""
    out = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5, 6)):
        if (weights == "block128" and bk > 128) or base.BLOCK_M * bn > 128 * 128 * warps // 4:
            continue
        if stages * (base.BLOCK_M + bn) * bk * 2 <= SMEM:
            out.append(dataclasses.replace(base, DOWN=(bn, bk, warps, stages)))
    return out


def previous(t_bucket: int, e: int, k: int, h: int, i: int) -> MoeConfig:
    """``config_for``'s choice for 16-bit activations before this lab's sweep: the heuristic it keeps elsewhere."""
    return triton_moe.heuristic_config(t_bucket, e, k, h, i, torch.bfloat16)


def default_config(shape: str, tokens: int, weights: str) -> MoeConfig:
    e, k, h, i = SHAPES[shape]
    return triton_moe.config_for(triton_moe.token_bucket(tokens), e, k, h, i, torch.bfloat16,
                                 fp8_weights=weights != "bf16", block_scales=weights == "block128")


def inputs(shape: str, tokens: int, weights: str = "bf16", device: str = "cuda", experts: int | None = None):
    """(x, routing weights, ids, w_gate_up, w_down) and the scales' keywords, deterministic; ``experts`` narrows E
    (at least k) where only the binaries matter: the GEMMs' constexprs do not include E."""
    from mxc.loaders.quantize import quantize_fp8

    e, k, h, i = SHAPES[shape]
    e = e if experts is None else max(k, min(e, experts))
    g = torch.Generator(device=device).manual_seed(0)
    w1 = torch.randn(e, 2 * i, h, device=device, generator=g).mul_(h ** -0.5).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, device=device, generator=g).mul_(i ** -0.5).to(torch.bfloat16)
    x = torch.randn(tokens, h, device=device, generator=g).to(torch.bfloat16)
    route, ids = moe_ref.route(torch.randn(tokens, e, device=device, generator=g), k, renormalize=True)
    if weights == "bf16":
        return (x, route.to(torch.bfloat16), ids, w1, w2), {}
    (q1, s1), (q2, s2) = (quantize_fp8(w, weights) for w in (w1, w2))
    return (x, route.to(torch.bfloat16), ids, q1, q2), dict(s_gate_up=s1, s_down=s2)


def _compile(job) -> list[str]:
    """In a worker: run each config once (Triton compiles it into its cache); the configs that fail, and why. Over
    as few experts as the top-k allows: the GEMM binaries are the same, and workers holding every expert's
    weights (Mixtral's: 5.9 GB each) ran an 80 GB GPU out of memory at 14 workers."""
    shape, tokens, weights, configs = job
    args, kw = inputs(shape, tokens, weights, experts=1)
    failed = []
    for cfg in configs:
        try:
            triton_moe.fused_moe(*args, **kw, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (out of resources)
            failed.append(f"{cfg}: {type(e).__name__} {str(e)[:80]}")
    return failed


def weight_bytes(ids: torch.Tensor, h: int, i: int, weights: str) -> int:
    """The chosen experts' weight bytes (gate, up, down) that one call streams."""
    return ids.unique().numel() * 3 * h * i * (2 if weights == "bf16" else 1)


def sweep(shape: str, tokens_list: list[int], weights: str, jobs: int, against_previous: bool = False,
          decode: bool = False, copy_gbs: float = 0.0, down: bool = False) -> None:
    e, k, h, i = SHAPES[shape]
    sweep_space = [] if against_previous or down else candidates(decode=decode)

    def pool(t: int) -> list[MoeConfig]:
        """Token count ``t``'s configs: its default and the heuristic; with ``down``, the default's gate/up tile
        shared by both GEMMs too (and without ``--against-previous`` under every down tile); else the sweep."""
        default = default_config(shape, t, weights)
        own = [dataclasses.replace(default, DOWN=None)] if down else []
        tiles = down_candidates(default, weights) if down and not against_previous else sweep_space
        # the sort's chunk follows the token count
        return list(dict.fromkeys(dataclasses.replace(c, CHUNK=default.CHUNK) for c in
                                  [default, previous(triton_moe.token_bucket(t), e, k, h, i), *own, *tiles]))

    pools = {t: pool(t) for t in tokens_list}
    configs = list(dict.fromkeys(c for t in tokens_list for c in pools[t]))
    chunks = [(shape, tokens_list[0], weights, configs[j::jobs]) for j in range(jobs)]
    import multiprocessing as mp
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        failed = [f for part in ex.map(_compile, chunks) for f in part]
    for f in failed:
        print(f"{shape} {weights}: skip {f}", flush=True)
    for t in tokens_list:
        args, kw = inputs(shape, t, weights)
        default = default_config(shape, t, weights)
        old = previous(triton_moe.token_bucket(t), e, k, h, i)
        ref = (moe_ref.fused_moe(*args) if weights == "bf16" else triton_moe.fused_moe(*args, **kw)).float()
        flops = 2 * t * k * 3 * h * i
        nbytes = weight_bytes(args[2], h, i, weights)
        tag = f"{shape} {weights} T={t}"

        def rate(us: float) -> str:
            gbs = nbytes / us / 1e3
            return f"{flops / us / 1e6:6.1f} TFLOP/s {gbs:6.0f} GB/s" + (f" ({gbs / copy_gbs:4.0%} of copy)"
                                                                          if copy_gbs else "")
        calls = max(2, min(32, int(2e12 // flops)))
        results = []
        for cfg in pools[t]:
            try:
                err = (triton_moe.fused_moe(*args, **kw, config=cfg).float() - ref).abs().max().item()
                assert err <= 2e-2 * ref.abs().max().item(), f"off by {err}"
                us = time_us(lambda _, cfg=cfg: triton_moe.fused_moe(*args, **kw, config=cfg), calls)
            except Exception as ex_:  # noqa: BLE001
                print(f"{tag}: skip {cfg}: {type(ex_).__name__} {str(ex_)[:80]}", flush=True)
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        base = next(us for us, c in results if c == default)
        print(f"{tag}: default {base:9.1f} us {rate(base)}  {default}", flush=True)
        before = next(us for us, c in results if c == old)
        print(f"{tag}: previous default {before:9.1f} us {rate(before)}  {old}: "
              f"default / previous = {before / base:.2f}x", flush=True)
        if down:
            shared = next(us for us, c in results if c == dataclasses.replace(default, DOWN=None))
            print(f"{tag}: default, the down GEMM on the gate/up tile {shared:9.1f} us {rate(shared)}: "
                  f"default / that = {shared / base:.2f}x", flush=True)
        if against_previous:
            continue
        for us, cfg in results[:10]:
            print(f"{tag}:         {us:9.1f} us {rate(us)}  x{base / us:5.2f}  {cfg}",
                  flush=True)
        if weights != "bf16":
            continue
        from triton.testing import do_bench  # the loop syncs with the host (its experts' rows): no graph
        loop = do_bench(lambda: moe_ref.fused_moe(*args), warmup=3, rep=30) * 1e3
        print(f"{tag}: per-expert loop (cuBLAS) {loop:9.1f} us {rate(loop)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--weights", default="bf16", help="comma-separated: bf16, channel, block128")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--against-previous", action="store_true",
                   help="time only config_for's choice and the heuristic it replaced")
    p.add_argument("--decode", action="store_true",
                   help="sweep the decode-sized tiles (for token counts that give an expert at most 16 rows) and "
                        "print each rate against a device copy measured first")
    p.add_argument("--down", action="store_true",
                   help="keep config_for's gate/up tile and sweep the down GEMM's own (MoeConfig.DOWN)")
    a = p.parse_args()
    copy_gbs = copy_bandwidth() / 1e9 if a.decode else 0.0  # bench/decode.py's, as docs/perf.md quotes it
    if copy_gbs:
        print(f"copy: {copy_gbs:.0f} GB/s", flush=True)
    for weights in a.weights.split(","):
        for shape in a.shapes.split(","):
            sweep(shape, [int(t) for t in a.tokens.split(",")], weights, a.jobs, a.against_previous, a.decode,
                  copy_gbs, a.down)


if __name__ == "__main__":
    main()
