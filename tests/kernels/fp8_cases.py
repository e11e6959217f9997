"""Shared cases of the fp8-weight linear tests (``test_fp8_kernels.py``, ``test_fp8_silu_epilogue.py``): the ragged
shapes, the input generator, the tolerance check, the kernel-launch recorder and the small configs both run.
"""

from __future__ import annotations

import torch

from mxc.kernels import fp8_ref
from mxc.kernels import launch as launch_mod
from mxc.kernels.triton_fp8 import QGemvConfig
from mxc.loaders.quantize import quantize_fp8
from tests.triton_interpreter import bf16_ok

_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
GRANS = ["channel", "tensor", "block128"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 150, 200
# (bias, residual, prologue) combinations, cycled over the parameter grid
FUSIONS = [(False, False, False), (True, False, True), (False, True, True), (True, True, False)]


def _inputs(M, n, k, dtype, gran, bias, residual, prologue, seed):
    g = torch.Generator().manual_seed(seed)
    if prologue:  # gate half then up half; gates spread over silu's curved range
        x = torch.cat([torch.randn(M, k, generator=g) * 3, torch.randn(M, k, generator=g)], dim=1)
    else:
        x = torch.randn(M, k, generator=g)
    x[:, :7] *= 8  # a few outliers per row, as activations have
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w[: n // 2] *= 4  # scales differing between the two 128-row blocks
    q, s = quantize_fp8(w, gran, (n // 3, n - n // 3) if gran == "tensor" else ())
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(M, n, generator=g).to(dtype) if residual else None
    return x.to(dtype), q, s, b, r


def _dev(t):
    return None if t is None else t.to(DEVICE)


def _check(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    y, ref = y.cpu().float(), ref.float()
    assert not y.isnan().any()
    err = (y - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), f"max error {err}, output scale {ref.abs().max().item()}"


def _run(fn, M, dtype, gran, fusion, cfg, seed, n=N, k=K, weight_only=False):
    bias, residual, prologue = fusion
    x, q, s, b, r = _inputs(M, n, k, dtype, gran, bias, residual, prologue, seed)
    pro = "silu_mul" if prologue else None
    y = fn(_dev(x), _dev(q), _dev(s), _dev(b), _dev(r), granularity=gran, prologue=pro, config=cfg)
    weight_only = weight_only or getattr(cfg, "WEIGHT_ONLY", False)
    _check(y, fp8_ref.qlinear(x, q, s, b, r, gran, pro, weight_only=weight_only), dtype)
    return y


def _launching(fn):
    """fn()'s result and the names of the kernels it launched (run as usual)."""
    names = []

    def launcher(kernel, grid, args, constexprs, num_warps, num_stages):
        names.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        launch_mod.jit_launch(kernel, grid, args, constexprs, num_warps, num_stages)

    with launch_mod.using(launcher):
        return fn(), names


def _fusion_id(f):
    return "+".join(n for n, on in zip(("bias", "residual", "silu_mul"), f) if on) or "plain"




# small-M configs: one of each version
V1 = QGemvConfig(BLOCK_N=32, BLOCK_K=64)  # M = 1
V2 = QGemvConfig(BLOCK_N=32, BLOCK_K=64)  # M = 2..8
DOT = QGemvConfig(BLOCK_N=32, BLOCK_K=64, USE_DOT=True)
SWAP = QGemvConfig(BLOCK_N=64, BLOCK_K=64, USE_DOT=True, PREQUANT=True, QUANT_BLOCK_K=128, SWAP_AB=True)
SMALL_M = {1: V1, 3: V2, 17: DOT}


def _variant_id(v):
    M, cfg, gran, dtype, fusion, k = v
    version = "v3-swap" if cfg.SWAP_AB else "v3" if cfg.USE_DOT else "v1" if M == 1 and not cfg.REDUCE_STEPS else "v2"
    return "-".join([f"M{M}", f"K{k}", version, f"split{cfg.SPLIT_K}", gran, str(dtype)[6:], _fusion_id(fusion)]
                    + ["prequant"] * cfg.PREQUANT)

