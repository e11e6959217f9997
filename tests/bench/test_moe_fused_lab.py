"""The one-kernel MoE experts lab (bench/moe_fused_lab.py) under the interpreter: its fused kernel (fp32 atomics and
int64 fixed-point sums, both down layouts) and finish kernel against the torch reference, and its unrolled copies of
the shipped pair kernels against ``triton_moe_decode``'s, bit for bit. Keeps the lab from rotting; its timings run
on the GPU (``bash bench/gpu_session.sh moefused``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_fused_lab  # noqa: E402


def test_fused_kernels_match_the_reference():
    base = dict(moe_fused_lab.VARIANTS[0], bn=16, block_h=32, block_k=64)
    variants = [dict(base, down_t=dt, fixed=fx) for dt in (False, True) for fx in (False, True)]
    moe_fused_lab.check("cpu", E=8, H=64, I=48, K=4, T=2, variants=variants)


def test_unrolled_pair_kernels_equal_the_shipped_ones():
    moe_fused_lab.check("cpu", E=8, H=64, I=64, K=4, T=2, variants=[])  # asserts equality inside
