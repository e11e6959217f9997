"""A launcher that catches kernels touching memory just outside their tensors (interpreter, CPU).

``guarded()`` (a ``launch.using`` context) runs every launch on copies of its tensor arguments, each in
the middle of a buffer whose other bytes are 0xFF (NaN in fp32/fp16/bf16/e4m3, -1 in the integer
dtypes), and afterwards asserts that those guard bytes are intact and copies the tensors back. A store
past a tensor's end (a mask off by one on the last row or column, whose neighbour inside the tensor the
interpreter's in-order programs would overwrite with the right value) fails the assertion, and an
unmasked load past a tensor's end reads NaN into the result instead of whatever the allocator left
there. Tensor descriptors (TMA) are passed through unguarded. Arguments that alias one tensor (``out``
= ``residual``) share one guarded copy.
"""

from __future__ import annotations

import contextlib

import torch

from mxc.kernels import launch as launch_mod

GUARD_BYTES = 1 << 16  # on each side (a whole stray tile lands inside it); a multiple of every dtype's size


def _guard(t: torch.Tensor):
    nbytes = t.numel() * t.element_size()
    buf = torch.full((nbytes + 2 * GUARD_BYTES,), 0xFF, dtype=torch.uint8, device=t.device)
    view = buf[GUARD_BYTES:GUARD_BYTES + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    return buf, view


@contextlib.contextmanager
def guarded():
    real = launch_mod._launcher

    def launcher(kernel, grid, args, constexprs, num_warps, num_stages):
        copies = {}  # (data_ptr, nbytes) -> (original, guard buffer, guarded view)
        new_args = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                assert a.is_contiguous(), "guarded launches take contiguous tensors"
                key = (a.data_ptr(), a.numel() * a.element_size())
                if key not in copies:
                    copies[key] = (a, *_guard(a))
                new_args.append(copies[key][2])
            else:
                new_args.append(a)
        real(kernel, grid, new_args, constexprs, num_warps, num_stages)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        for original, buf, view in copies.values():
            n = original.numel() * original.element_size()
            before, after = buf[:GUARD_BYTES], buf[GUARD_BYTES + n:]
            assert (before == 0xFF).all() and (after == 0xFF).all(), (
                f"{name} wrote outside a {tuple(original.shape)} {original.dtype} argument "
                f"({int((before != 0xFF).sum())} bytes before it, {int((after != 0xFF).sum())} after)")
            original.copy_(view)

    with launch_mod.using(launcher):
        yield
