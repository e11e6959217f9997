"""The sorted fused MoE's tiles (``triton_moe.fused_moe``): ``MoeConfig``, the token-count buckets, and
``config_for``, the default tile a (token bucket, shape, activation dtype, expert weight format) gets. A pure
function of those, so a build and the runtime agree on it and a tuning cache can stand in for it later.

Where the defaults come from: vLLM-style heuristics (``heuristic_config``), then sweeps on an H100 with
``bench/moe_prefill_lab.py`` (docs/perf.md, sixty-fifth and sixty-sixth runs), each kept where it measured faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxc.kernels.launch import next_pow2

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the activations (and 16/32-bit experts) the kernels take


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of both grouped GEMMs (BLOCK_M is also the alignment of the expert groups) and the
    assignments per program of the sorting kernels (CHUNK). ``DOWN``, where set, is GEMM 2's own
    (BLOCK_N, BLOCK_K, num_warps, num_stages): its one accumulator and its K (I, not H) differ from GEMM 1's."""
    BLOCK_M: int = 16
    BLOCK_N: int = 64
    BLOCK_K: int = 64
    num_warps: int = 4
    num_stages: int = 3
    CHUNK: int = 1024
    DOWN: tuple[int, int, int, int] | None = None

    def down(self) -> tuple[int, int, int, int]:
        """GEMM 2's (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
        return self.DOWN or (self.BLOCK_N, self.BLOCK_K, self.num_warps, self.num_stages)


def token_bucket(t: int) -> int:
    """The token-count bucket of ``t`` tokens: the next power of two."""
    if t < 1:
        raise ValueError(f"fused_moe needs at least one token, got {t}")
    return 1 << (t - 1).bit_length()


# Past 16 rows an expert, 16-bit activations: the tiles bench/moe_prefill_lab.py found fastest (one H100, 2026-12-06;
# docs/perf.md, sixty-fifth run) as (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). bf16 experts' down GEMM takes
# its own (BLOCK_N, BLOCK_K, num_warps, num_stages) (``MoeConfig.DOWN``; sixty-sixth run, ``--down``: 0.98-1.12x the
# shared tile at 512-8192 tokens). fp8 experts by rows an expert, one tile for both GEMMs: a down tile of their own
# was 0.87-1.08x, slower at some sizes and scales.
_BF16_PREFILL_TILE = (64, 256, 64, 8, 3)
_BF16_PREFILL_DOWN = (256, 64, 4, 4)
_FP8_PREFILL_TILES = ((64, (32, 128, 128, 4, 3)), (128, (64, 128, 64, 4, 3)), (float("inf"), (128, 128, 64, 8, 4)))
# Up to 16 rows an expert the GEMMs stream the chosen experts' weights. bf16 experts keep the heuristic (the sweep
# found it within 1-3% of the best); fp8 experts with row scales take 256-element K steps, the bf16 tile's 256
# weight bytes a step (sixty-sixth run, H100: 1.04-1.11x the heuristic's 128 on the Mixtral-8x7B experts at 8-64
# tokens, 0.99-1.07x on Qwen3-30B-A3B's at 8-256). A down tile of its own gained at most 3% there: none.
_FP8_DECODE_TILE = (16, 64, 256, 4, 3)


def config_for(t_bucket: int, num_experts: int, top_k: int, hidden: int, inter: int,
               dtype: torch.dtype, fp8_weights: bool = False, block_scales: bool = False) -> MoeConfig:
    """Default config for a (token bucket, E, k, H, I, activation dtype, fp8 experts or not, their scales 128x128
    blocks or not); a pure function.

    Rows an expert gets on average, ``t_bucket * k / E``, pick the tiles. For fp32 activations, bf16 experts up to
    16 rows an expert (decode), and bf16 experts whose H or I is no multiple of 256 (a 256-wide tile would compute
    wasted columns): ``heuristic_config``. fp8 experts with row scales up to 16 rows take its [16 x 64] tile with
    256-element K steps (the same weight bytes a step as bf16's 128; ``bench/moe_prefill_lab.py --decode``); with
    block scales a step spans at most one block (a wider one dequantizes by a [K, N] tile of scales: 336 KB of
    shared memory at [16 x 64]), so they keep the heuristic there. Past 16, 16-bit activations take the tiles that
    ``bench/moe_prefill_lab.py`` found fastest over the Qwen3-30B-A3B and Mixtral-8x7B experts at 128-8192 tokens
    (docs/perf.md, sixty-fifth run: 1.07-1.33x the heuristic for bf16 experts, 1.01-1.36x for fp8): bf16 experts
    [64 x 256] tiles, 8 warps, 3 stages (GEMM 1 holds two weight tiles a stage, gate and up: [64 x 64] x + 2 x
    [64 x 256] w = 72 KB, three in sm_90's 227 KB); fp8 experts (row or 128x128 block scales) [32 x 128] with
    128-element K steps and 4 warps up to 64 rows an expert, [64 x 128] with 4 warps up to 128, then [128 x 128]
    with 8 warps and 4 stages. With the bf16 tile the down GEMM (one accumulator, K = I) takes a tile of its own
    (``DOWN``): [64 x 256], 64-element K steps, 4 warps, 4 stages (``bench/moe_prefill_lab.py --down``).
    """
    base = heuristic_config(t_bucket, num_experts, top_k, hidden, inter, dtype)
    per_expert = t_bucket * top_k / num_experts
    if dtype == torch.float32:
        return base
    if per_expert <= 16:
        return _config(*_FP8_DECODE_TILE, hidden, inter, base.CHUNK) if fp8_weights and not block_scales else base
    if fp8_weights:
        tile = next(t for rows, t in _FP8_PREFILL_TILES if per_expert <= rows)
        return _config(*tile, hidden, inter, base.CHUNK)
    if hidden % 256 == 0 and inter % 256 == 0:
        return _config(*_BF16_PREFILL_TILE, hidden, inter, base.CHUNK, _BF16_PREFILL_DOWN)
    return base


def heuristic_config(t_bucket: int, num_experts: int, top_k: int, hidden: int, inter: int,
                     dtype: torch.dtype) -> MoeConfig:
    """vLLM-style heuristics: BLOCK_M 16, the smallest tensor-core tile, while experts get at most 16 rows on average
    (decode), 32 up to 64 rows, 64 beyond; tiles sized in bytes, so fp32 gets half the K elements (bf16 [16 x 128]
    x + 2 x [128 x 64] w = 36 KB a stage, 4 stages). ``config_for``'s choice where the sweep did not reach, and
    everywhere before it (``bench/moe_prefill_lab.py`` times it as the baseline). Tiles shrink to the
    (power-of-two) H and I; the sort's CHUNK covers the bucket's T*k assignments (64..1024)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    if t_bucket != token_bucket(t_bucket):
        raise ValueError(f"t_bucket must be a power of two, got {t_bucket}")
    per_expert = t_bucket * top_k / num_experts
    if per_expert <= 16:
        bm, bn, k_bytes, warps, stages = 16, 64, 256, 4, 4
    elif per_expert <= 64:
        bm, bn, k_bytes, warps, stages = 32, 64, 128, 4, 4
    else:
        bm, bn, k_bytes, warps, stages = 64, 128, 128, 8, 3
    bk = k_bytes // torch.empty((), dtype=dtype).element_size()  # 16-bit: 128 / 64; fp32: half
    chunk = min(1024, max(64, next_pow2(t_bucket * top_k)))  # the sort's assignments per program
    return _config(bm, bn, bk, warps, stages, hidden, inter, chunk)


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, hidden: int, inter: int, chunk: int,
            down: tuple[int, int, int, int] | None = None) -> MoeConfig:
    """A tile (and the down GEMM's own, if any: N over H, K over I), shrunk to the (power-of-two) H and I."""
    bn = max(16, min(bn, next_pow2(max(inter, hidden))))
    bk = max(16, min(bk, next_pow2(min(inter, hidden))))
    if down is not None:
        dn, dk, dw, ds = down
        down = (max(16, min(dn, next_pow2(hidden))), max(16, min(dk, next_pow2(inter))), dw, ds)
    return MoeConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, CHUNK=chunk, DOWN=down)
