"""The one-kernel MoE experts lab (bench/moe_fused_lab.py) under the interpreter: its fused kernel (fp32 atomics and
int64 fixed-point sums, both down layouts) and finish kernel against the torch reference, and the pair kernels' unrolled
loops (``PairConfig.UNROLL``) against their loops, bit for bit. Keeps the lab from rotting; its timings run
on the GPU (``bash bench/gpu_session.sh moefused``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_fused_lab  # noqa: E402
import torch  # noqa: E402


def test_lab_kernels_match_the_reference():
    """``check`` asserts each fused variant against the reference and the unrolled pair kernels against the loops."""
    base = dict(moe_fused_lab.VARIANTS[0], bn=16, block_h=32, block_k=64)
    variants = [dict(base, down_t=dt, fixed=fx) for dt in (False, True) for fx in (False, True)]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter, or the GPU where there is one
    moe_fused_lab.check(device, E=8, H=64, I=48, K=4, T=2, variants=variants)
