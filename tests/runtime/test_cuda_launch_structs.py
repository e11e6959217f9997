"""The ctypes mirrors of the CUDA driver's launch structs used by --pdl artifacts match the driver's layout
(cuda.h: CUlaunchAttributeValue is a 64-byte union, CUlaunchAttribute 72 bytes with the value at 8,
CUlaunchConfig 56 bytes), and the recorder asks for the PDL variant only of kernels that have one."""

from __future__ import annotations

import ctypes

import torch

from mxc.kernels import launch, triton_norm
from mxc.runtime.cuda_launch import _LaunchAttribute, _LaunchAttributeValue, _LaunchConfig


def test_launch_struct_layout():
    assert ctypes.sizeof(_LaunchAttributeValue) == 64
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.sharedMemBytes.offset, _LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)


def test_recorder_asks_for_pdl_variants():
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")  # noqa: E731
    for pdl in (False, True):
        rec = launch.Recorder(pdl=pdl)
        with launch.using(rec):
            triton_norm.rms_norm(meta(3, 64), meta(64), 1e-5)
        (spec,) = rec.specs.values()
        assert spec["constexprs"]["USE_PDL"] is pdl  # filled in from the default when not asked for
    assert launch.with_pdl(object(), {"A": 1}, True) == {"A": 1}  # a kernel without USE_PDL launches as before
