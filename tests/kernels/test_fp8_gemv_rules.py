"""The fp8 GEMV's config rules (``triton_fp8_gemv.config_for``): which version, tiles, K split, preload and
weight-only mode each bucket and shape gets, what ``MEASURED`` and ``OVERRIDES`` change, and the tuning candidates.
Pure functions of shapes: nothing launches (the kernels under these configs: test_fp8_kernels.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mxc.kernels import gemv_tuning
from mxc.kernels import triton_fp8 as tf
from mxc.kernels import triton_fp8_gemv as tfv
from mxc.kernels.triton_fp8 import QGemmConfig, QGemvConfig

sys.path.insert(0, str(Path(__file__).parent))  # fp8_cases.py (pytest imports in importlib mode)
from fp8_cases import GRANS  # noqa: E402


def test_preload_rule(monkeypatch):
    """Small one-row matrices (rows of a power of two, at most PRELOAD_MAX_BYTES) preload, in tiles that fill
    the GPU; larger ones, ragged or long rows, block scales and more rows do not."""
    o = tf.config_for(1, 4096, 4096, torch.bfloat16, "channel")  # Llama-3-8B's o projection: 16 MiB
    assert o.PRELOAD and o.SPLIT_K == 1 and o.BLOCK_N * 4096 == tfv.PRELOAD_TILE_BYTES and o.num_warps == 8
    assert tfv.preloads(4096, 4096, torch.bfloat16, "tensor")
    assert not tfv.preloads(4096, 4096, torch.bfloat16, "block128")
    assert not tfv.preloads(8192, 4096, torch.bfloat16, "channel")  # 32 MiB
    assert not tfv.preloads(2048, 3000, torch.bfloat16, "channel")  # K not a power of two
    assert not tf.config_for(2, 4096, 4096, torch.bfloat16, "channel").PRELOAD
    small = tf.config_for(1, 512, 4096, torch.bfloat16, "channel")
    assert small.PRELOAD and -(-512 // small.BLOCK_N) >= tf.NUM_SMS
    monkeypatch.setattr(tfv, "PRELOAD_MAX_BYTES", 0)
    assert not tfv.preloads(4096, 4096, torch.bfloat16, "channel")


def test_weight_only_config_rule(monkeypatch):
    """Under WEIGHT_ONLY_M1 (the default) the one-row FMA configs (o, down) multiply x unquantized;
    tensor-core configs (qkv, gate/up at one row; every config from two rows) keep the quantize kernel."""
    assert tfv.WEIGHT_ONLY_M1
    for n, k in [(4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)]:
        for mb in (1, 2, 8):
            cfg = tf.config_for(mb, n, k, torch.bfloat16, "channel")
            assert cfg.WEIGHT_ONLY == (mb == 1 and not cfg.USE_DOT) and cfg.WEIGHT_ONLY != cfg.PREQUANT
            tfv._check_gemv_config(cfg, False)
    # long rows (the down GEMV's 14336) in v2's loop, [8, 2048] steps; o's 4096 stays v1
    assert [tf.config_for(1, 4096, k, torch.bfloat16, "channel").REDUCE_STEPS for k in (4096, 14336)] == [False, True]
    assert tf.config_for(1, 4096, 14336, torch.bfloat16, "channel").BLOCK_K == 2048
    tuned = QGemvConfig(8, 1024, num_warps=8, WEIGHT_ONLY=True)  # a measured config wins over the long-row rule
    monkeypatch.setattr(tfv, "MEASURED", {(1, 4096, 14336, torch.bfloat16, "channel"): tuned})
    assert tf.config_for(1, 4096, 14336, torch.bfloat16, "channel") == tuned
    monkeypatch.setattr(tfv, "OVERRIDES", {(1, 4096, 14336): {"BLOCK_K": 1024}})  # a bench's override, after the rules
    assert tf.config_for(1, 4096, 14336, torch.bfloat16, "channel").BLOCK_K == 1024
    monkeypatch.setattr(tfv, "REDUCE_STEPS_MIN_K", 0)
    assert not tf.config_for(1, 4096, 14336, torch.bfloat16, "block128").REDUCE_STEPS
    monkeypatch.setattr(tfv, "WEIGHT_ONLY_M1", False)
    assert tf.config_for(1, 4096, 4096, torch.bfloat16, "channel").PREQUANT
    with pytest.raises(ValueError, match="WEIGHT_ONLY"):
        tfv._check_gemv_config(QGemvConfig(32, 64, USE_DOT=True, WEIGHT_ONLY=True), False)
    with pytest.raises(ValueError, match="REDUCE_STEPS"):
        tfv._check_gemv_config(QGemvConfig(32, 64, USE_DOT=True, REDUCE_STEPS=True), False)


def test_swap_ab_one_slice(monkeypatch):
    """``SWAP_AB_ONE_SLICE`` (the default): the wgmma configs the rule would split over K run in one slice at 5
    stages; other configs (unsplit wgmma ones too) and ``MEASURED`` entries keep theirs, and the configs stay valid."""
    assert tfv.SWAP_AB_ONE_SLICE
    shapes = [(6144, 4096), (4096, 4096), (5120, 2048), (2048, 4096), (28672, 4096), (4096, 14336)]
    keys = [(mb, n, k, gran) for mb in tf.M_BUCKETS for n, k in shapes for gran in GRANS]
    monkeypatch.setattr(tfv, "SWAP_AB_ONE_SLICE", False)
    before = {key: tf.config_for(*key[:3], torch.bfloat16, key[3]) for key in keys}
    monkeypatch.setattr(tfv, "SWAP_AB_ONE_SLICE", True)
    assert any(cfg.SWAP_AB and cfg.SPLIT_K > 1 for cfg in before.values())
    assert any(cfg.SWAP_AB and cfg.SPLIT_K == 1 for cfg in before.values())  # gate/up (28672 rows): unchanged
    for key, old in before.items():
        cfg = tf.config_for(*key[:3], torch.bfloat16, key[3])
        tfv._check_gemv_config(cfg, key[3] == "block128")
        if (*key[:3], torch.bfloat16, key[3]) in tfv.MEASURED or not old.SWAP_AB or old.SPLIT_K == 1:
            assert cfg == old, key
        else:
            assert cfg == replace(old, SPLIT_K=1, num_stages=5), key


def test_config_table():
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (512, 4096)]
    for gran in GRANS:
        for mb in tf.M_BUCKETS:
            for n, k in shapes:
                cfg = tf.config_for(mb, n, k, torch.bfloat16, gran)
                tfv._check_gemv_config(cfg, gran == "block128")
                if (mb, n, k, torch.bfloat16, gran) in tfv.MEASURED:  # tuned on the GPU: not the rules below
                    tuned = tfv.MEASURED[(mb, n, k, torch.bfloat16, gran)]
                    assert cfg == (replace(tuned, PREQUANT=False, WEIGHT_ONLY=True) if mb == 1 and not tuned.USE_DOT
                                   else tuned)  # the long-row rule does not override a measured config
                    continue
                # w @ x^T on wgmma from 2 rows, and at one row for N > K (measured faster), not block128
                swap = gran != "block128" and (mb > 1 or n > k)
                assert cfg.SWAP_AB == swap and cfg.USE_DOT == (mb > 1 or swap)
                assert cfg.PREQUANT != cfg.WEIGHT_ONLY and cfg.WEIGHT_ONLY == (mb == 1 and not swap)  # x as it is
                assert cfg.REDUCE_STEPS == (cfg.WEIGHT_ONLY and k >= tfv.REDUCE_STEPS_MIN_K)  # long rows: v2's loop
                assert cfg.BLOCK_K % 128 == 0  # whole 16-byte loads of e4m3 across a warp
                # small one-row weight-only matrices load whole tiles before the PDL wait
                assert cfg.PRELOAD == (cfg.WEIGHT_ONLY and not cfg.REDUCE_STEPS and gran != "block128"
                                       and n * k <= tfv.PRELOAD_MAX_BYTES)
                # split K where the row tiles cannot fill the GPU (small N; 64-row SWAP_AB tiles: N < 8448, unless
                # SWAP_AB_ONE_SLICE, the default, runs those in one slice)
                assert (cfg.SPLIT_K > 1) == ((n == 512 and not swap and not cfg.PRELOAD)
                                             or (swap and not tfv.SWAP_AB_ONE_SLICE and -(-n // 64) < tf.NUM_SMS))
        assert all(not c.USE_DOT or c.SWAP_AB for c in gemv_tuning.fp8_candidates(1, gran))  # v1, or w @ x^T on wgmma
        assert any(c.WEIGHT_ONLY for c in gemv_tuning.fp8_candidates(1, gran))  # what config_for runs at one row
        for m in (2, 4, 8):
            assert not any(c.WEIGHT_ONLY for c in gemv_tuning.fp8_candidates(m, gran))
            assert {c.USE_DOT for c in gemv_tuning.fp8_candidates(m, gran)} == {False, True}
        assert all(c.USE_DOT for c in gemv_tuning.fp8_candidates(32, gran))
        for m in tf.M_BUCKETS:  # fused and prequantized activations for each kernel version
            cands = [c for c in gemv_tuning.fp8_candidates(m, gran) if not c.SWAP_AB]
            for dot in {c.USE_DOT for c in cands}:
                assert {c.PREQUANT for c in cands if c.USE_DOT == dot} == {False, True}, (m, gran, dot)
        # v1 within 128 fp32 registers a thread (BLOCK_N * BLOCK_K), as candidates(): tiles at the budget are kept
        v1 = [c for c in gemv_tuning.fp8_candidates(1, gran) if not c.USE_DOT and not c.REDUCE_STEPS]
        assert all(c.BLOCK_N * c.BLOCK_K <= 128 * 32 * c.num_warps for c in v1)
        assert any(c.BLOCK_N * c.BLOCK_K == 128 * 32 * c.num_warps for c in v1)
        for c in gemv_tuning.fp8_candidates(16, gran):
            tfv._check_gemv_config(c, gran == "block128")
        assert all(c.USE_DOT for c in gemv_tuning.fp8_candidates(16, gran))  # v3 (and SWAP_AB) from 16
        one = gemv_tuning.fp8_candidates(1, gran)  # v1 weight-only both as config_for runs it and under REDUCE_STEPS
        assert any(c.WEIGHT_ONLY and not c.REDUCE_STEPS for c in one) and any(c.REDUCE_STEPS for c in one)
    small = tf.config_for(1, 512, 4096, torch.bfloat16, "block128")
    assert small.BLOCK_N == 8 and -(-512 // small.BLOCK_N) * small.SPLIT_K >= tf.NUM_SMS // 2
    small = tf.config_for(1, 512, 4096, torch.bfloat16, "channel")  # preloaded: smaller tiles instead of a K split
    assert small.PRELOAD and small.SPLIT_K == 1 and -(-512 // small.BLOCK_N) >= tf.NUM_SMS
    assert tf.gemm_config_for(4096, 4096, torch.bfloat16, "block128") == QGemmConfig(QUANT_BLOCK_K=4096)
