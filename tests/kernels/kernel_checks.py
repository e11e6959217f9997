"""Shared checks of the Triton norm, rope and elementwise kernel tests (``test_norms.py``, ``test_elementwise.py``,
``test_rope_kernel.py``, ``test_kernel_recording.py``, ``test_interpreter_patch.py``).

The model dtypes with their tolerances and the ragged shapes; the ``on_device`` fixture that creates every test
tensor on DEVICE (Triton's interpreter on the CPU off the GPU); output views in the middle of NaN-filled buffers
and the check that nothing was written around them; agreement within one unit in the last place (where a kernel
reproduces the reference's roundings) or within the dtype's tolerance; the normalised rope specs of the test
configs; and ``meta`` tensors with a recording launcher, to run the wrappers ahead of time as the build does.
"""

from __future__ import annotations

import math

import pytest
import torch

from mxc.kernels import kernel_templates
from mxc.kernels import launch as launch_mod
from mxc.models.rope_config import normalize_rope

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}  # relative (and absolute) tolerance
ROWS, WIDTHS = (1, 3, 7), (48, 64, 100)
EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # off the GPU: Triton's interpreter
PAD = 13  # NaN elements on each side of an output view


@pytest.fixture(autouse=True)
def on_device():
    """Create every test tensor on DEVICE (tests name "meta" explicitly where they want it).

    Autouse in each test module that imports it."""
    with torch.device(DEVICE):
        yield


def ids(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def padded(shape, dtype):
    """(buffer, view): a contiguous ``shape`` view in the middle of a NaN-filled buffer."""
    n = math.prod(shape)
    buf = torch.full((n + 2 * PAD,), float("nan"), dtype=dtype)
    return buf, buf[PAD:PAD + n].view(shape)


def assert_padding_untouched(buf):
    assert buf[:PAD].isnan().all() and buf[-PAD:].isnan().all(), "kernel wrote outside its output"


def assert_ulp(out, ref, ulps=1):
    """``out`` within ``ulps`` units in the last place (of ``out``'s dtype, at ``ref``'s magnitude) of ``ref``.

    For float32 the fp32 reduction order itself differs by ulps (and a weight multiply carries them on),
    so float32 uses its relative tolerance instead.
    """
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        return assert_close(out, ref, torch.float32)
    fi = torch.finfo(out.dtype)
    o, r = out.double(), ref.double()
    spacing = fi.eps * torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(fi.tiny))))
    err = (o - r).abs()
    bad = ~(err <= ulps * spacing)  # NaN counts as bad
    assert not bad.any(), (f"{int(bad.sum())}/{bad.numel()} elements off by more than {ulps} ulp; "
                           f"worst {float((err / spacing).nan_to_num(float('inf')).max()):.2f} ulp")


def assert_close(out, ref, dtype, equal_nan=False):
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=equal_nan)


# --- rope specs --------------------------------------------------------------------------------------

ROPE_CONFIGS = {  # config.json fields, as tests/models/test_rope.py writes them
    "default": {"rope_theta": 10000.0, "max_position_embeddings": 2048},
    "linear": {"rope_theta": 10000.0, "max_position_embeddings": 2048,
               "rope_scaling": {"type": "linear", "factor": 2.0}},
    "yarn": {"rope_theta": 10000.0, "max_position_embeddings": 16384,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    "llama3": {"rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}


def rope_spec(kind: str, head_dim: int, partial: bool) -> dict:
    config = dict(ROPE_CONFIGS[kind], partial_rotary_factor=0.5 if partial else 1.0)
    return normalize_rope(config, head_dim)


# --- ahead-of-time recording on the meta device ------------------------------------------------------


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def record(call):
    """Run ``call`` under a recording launcher: (its result, the kernel, grid and constexprs of its one launch)."""
    calls = []
    with launch_mod.using(lambda kernel, grid, args, constexprs, nw, ns: calls.append(
            (kernel, grid, args, constexprs, nw, ns))):
        result = call()
    assert len(calls) == 1, f"expected exactly one launch, got {len(calls)}"
    kernel, grid, args, constexprs, nw, ns = calls[0]
    assert all(isinstance(a, (torch.Tensor, int, float)) for a in args), "launch args: tensors and numbers only"
    assert all(a.device.type == "meta" for a in args if isinstance(a, torch.Tensor))
    return result, kernel, grid, constexprs


def rendered(kernel) -> str:
    """The source the launched kernel was rendered to."""
    return kernel_templates.source(kernel.fn.__module__)
