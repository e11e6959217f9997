"""The register-fed mma.sync fp8 GEMV (``csrc/gemv_fp8_mma.cu``) of one to eight tokens: contract, library, call.

A lab kernel: no build selects it yet. Given x quantized per token (xq [M, K] e4m3, xs [M] fp32, as the
RMSNorm-quantize kernel writes them) and w [N, K] e4m3 with one fp32 scale a row s [N], it computes

    y = bf16(xq @ w^T * xs[:, None] * s[None, :])                          (``reference``)

with the residual added (``residual=``, rounded after the product is) or, with ``epilogue="silu_mul"``, w as
[gate; up] and y [M, N/2] = silu_mul of the product: the Triton GEMV's numerics, in another fp32 summation
order (64-byte chunks per warp, the warps' sums added in order), so equal to it within fp32 rounding.

Why a second fp8 GEMV: the Triton one (``triton_fp8_gemv``, e4m3 wgmma under SWAP_AB) stages its weights
through shared memory; at one token it costs ~2 us a GEMV above its bytes (docs/perf.md, twenty-third run),
about what #5's 1.8x needs. This one loads the weights straight into the MMA's A registers (each thread 16
contiguous bytes of a row, the K order permuted alike in both operands) and issues its first loads before the
PDL wait. ``bench/gemv_mma_lab.py`` times it against the Triton GEMV in a 32-layer decode chain.

Limits (``supports``): 1 <= M <= 8, K a multiple of 64, bf16 outputs, channel or tensor scales (one a row);
sm_89+ (e4m3 mma.sync); built for sm_90a like the other CUDA libraries (``nvcc``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from mxc.kernels import fp8_ref, nvcc, torch_ref

SOURCE = Path(__file__).parent / "csrc" / "gemv_fp8_mma.cu"
PREBUILT_ENV = "MXC_GEMV_MMA_LIBRARY"
MAX_M = 8
CHUNK = 64
EPILOGUES = {None: 0, "residual": 1, "silu_mul": 2}
STATUS = {0: "ok", 1: "unsupported shape (1 <= M <= 8, K a multiple of 64; silu_mul: N even)",
          2: "x or w is not 16-byte aligned", 3: "unsupported config (ks 1/2/4/8, u 2/4/8)", 4: "CUDA error"}
FP8 = torch.float8_e4m3fn
KS, U = 4, 4  # default config: warps a CTA splitting K, 64-byte chunks of a row in flight a thread


def source() -> str:
    return SOURCE.read_text()


def library(out_path=None, log=print) -> Path:
    """The compiled library (nvcc), cached by the source's hash, or the prebuilt one ``$MXC_GEMV_MMA_LIBRARY``
    names; copied to ``out_path`` if given."""
    return nvcc.cached_library("fp8 mma GEMV", "gemv_mma", source,
                               lambda text, path: nvcc.compile_so(text, path, what="fp8 mma GEMV"),
                               PREBUILT_ENV, out_path, log)


def supports(M: int, N: int, K: int, epilogue: str | None = None) -> str | None:
    """None when the kernel takes the shape, else why not (the library's own check, mirrored)."""
    if not 1 <= M <= MAX_M:
        return f"{M} tokens (the kernel takes 1 to {MAX_M})"
    if K < CHUNK or K % CHUNK:
        return f"K = {K} is not a multiple of {CHUNK}"
    if epilogue == "silu_mul" and N % 2:
        return f"silu_mul needs an even number of rows, got {N}"
    return None


class GemvFp8Mma:
    """The compiled library opened with ctypes."""

    def __init__(self, so_path):
        self.path = Path(so_path)
        lib = ctypes.CDLL(str(self.path))
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.mxc_gemv_fp8_mma.argtypes = [p] * 6 + [i] * 7 + [p]
        lib.mxc_gemv_fp8_mma.restype = i
        lib.mxc_gemv_fp8_mma_error.argtypes = []
        lib.mxc_gemv_fp8_mma_error.restype = ctypes.c_char_p
        self._lib = lib

    def __call__(self, xq, xs, w, s, residual=None, *, out=None, epilogue: str | None = None, ks: int = KS,
                 u: int = U, pdl: bool = False, stream: int | None = None) -> torch.Tensor:
        """y (``out`` if given, which may be ``residual``) for xq [M, K] e4m3, xs [M] fp32, w [N, K] e4m3, s [N]."""
        if epilogue not in (None, "silu_mul"):
            raise ValueError(f"epilogue must be None or 'silu_mul', got {epilogue!r}")
        if epilogue and residual is not None:
            raise ValueError("the silu_mul epilogue takes no residual")
        M, K = xq.shape
        N = w.shape[0]
        why = supports(M, N, K, epilogue)
        if why:
            raise ValueError(f"fp8 mma GEMV: {why}")
        cols = N // 2 if epilogue else N
        if out is None:
            out = torch.empty((M, cols), dtype=torch.bfloat16, device=xq.device)
        expect = [("xq", xq, (M, K), FP8), ("xs", xs, (M,), torch.float32), ("w", w, (N, K), FP8),
                  ("s", s, (N,), torch.float32), ("out", out, (M, cols), torch.bfloat16)]
        if residual is not None:
            expect.append(("residual", residual, (M, N), torch.bfloat16))
        for name, t, shape, dtype in expect:
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != xq.device:
                raise ValueError(f"fp8 mma GEMV: {name} must be contiguous {list(shape)} {dtype} on {xq.device}, "
                                 f"got {list(t.shape)} {t.dtype} on {t.device}")
        if stream is None:
            stream = torch.cuda.current_stream(xq.device).cuda_stream
        epi = EPILOGUES["residual" if residual is not None else epilogue]
        status = self._lib.mxc_gemv_fp8_mma(
            xq.data_ptr(), xs.data_ptr(), w.data_ptr(), s.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(), M, N, K, epi, ks, u, int(pdl),
            stream or None)
        if status:
            detail = f": {self._lib.mxc_gemv_fp8_mma_error().decode()}" if status == 4 else ""
            raise RuntimeError(f"fp8 mma GEMV (M={M}, N={N}, K={K}): status {status}, "
                               f"{STATUS.get(status, 'unknown')}{detail}")
        return out


@functools.lru_cache(maxsize=None)
def load(so_path=None) -> GemvFp8Mma:
    """The library at ``so_path`` (default: ``library()``, compiled here or named by ``$MXC_GEMV_MMA_LIBRARY``)."""
    return GemvFp8Mma(so_path or os.environ.get(PREBUILT_ENV) or library(log=lambda *_: None))


def reference(xq, xs, w, s, residual=None, epilogue: str | None = None) -> torch.Tensor:
    """The GEMV in torch (``fp8_ref``'s numerics): bf16."""
    x = xq.float() * xs[:, None]
    if epilogue == "silu_mul":
        return torch_ref.silu_mul((x @ fp8_ref.dequantize_weight(w, s, "channel").t()).to(torch.bfloat16))
    return _qlinear(x, w, s, residual)


def _qlinear(x, w, s, residual):
    y = (x @ fp8_ref.dequantize_weight(w, s, "channel").t()).to(torch.bfloat16)
    return y if residual is None else (residual.float() + y.float()).to(torch.bfloat16)
