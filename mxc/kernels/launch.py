"""How kernel wrappers launch Triton kernels: one call, three launchers.

Every wrapper in ``kernels/`` ends in ``launch(kernel, grid, args, constexprs,
num_warps=..., num_stages=...)``. Kernels follow one convention so they can be
compiled ahead of time: arguments are tensors (pointers), dynamic integers
or floats, and host tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``: TMA loads on
sm_90; the binary depends on the descriptor's dtype and block shape, the launch encodes its address, shape
and strides) only (no strides: tensors are contiguous, static sizes are constexprs), so a kernel's binary
depends only on its constexprs, num_warps, num_stages and the argument types.

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
import hashlib
import inspect
import json
import re
from typing import Callable

import torch

Launcher = Callable[..., None]


def jit_launch(kernel, grid, args, constexprs, num_warps, num_stages):
    kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


def jit_launch_pdl(kernel, grid, args, constexprs, num_warps, num_stages):
    """``jit_launch`` as the runtime launches a ``pdl`` artifact's kernels: with ``USE_PDL`` where a kernel takes
    it and the programmatic-stream-serialization attribute (Triton's ``launch_pdl``), for labs and GPU tests."""
    kernel[grid](*args, **with_pdl(kernel, constexprs, True), num_warps=num_warps, num_stages=num_stages,
                 launch_pdl=True)


jit_launch_pdl.pdl = True


_launcher: Launcher = jit_launch


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for the wrappers' grid and block arithmetic on the host: Triton's is a constexpr function
    (3.5 on), whose Python call costs ~6 us, and a forward's wrappers make hundreds of calls."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` on the host (0 for 0, as Triton's), without its call cost (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def stream_handle(device: torch.device | None = None) -> int:
    """The current CUDA stream of ``device`` (default: the current device) as the driver's handle, an int, for
    launches made outside torch (the artifact's cubins, a ctypes library's kernels). Through torch's C accessor,
    as Triton's own launcher does: ``torch.cuda.current_stream()`` spends several microseconds a call in
    Python finding the device, and every launch pays it."""
    if _RAW_STREAM is None:
        return (torch.cuda.current_stream() if device is None else torch.cuda.current_stream(device)).cuda_stream
    index = device.index if device is not None else None
    return _RAW_STREAM(torch._C._cuda_getDevice() if index is None else index)


def pdl_active() -> bool:
    """Whether the launcher in use launches kernels for programmatic dependent launch now (the runtime's for a
    ``pdl`` artifact outside its plain-launch buckets, or ``jit_launch_pdl``): what a kernel launched outside
    ``launch`` (a ctypes library's) should do to match its neighbours."""
    return bool(getattr(_launcher, "pdl", False) and getattr(_launcher, "pdl_launch", True))


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


def check_operand(name: str, t, shape, dtype, device) -> None:
    """A wrapper's optional tensor argument (bias, residual, out, norm weight) as kernels take them:
    contiguous, of this shape, dtype and device; else one ValueError naming what was expected."""
    if (t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous()
            or t.device != device):
        raise ValueError(f"{name} must be contiguous {list(shape)} {dtype} on {device}")


# --- what identifies one compiled binary ------------------------------------------

TRITON_DTYPES = {
    "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float8_e4m3fn": "fp8e4nv",
    "torch.float8_e5m2": "fp8e5", "torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16",
    "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1",
}


def is_descriptor(value) -> bool:
    """A host tensor descriptor (``TensorDescriptor``; duck-typed, so nothing imports Triton for it)."""
    return hasattr(value, "block_shape") and hasattr(value, "base")


def descriptor_type(desc) -> str:
    """Triton's signature type of a host tensor descriptor, e.g. ``tensordesc<bf16[64, 128]>``."""
    return f"tensordesc<{TRITON_DTYPES[str(desc.base.dtype)]}[{', '.join(map(str, desc.block_shape))}]>"


def descriptor_rank(arg_type: str) -> int | None:
    """The rank of a ``tensordesc<dtype[block]>`` signature type (its block's dimensions), None for other types."""
    m = re.match(r"tensordesc<\w+\[([^\]]*)\]>", arg_type)
    return m.group(1).count(",") + 1 if m else None


def _arg_type(value) -> str:
    if value is None:
        return "constexpr"  # an absent optional pointer: Triton specialises it away
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"  # dynamic sizes; kernels widen to int64 before forming offsets
    if isinstance(value, float):
        return "fp32"
    if is_descriptor(value):
        return descriptor_type(value)
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        raise TypeError(f"unsupported kernel argument {value!r}")
    return "*" + TRITON_DTYPES[str(dtype)]


def kernel_id(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}:{fn.__name__}"


def runtime_params(kernel) -> list[str]:
    """Names of a kernel's non-constexpr parameters (JIT or interpreted function)."""
    if hasattr(kernel, "params"):
        return [p.name for p in kernel.params if not p.is_constexpr]
    sig = inspect.signature(kernel.fn)
    return [n for n, p in sig.parameters.items() if "constexpr" not in str(p.annotation)]


def constexpr_defaults(kernel) -> dict:
    """The kernel's constexpr parameters that have defaults, with them."""
    sig = inspect.signature(getattr(kernel, "fn", kernel))
    return {n: p.default for n, p in sig.parameters.items()
            if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty}


def spec_of(kernel, args: list, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """The identity of the binary this launch needs: kernel, argument types, constexprs (defaults
    filled in, so the spec compiles as it stands), warps, stages."""
    names = runtime_params(kernel)
    if len(names) != len(args):
        raise TypeError(f"{kernel_id(kernel)} takes {len(names)} runtime arguments ({', '.join(names)}), "
                        f"got {len(args)}")
    signature = {n: _arg_type(a) for n, a in zip(names, args)}
    consts = {n: a for n, a in zip(names, args) if a is None}
    consts.update({**constexpr_defaults(kernel), **constexprs})
    signature.update({n: "constexpr" for n in consts if n not in signature or consts[n] is None})
    return {"kernel": kernel_id(kernel), "signature": signature, "constexprs": consts,
            "num_warps": num_warps, "num_stages": num_stages}


def spec_key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def with_pdl(kernel, constexprs: dict, pdl: bool) -> dict:
    """``constexprs`` with ``USE_PDL`` set for a kernel that takes it, when the artifact uses
    programmatic dependent launch (``mxc.kernels.pdl``)."""
    if pdl and "USE_PDL" in getattr(kernel, "arg_names", ()):
        return {**constexprs, "USE_PDL": True}
    return constexprs


class Recorder:
    """A launcher that runs nothing and remembers the spec of every launch (tensors may be on ``meta``);
    with ``pdl``, of the programmatic-dependent-launch variant of each kernel that has one."""

    def __init__(self, pdl: bool = False):
        self.specs: dict[str, dict] = {}
        self.pdl = pdl

    def __call__(self, kernel, grid, args, constexprs, num_warps, num_stages):
        spec = spec_of(kernel, args, with_pdl(kernel, constexprs, self.pdl), num_warps, num_stages)
        self.specs.setdefault(spec_key(spec), spec)
