"""Elementwise and gather ops on the GPU: ``silu_mul``, ``embedding``, ``add`` (generated Triton kernels).

Shapes: ``silu_mul`` x [..., 2I] (gate then up halves, as ``torch_ref.silu_mul``
chunks it; or with ``interleave`` B, blocks of B gate then B up columns: ``check_interleave``)
-> [..., I]; ``embedding`` ids [T] int64, table [V, H] -> [T, H];
``add`` a, b [..., N] (same shape and dtype, no broadcasting) -> [..., N].
Every kernel runs on a 2-D grid of (rows, column blocks of ``BLOCK_N``), the row
width a constexpr; values are computed in fp32 and rounded once at the store,
except where the torch reference rounds in between (``silu`` before the
multiply).

Each kernel is rendered per row width from ``kernels/templates/``
(``silu_mul.py.j2``: silu(gate) * up of one row block, the layout a render-time constant; ``embedding.py.j2``: row
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


@triton.jit
def _gate_col(c, PAIR_BLOCK: tl.constexpr):
    """Where gate column ``c`` lies in a gate/up row of blocks of PAIR_BLOCK gate then PAIR_BLOCK up columns
    (``check_interleave``): (c // B) * 2B + c % B = c + (c // B) * B for B = PAIR_BLOCK; its up column lies B
    further. Shared by the SiLU kernel, the fp8 quantize's SiLU prologue and the fp8 GEMV's SiLU epilogue."""
    return c + c // PAIR_BLOCK * PAIR_BLOCK


def check_interleave(i: int, interleave: int) -> None:
    """ValueError unless ``interleave`` names a layout of a gate/up row of 2 x ``i`` columns: 0, the gate half
    then the up half; or B, a power of two dividing ``i``: blocks of 2B columns, block b holding gate columns
    [bB, bB + B) then the up columns of the same indices (B = i is the halves layout again)."""
    ok = isinstance(interleave, int) and (interleave == 0 or (
        interleave > 0 and interleave & (interleave - 1) == 0 and i % interleave == 0))
    if not ok:
        raise ValueError(f"interleave must be 0 (gate then up halves) or a power of two dividing the {i} gate "
                         f"columns, got {interleave}")


def _kernel(template: str, size_name: str, n: int, **params):
    """The rendered kernel of ``template`` for rows of ``n`` elements (and ``params``), its BLOCK_N and its
    num_warps."""
    block_n, num_warps = _config(n)
    kernel = kernel_templates.kernel(template, f"{template}_kernel", **{size_name: n, "BLOCK_N": block_n}, **params)
    return kernel, block_n, num_warps


def _config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for rows of ``n`` elements."""
    block_n = min(next_pow2(n), MAX_BLOCK_N)
    return block_n, max(1, min(4, block_n // 256))


def _check_out(name: str, out: torch.Tensor, shape, dtype, device) -> None:
    assert out.shape == tuple(shape) and out.dtype == dtype and out.is_contiguous() and out.device == device, (
        f"{name}: out must be contiguous {dtype} {tuple(shape)} on {device}, "
        f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, interleave: int = 0) -> torch.Tensor:
    """silu(gate) * up for ``x`` [..., 2I] = [gate | up] -> [..., I]; with ``interleave`` B, x's columns come in
    blocks of B gate then B up columns (``check_interleave``)."""
    assert x.dim() >= 1 and x.is_contiguous(), "silu_mul: x must be contiguous (kernels take no strides)"
    assert x.shape[-1] % 2 == 0, f"silu_mul: last dim {x.shape[-1]} must be even (gate and up halves)"
    I = x.shape[-1] // 2
    assert I > 0, "silu_mul: x's last dim is empty"
    check_interleave(I, interleave)
    shape = (*x.shape[:-1], I)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _check_out("silu_mul", out, shape, x.dtype, x.device)
    # the halves layout renders without the parameter: the kernel it always was (its source names its params)
    kernel, block_n, num_warps = _kernel("silu_mul", "I", I, **({"PAIR_BLOCK": interleave} if interleave else {}))
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
