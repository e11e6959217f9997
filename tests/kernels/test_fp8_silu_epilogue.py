"""The one-token fp8 GEMV's SiLU-and-mul epilogue (``triton_fp8.qlinear_small_m(epilogue="silu_mul")``) against the
SiLU kernel on the GEMV's own output, bit for bit: gate/up rows in halves or interleaved in blocks (the loader's
``interleave_rows``), every GEMV version, the fallbacks to the SiLU kernel (block scales, split K), the errors, and
the default config of a narrow MLP. Runs under TRITON_INTERPRET=1 on the CPU, as ``test_fp8_kernels.py``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mxc.kernels import fp8_ref, torch_ref, triton_elementwise
from mxc.kernels import launch as launch_mod
from mxc.kernels import triton_fp8 as tf
from mxc.kernels import triton_fp8_gemv as tfv
from mxc.loaders.convert import interleave_rows

sys.path.insert(0, str(Path(__file__).parent))  # fp8_cases.py (pytest imports in importlib mode)
from fp8_cases import DOT, DTYPES, K, N, SWAP, V1, V2, _dev, _inputs, _launching, _variant_id  # noqa: E402


# the silu_mul epilogue: (M, config, granularity, dtype, N) -- every version; N / 2 = 75 leaves the last
# program's gate columns partial; block128 and split K fall back to the SiLU kernel after the GEMV
SILU_EPILOGUE = [
    (1, replace(V1, PREQUANT=True, QUANT_BLOCK_K=256), "channel", torch.float16, N),
    (1, replace(V1, WEIGHT_ONLY=True, BLOCK_N=16), "tensor", torch.float32, 2 * 64),
    (3, replace(V2, PREQUANT=True, QUANT_BLOCK_K=256), "tensor", torch.float32, N),
    (17, replace(DOT, PREQUANT=True, QUANT_BLOCK_K=256), "channel", torch.float16, N),
    (5, SWAP, "channel", torch.float16, 2 * 96),
    (1, SWAP, "block128", torch.float16, N),
    (1, replace(SWAP, SPLIT_K=2), "channel", torch.float32, N),
]


@pytest.mark.parametrize("M,cfg,gran,dtype,n", SILU_EPILOGUE,
                         ids=[f"M{v[0]}-{_variant_id((v[0], v[1], v[2], v[3], (0, 0, 0), K))}-N{v[4]}"
                              for v in SILU_EPILOGUE])
def test_small_m_silu_epilogue(M, cfg, gran, dtype, n):
    """silu(gate) * up of [gate; up]'s product equals, bit for bit, the SiLU kernel on the GEMV's own output."""
    x, q, s, _, _ = _inputs(M, n, K, dtype, gran, False, False, False, seed=51 + M)
    x, q, s = _dev(x), _dev(q), _dev(s)
    fused, names = _launching(lambda: tf.qlinear_small_m(x, q, s, granularity=gran, config=cfg, epilogue="silu_mul"))
    plain = tf.qlinear_small_m(x, q, s, granularity=gran, config=cfg)
    assert fused.shape == (M, n // 2)
    assert torch.equal(fused, triton_elementwise.silu_mul(plain))  # the unfused nodes' kernels
    assert ("silu_mul_kernel" in names) == (gran == "block128" or cfg.SPLIT_K > 1), names


def test_silu_epilogue_errors():
    x, q, s, b, r = _inputs(1, N, K, torch.float32, "channel", True, True, False, seed=5)
    with pytest.raises(ValueError, match="epilogue"):
        tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), _dev(b), granularity="channel", epilogue="silu_mul")
    with pytest.raises(ValueError, match="epilogue must be"):
        tf.qlinear_small_m(_dev(x), _dev(q), _dev(s), granularity="channel", epilogue="gelu")


def test_interleaved_rows_layout():
    """The loader's layout (``interleave_rows``): gate row j at (j // B) * 2B + j % B, its up row B further (I = 6,
    B = 2)."""
    assert interleave_rows(torch.arange(12), 2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]


# the silu_mul epilogue over interleaved gate/up rows: (M, config, granularity, dtype, I, B) -- a program's gate
# rows within one block (BLOCK_N / 2 = 16 < B) or over several (32 > B, the last program's partial); split K falls
# back to the SiLU kernel after the GEMV
SILU_INTERLEAVED = [
    (1, replace(V1, WEIGHT_ONLY=True), "channel", torch.float32, 192, 64),
    (3, replace(V2, PREQUANT=True, QUANT_BLOCK_K=256), "tensor", DTYPES[-1], 192, 64),
    (17, replace(DOT, PREQUANT=True, QUANT_BLOCK_K=256), "channel", torch.float16, 96, 32),
    (5, SWAP, "tensor", torch.float16, 80, 16),
    (1, replace(SWAP, SPLIT_K=2), "channel", torch.float32, 192, 64),
]


@pytest.mark.parametrize("M,cfg,gran,dtype,i,b", SILU_INTERLEAVED,
                         ids=[f"{_variant_id((v[0], v[1], v[2], v[3], (0, 0, 0), K))}-I{v[4]}-B{v[5]}"
                              for v in SILU_INTERLEAVED])
def test_small_m_silu_epilogue_interleaved(M, cfg, gran, dtype, i, b):
    """With ``interleave`` B (w's rows and their scales in blocks of B gate then B up rows) the GEMV's epilogue, or
    the SiLU kernel after it where the config has no epilogue, gives bit for bit the halves layout's result on the
    same rows de-interleaved."""
    x, q, s, _, _ = _inputs(M, 2 * i, K, dtype, gran, False, False, False, seed=61 + M)
    qi, si = interleave_rows(q, b), interleave_rows(s, b)
    assert not torch.equal(qi.view(torch.uint8), q.view(torch.uint8))  # I > B: the layouts differ
    x = _dev(x)
    got, names = _launching(lambda: tf.qlinear_small_m(x, _dev(qi), _dev(si), granularity=gran, config=cfg,
                                                       epilogue="silu_mul", interleave=b))
    want = tf.qlinear_small_m(x, _dev(q), _dev(s), granularity=gran, config=cfg, epilogue="silu_mul")
    assert got.shape == (M, i) and torch.equal(got, want)
    assert ("silu_mul_kernel" in names) == (cfg.SPLIT_K > 1), names


def test_silu_epilogue_interleave_launch():
    """PAIR_BLOCK reaches the GEMV only with an interleave: the halves layout's launch is the one it was."""
    launches = []
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: launches.append((kernel, grid, consts))):
        for b in (0, 64):
            tf.qlinear_small_m(meta(2, 4096), meta(384, 4096, dtype=tf.FP8), meta(384, dtype=torch.float32),
                               config=SWAP, epilogue="silu_mul", interleave=b)
    (_, _, quant), (gemv, grid, halves), (_, _, quant_i), (gemv_i, grid_i, pairs) = launches
    assert gemv is gemv_i is tfv._qgemv_kernel and grid == grid_i == (6, 1) and quant == quant_i
    assert "PAIR_BLOCK" not in halves and pairs == {**halves, "PAIR_BLOCK": 64}


def test_silu_epilogue_rejects_bad_interleave():
    x, q, s, _, _ = _inputs(1, 384, K, torch.float32, "channel", False, False, False, seed=6)
    x, q, s = _dev(x), _dev(q), _dev(s)
    with pytest.raises(ValueError, match="no epilogue"):
        tf.qlinear_small_m(x, q, s, granularity="channel", interleave=64)
    for b in (48, 128, -64):  # I = 192
        with pytest.raises(ValueError, match="interleave must be 0"):
            tf.qlinear_small_m(x, q, s, granularity="channel", epilogue="silu_mul", interleave=b)


@pytest.mark.parametrize("n, k", [(24, 64), (64, 64), (128, 256)])
def test_small_m_silu_epilogue_default_config_of_a_narrow_mlp(n, k):
    """A model whose gate and up rows together are no more than its hidden size (2 x intermediate <= hidden) gets
    a one-token FMA config; the default must not be PRELOAD, whose loop has no epilogue (fp8 CUDA builds of such
    models raised ValueError while recording the decode GEMVs)."""
    assert not tfv.config_for(1, n, k, torch.bfloat16, "channel", epilogue=True).PRELOAD
    x, q, s, _, _ = _inputs(1, n, k, torch.bfloat16, "channel", False, False, False, seed=n + k)
    x, q, s = _dev(x), _dev(q), _dev(s)
    fused = tf.qlinear_small_m(x, q, s, epilogue="silu_mul")
    # the one-token FMA GEMV multiplies x unquantized (WEIGHT_ONLY_M1): the product of x and the dequantized weights
    gate_up = x.float().cpu() @ fp8_ref.dequantize_weight(q.cpu(), s.cpu(), "channel").t()
    want = torch_ref.silu_mul(gate_up.to(torch.bfloat16))
    assert fused.shape == (1, n // 2)
    assert float((fused.float().cpu() - want.float()).abs().max()) <= 0.01 * float(want.float().abs().max())
