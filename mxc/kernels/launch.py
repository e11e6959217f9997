"""How kernel wrappers launch Triton kernels: one call, three launchers.

Every wrapper in ``kernels/`` ends in ``launch(kernel, grid, args, constexprs,
num_warps=..., num_stages=...)``. Kernels follow one convention so they can be
compiled ahead of time: arguments are tensors (pointers) and dynamic integers
or floats only (no strides: tensors are contiguous, static sizes are
constexprs), so a kernel's binary depends only on its constexprs, num_warps,
num_stages and the argument dtypes.

The launcher in use decides what happens:
- ``jit`` (default): ``kernel[grid](*args, **constexprs)`` through Triton's JIT
  (and its interpreter under ``TRITON_INTERPRET=1``), for tests and development;
- a recorder, at build time, notes every launch a forward pass would make
  (tensors on the ``meta`` device), so exactly those are compiled for the target;
- the runtime's precompiled-binary launcher, which loads cubins from the
  artifact and launches them through the CUDA driver (no Triton at load).
"""

from __future__ import annotations

import contextlib
from typing import Callable

Launcher = Callable[..., None]


def _jit_launch(kernel, grid, args, constexprs, num_warps, num_stages):
    kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


_launcher: Launcher = _jit_launch


def launch(kernel, grid: tuple[int, ...], args: list, constexprs: dict, *, num_warps: int = 4,
           num_stages: int = 1) -> None:
    _launcher(kernel, tuple(grid), list(args), dict(constexprs), num_warps, num_stages)


@contextlib.contextmanager
def using(launcher: Launcher):
    """Temporarily route every ``launch`` through ``launcher``."""
    global _launcher
    previous, _launcher = _launcher, launcher
    try:
        yield
    finally:
        _launcher = previous


def install(launcher: Launcher) -> None:
    global _launcher
    _launcher = launcher
