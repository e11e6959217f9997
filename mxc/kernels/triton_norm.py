"""RMSNorm on the GPU: ``rms_norm`` and the fused residual ``add_rms_norm`` (generated Triton kernels).

Shapes: ``x`` [..., H] (rows = everything but the last dim; the Qwen3 per-head
q/k norm is ``x`` [T, heads, D] with ``weight`` [D]), ``weight`` [H],
``residual`` [..., H]. One program normalises one row, held whole in one block
of ``BLOCK_H = next_power_of_2(H)`` lanes (masked at the ragged edge).

Numerics follow ``torch_ref.rms_norm`` (Hugging Face Llama): the sum of
squares is taken in fp32, the normalised row is rounded to ``x``'s dtype
*before* it is multiplied by the weight, and the product is rounded to the
output dtype. ``add_rms_norm`` rounds ``x + residual`` to the model dtype,
stores it as the new residual and normalises that rounded sum, as
``torch_ref.add`` followed by ``torch_ref.rms_norm`` does.

The kernel is rendered per row width from ``kernels/templates/rms_norm.py.j2``
(``RESIDUAL`` selects the fused residual add: one read of x and residual, two writes);
the functions here check, allocate and launch it.
"""

from __future__ import annotations

import torch

from mxc.kernels import kernel_templates
from mxc.kernels.launch import launch, next_pow2


def norm_kernel(H: int, residual: bool):
    """The rendered RMSNorm kernel for rows of H features (with the residual add or not)."""
    return kernel_templates.kernel("rms_norm", "rms_norm_kernel", H=H, BLOCK_H=next_pow2(H),
                                   RESIDUAL=residual)


def row_warps(H: int) -> int:
    """Warps of a kernel holding one row of H features in one block (RMSNorm, the push all-reduce)."""
    return max(1, min(8, next_pow2(H) // 256))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() >= 1 and x.shape[-1] > 0, "rms_norm: x must have a non-empty last dim"
    assert x.is_contiguous(), "rms_norm: x must be contiguous (kernels take no strides)"
    assert weight.is_contiguous() and weight.dim() == 1, "rms_norm: weight must be a contiguous 1-D tensor"
    assert weight.shape[0] == x.shape[-1], (
        f"rms_norm: weight has {weight.shape[0]} features, x's last dim is {x.shape[-1]}")
    assert weight.device == x.device, f"rms_norm: weight on {weight.device}, x on {x.device}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] over its last dim with ``weight`` [H]; ``out`` as torch_ref.rms_norm's dtype."""
    _check(x, weight)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.is_contiguous(), (
        f"rms_norm: out must be contiguous {out_dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    H = x.shape[-1]
    launch(norm_kernel(H, False), (x.numel() // H,), [x, weight, out, float(eps)], {}, num_warps=row_warps(H),
           num_stages=1)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x + residual, rms_norm(x + residual))``, the sum rounded to the model dtype.

    ``residual_out`` may be ``residual`` or ``x`` itself (each program reads its row before writing it).
    """
    _check(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(), (
        f"add_rms_norm: residual must be contiguous {x.dtype} {tuple(x.shape)}, "
        f"got {residual.dtype} {tuple(residual.shape)}")
    assert residual.device == x.device, f"add_rms_norm: residual on {residual.device}, x on {x.device}"
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.is_contiguous(), (
        f"add_rms_norm: out must be contiguous {out_dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    assert residual_out.shape == x.shape and residual_out.dtype == x.dtype and residual_out.is_contiguous(), (
        f"add_rms_norm: residual_out must be contiguous {x.dtype} {tuple(x.shape)}, "
        f"got {residual_out.dtype} {tuple(residual_out.shape)}")
    H = x.shape[-1]
    launch(norm_kernel(H, True), (x.numel() // H,), [x, residual, weight, out, residual_out, float(eps)], {},
           num_warps=row_warps(H), num_stages=1)
    return residual_out, out
