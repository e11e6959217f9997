"""The ctypes mirrors of the CUDA driver's launch structs used by --pdl artifacts match the driver's layout
(cuda.h: CUlaunchAttributeValue is a 64-byte union, CUlaunchAttribute 72 bytes with the value at 8,
CUlaunchConfig 56 bytes), and the recorder asks for the PDL variant only of kernels that have one."""

from __future__ import annotations

import ctypes

import torch

from mxc.kernels import launch, triton_norm
from mxc.runtime.cuda_launch import _LaunchAttribute, _LaunchAttributeValue, _LaunchConfig
from tests.sm90_compile import run_compile_script


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


_PDL_PTX = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_fp8 as tf, triton_fp8_gemv as tfv, triton_gemv as tg
meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
rec = L.Recorder(pdl=True)
with L.using(rec):
    tg.linear_small_m(meta(1, 4096), meta(4096, 4096))
    # the fp8 down GEMV (a 4096 x 4096 one preloads whole tiles instead: test_fp8_compile.py)
    tf.qlinear_small_m(meta(1, 14336), meta(4096, 14336, dtype=torch.float8_e4m3fn), meta(4096, dtype=torch.float32))
for spec in rec.specs.values():
    fn = {"_gemv_kernel": tg._gemv_kernel, "_qgemv_kernel": tfv._qgemv_kernel}.get(spec["kernel"].split(":")[1])
    if fn is None:
        continue
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
               if t.startswith("*")}
    src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=aligned)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}).asm["ptx"]
    first_wait = ptx.find("griddepcontrol.wait")
    assert 0 < ptx.find("prefetch.global.L2") < first_wait < ptx.find("griddepcontrol.launch_dependents"), spec
    print(spec["kernel"], "ok")
"""


def test_pdl_gemvs_prefetch_weights_before_waiting():
    """Under --pdl the GEMVs (bf16 and fp8) ask L2 for their first weight columns, then wait on the kernel
    ahead, then let the next one launch: the order in the sm_90 PTX."""
    out = run_compile_script(_PDL_PTX)
    assert out.count(" ok") == 2, out
