"""The router-fold lab (bench/router_fold_lab.py) under the interpreter: its gate/up pair kernel, which routes from the
unscaled logits itself (the residual sum, the RMSNorm's scale, the bitonic top-k), then the shipped down kernel,
against the torch reference: the residual sum, the ids, the weights (renormalised or not), each pair's gate/up
activations and the output. Keeps the lab from rotting; its timings run on the GPU (``bash bench/gpu_session.sh
fold``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import router_fold_lab  # noqa: E402
import torch  # noqa: E402


def test_folded_router_matches_the_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter, or the GPU where there is one
    router_fold_lab.check(device, E=16, H=64, I=48, K=4, T=2)
