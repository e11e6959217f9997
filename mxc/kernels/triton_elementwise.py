"""Elementwise and gather ops on the GPU: ``silu_mul``, ``embedding``, ``add`` (generated Triton kernels).

Shapes: ``silu_mul`` x [..., 2I] (gate then up halves, as ``torch_ref.silu_mul``
chunks it) -> [..., I]; ``embedding`` ids [T] int64, table [V, H] -> [T, H];
``add`` a, b [..., N] (same shape and dtype, no broadcasting) -> [..., N].
Every kernel runs on a 2-D grid of (rows, column blocks of ``BLOCK_N``), the row
width a constexpr; values are computed in fp32 and rounded once at the store,
except where the torch reference rounds in between (``silu`` before the
multiply).

Each kernel is rendered per row width from ``kernels/templates/``
(``silu_mul.py.j2``: silu(gate) * up of one row block; ``embedding.py.j2``: row
``ids[t]`` of the table; ``add.py.j2``: a + b); the functions here check,
allocate and launch them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels import kernel_templates
from mxc.kernels.launch import cdiv, launch, next_pow2

MAX_BLOCK_N = 1024


@triton.jit
def _silu_mul(gate, up, ty: tl.constexpr):
    """``silu(gate) * up`` rounded to ``ty`` from fp32 values of ``ty``, as ``torch_ref.silu_mul``: the silu rounded
    to ``ty`` before the multiply. A 16-bit ``ty`` divides with Triton's fp32 division (approximate on the GPU,
    within 2 ulp before the rounding), fp32 with the IEEE one. Shared by the SiLU kernel, the fp8 quantize's
    SiLU prologue and the fp8 GEMV's SiLU epilogue, so every path computes the same values."""
    if ty == tl.float32:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    return (act * up).to(ty)


def _kernel(template: str, size_name: str, n: int):
    """The rendered kernel of ``template`` for rows of ``n`` elements, its BLOCK_N and its num_warps."""
    block_n, num_warps = _config(n)
    kernel = kernel_templates.kernel(template, f"{template}_kernel", **{size_name: n, "BLOCK_N": block_n})
    return kernel, block_n, num_warps


def _config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for rows of ``n`` elements."""
    block_n = min(next_pow2(n), MAX_BLOCK_N)
    return block_n, max(1, min(4, block_n // 256))


def _check_out(name: str, out: torch.Tensor, shape, dtype, device) -> None:
    assert out.shape == tuple(shape) and out.dtype == dtype and out.is_contiguous() and out.device == device, (
        f"{name}: out must be contiguous {dtype} {tuple(shape)} on {device}, "
        f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for ``x`` [..., 2I] = [gate | up] -> [..., I]."""
    assert x.dim() >= 1 and x.is_contiguous(), "silu_mul: x must be contiguous (kernels take no strides)"
    assert x.shape[-1] % 2 == 0, f"silu_mul: last dim {x.shape[-1]} must be even (gate and up halves)"
    I = x.shape[-1] // 2
    assert I > 0, "silu_mul: x's last dim is empty"
    shape = (*x.shape[:-1], I)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _check_out("silu_mul", out, shape, x.dtype, x.device)
    kernel, block_n, num_warps = _kernel("silu_mul", "I", I)
    launch(kernel, (x.numel() // (2 * I), cdiv(I, block_n)), [x, out], {}, num_warps=num_warps, num_stages=1)
    return out


def embedding(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``table[ids]``: ids [T] int64, table [V, H] -> [T, H]. Ids must lie in [0, V) (not checked)."""
    assert ids.dim() == 1 and ids.dtype == torch.int64 and ids.is_contiguous(), (
        f"embedding: ids must be a contiguous int64 [T], got {ids.dtype} {tuple(ids.shape)}")
    assert table.dim() == 2 and table.is_contiguous(), "embedding: table must be a contiguous [V, H]"
    assert ids.device == table.device, f"embedding: ids on {ids.device}, table on {table.device}"
    T, H = ids.shape[0], table.shape[1]
    assert H > 0, "embedding: table rows are empty"
    if out is None:
        out = torch.empty((T, H), dtype=table.dtype, device=table.device)
    _check_out("embedding", out, (T, H), table.dtype, table.device)
    kernel, block_n, num_warps = _kernel("embedding", "H", H)
    launch(kernel, (T, cdiv(H, block_n)), [ids, table, out], {}, num_warps=num_warps, num_stages=1)
    return out


def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a + b for same-shape, same-dtype contiguous tensors (``out`` may alias ``a`` or ``b``)."""
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, (
        f"add: a and b must match in shape, dtype and device, got {a.dtype} {tuple(a.shape)} on {a.device} "
        f"and {b.dtype} {tuple(b.shape)} on {b.device}")
    assert a.is_contiguous() and b.is_contiguous(), "add: a and b must be contiguous (kernels take no strides)"
    if out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    _check_out("add", out, a.shape, a.dtype, a.device)
    N = a.shape[-1] if a.dim() else 1
    assert N > 0, "add: last dim is empty"
    kernel, block_n, num_warps = _kernel("add", "N", N)
    launch(kernel, (a.numel() // N, cdiv(N, block_n)), [a, b, out], {}, num_warps=num_warps, num_stages=1)
    return out
