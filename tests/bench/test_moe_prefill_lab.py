"""The MoE prefill tile lab (bench/moe_prefill_lab.py) on the CPU: its candidates fit sm_90's shared memory and
include the tiles config_for chose from it, ``previous`` is the heuristic config_for keeps where the sweep did not
reach (up to 16 rows an expert, fp32), and its inputs run through fused_moe at the default tiles under the
interpreter, every weight format, matching the reference. Its timings run on the GPU
(``python bench/moe_prefill_lab.py``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_prefill_lab as lab  # noqa: E402

from mxc.kernels import fp8_ref, moe_ref, triton_moe  # noqa: E402


def test_candidates_fit_and_hold_the_defaults():
    cands = lab.candidates()
    assert cands and all(lab.gate_up_smem(c) <= lab.SMEM for c in cands)
    for shape in lab.SHAPES:
        for tokens in (512, 2048, 8192):
            for weights in ("bf16", "channel"):
                d = lab.default_config(shape, tokens, weights)  # its gate/up tile (the down GEMM's: --down)
                assert triton_moe.MoeConfig(**dict(vars(d), CHUNK=1024, DOWN=None)) in cands, (shape, tokens, weights)
                assert d.DOWN is None or d in lab.down_candidates(dataclasses.replace(d, DOWN=None), weights)


def test_decode_candidates_fit_and_hold_the_defaults():
    cands = lab.candidates(decode=True)
    assert cands and all(lab.gate_up_smem(c) <= lab.SMEM for c in cands)
    assert {c.BLOCK_M for c in cands} == {16, 32}
    for shape in lab.SHAPES:
        for tokens in (8, 16, 64):  # Qwen3-30B-A3B: 0.5-4 rows an expert; Mixtral-8x7B: 2-16
            for weights in ("bf16", "channel"):
                d = lab.default_config(shape, tokens, weights)
                assert triton_moe.MoeConfig(**dict(vars(d), CHUNK=1024)) in cands, (shape, tokens, weights)


def test_down_candidates_keep_the_gate_up_tile_and_fit():
    base = lab.default_config("mixtral-8x7b", 16, "channel")
    for weights in ("bf16", "block128"):
        cands = lab.down_candidates(base, weights)
        assert cands and all(c.DOWN and vars(c) | {"DOWN": None} == vars(base) for c in cands)
        assert all(c.DOWN[2] * 128 * 128 >= 4 * c.BLOCK_M * c.DOWN[0] for c in cands)  # the accumulator's registers
        assert all(c.DOWN[3] * (c.BLOCK_M + c.DOWN[0]) * c.DOWN[1] * 2 <= lab.SMEM for c in cands)
        assert max(c.DOWN[1] for c in cands) == (128 if weights == "block128" else 256)


def test_weight_bytes_count_each_chosen_expert_once():
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])
    assert lab.weight_bytes(ids, 8, 4, "bf16") == 3 * 3 * 8 * 4 * 2
    assert lab.weight_bytes(ids, 8, 4, "channel") == 3 * 3 * 8 * 4


def test_previous_is_the_heuristic_config_for_keeps():
    e, k, h, i = lab.SHAPES["qwen3-30b-a3b"]
    for bucket in (1, 2, 4, 8, 16, 256):  # up to 16 rows an expert: unchanged
        assert lab.previous(bucket, e, k, h, i) == triton_moe.config_for(bucket, e, k, h, i, torch.bfloat16)
    assert lab.previous(2048, e, k, h, i) != triton_moe.config_for(2048, e, k, h, i, torch.bfloat16)


@pytest.mark.parametrize("weights", ["bf16", "channel", "block128"])
def test_inputs_run_at_the_default_tiles(monkeypatch, weights):
    monkeypatch.setitem(lab.SHAPES, "tiny", (4, 2, 256, 256))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter, or the GPU where there is one
    args, kw = lab.inputs("tiny", 64, weights, device=device)
    assert args[3].dtype == (torch.bfloat16 if weights == "bf16" else torch.float8_e4m3fn)
    cfg = lab.default_config("tiny", 64, weights)
    assert cfg.BLOCK_M > 16  # 32 rows an expert: the swept tiles
    y = triton_moe.fused_moe(*args, **kw, config=cfg)
    assert y.shape == (64, 256) and torch.isfinite(y.float()).all()
    x, route, ids, w1, w2 = args  # against the reference, the fp8 experts dequantized as the kernels do
    if kw:
        w1, w2 = (fp8_ref.dequantize_experts(q, kw[s], x.dtype) for q, s in ((w1, "s_gate_up"), (w2, "s_down")))
    ref = moe_ref.fused_moe(x, route, ids, w1, w2).float()
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()  # the lab's own check
    few, _ = lab.inputs("tiny", 64, weights, device=device, experts=1)  # the compile workers': E down to k
    assert few[3].shape[0] == 2 and int(few[2].max()) == 1
