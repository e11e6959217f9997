"""fp8 reference math for the runtime: dequantize weights, quantize activations per token.

The oracle for the fp8 kernels and the CPU target's path for fp8 artifacts:
``qlinear`` quantizes each token's activations to e4m3 with its own scale
(amax / 448), multiplies by the dequantized weight in float32, and rounds the
result to the activation dtype (then bias, then residual, as ``linear``); with ``weight_only`` the
activations multiply unquantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    w = q.float()
    if granularity in ("channel", "tensor"):
        return w * scale[:, None]
    n, k = w.shape
    full = scale.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:n, :k]
    return w * full


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 expert stack [E, R, K] by its row scales [E, R] or 128x128 block scales [E, cdiv(R, 128),
    cdiv(K, 128)], rounded to ``dtype`` (the fused MoE kernels' oracle: they multiply in the activations' dtype)."""
    if scale.dim() == 3:
        return torch.stack([dequantize_weight(e, s, "block128") for e, s in zip(q, scale)]).to(dtype)
    return (q.float() * scale[..., None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization: (fp8 values, float32 scale per row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def qlinear(x, weight, scale, bias=None, residual=None, granularity="channel", prologue=None, weight_only=False):
    """``weight_only``: x multiplies the dequantized weight as it is (the one-row GEMV's ``WEIGHT_ONLY``)."""
    if prologue == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if weight_only:
        xf = x.float()
    else:
        xq, xs = quantize_rows(x)
        xf = xq.float() * xs[:, None]
    y = xf @ dequantize_weight(weight, scale, granularity).t()
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y
