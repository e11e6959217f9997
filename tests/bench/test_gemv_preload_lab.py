"""The shared-memory preload lab (bench/gemv_preload_lab.py): what it exists to test is where its loads sit.

The lab runs on the GPU only (Gluon kernels do not run in the interpreter). Compiling it here for sm_90 checks the
one property the experiment is about: with ``EARLY`` the TMA loads of the weight stages come before
``griddepcontrol.wait`` in the PTX, and the x tiles after it; without it, every load comes after the wait. It also
keeps the lab compiling with this environment's Triton and, where ``MXC_GPU_TRITON`` names it, the GPU machines'.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.sm90_compile import run_compile_script


_COMPILE = """
import sys, torch, triton
sys.path.insert(0, "bench")
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
import gemv_preload_lab as lab
f8 = torch.float8_e4m3fn
w, x = torch.empty(6144, 4096, dtype=f8, device="meta"), torch.empty(1, 4096, dtype=f8, device="meta")
wd, xd = lab.descriptors(w, x)
fn = lab.qgemv_preload_kernel
sig = {"w_desc": mangle_type(wd), "x_desc": mangle_type(xd), "s_ptr": "*fp32", "xs_ptr": "*fp32", "y_ptr": "*bf16",
       "M": "i32", "N": "constexpr", "K": "constexpr", "STAGES": "constexpr", "EARLY": "constexpr",
       "USE_PDL": "constexpr", "PIPE": "constexpr", "SUB": "constexpr"}
# (name, STAGES, PIPE, SUB): the first lab ring, the pipelined one, and one of two 128-byte boxes a stage
for name, stages, pipe, sub in (("ring", 6, False, 1), ("pipelined", 6, True, 1), ("two_boxes", 4, True, 2)):
    for early in (False, True):
        consts = {"N": 6144, "K": 4096, "STAGES": stages, "EARLY": early, "USE_PDL": True, "PIPE": pipe, "SUB": sub}
        src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        lines = [l.strip() for l in ptx.splitlines()]
        wait = next(i for i, l in enumerate(lines) if l.startswith("griddepcontrol.wait"))
        loads = [i for i, l in enumerate(lines) if "cp.async.bulk.tensor" in l]
        print("ring", name, stages * sub, int(early), sum(i < wait for i in loads), sum(i > wait for i in loads))
"""


def _compile(triton_path: str | None = None) -> dict[tuple[str, bool], tuple[int, int, int]]:
    stdout = run_compile_script(_COMPILE, triton_path)
    rows = [line.split()[1:] for line in stdout.splitlines() if line.startswith("ring ")]
    return {(name, early == "1"): (int(boxes), int(before), int(after)) for name, boxes, early, before, after in rows}


def _check(counts: dict[tuple[str, bool], tuple[int, int, int]]) -> None:
    # with EARLY, every weight box of the ring's stages before the wait and, after it, x's boxes and the ring's refills
    # of both; without it, every load after the wait
    assert {name for name, _ in counts} == {"ring", "pipelined", "two_boxes"}, counts
    for name in ("ring", "pipelined", "two_boxes"):
        boxes, before, after = counts[name, True]
        assert before == boxes and after >= boxes + 2, counts
        _, late_before, late_after = counts[name, False]
        assert late_before == 0 and late_after == before + after, counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_weight_stages_load_before_the_pdl_wait_only_with_early():
    _check(_compile())


@pytest.mark.skipif(not os.environ.get("MXC_GPU_TRITON"), reason="MXC_GPU_TRITON not set (the GPU machines' Triton)")
def test_the_gpu_triton_compiles_it_alike():
    _check(_compile(os.environ["MXC_GPU_TRITON"]))
