"""The shared-memory down lab (bench/moe_down_smem_lab.py): what it exists to test is where its loads sit.

The lab runs on the GPU only (Gluon kernels do not run in the interpreter). Compiling it here for sm_90 checks the
property the experiment is about: every TMA load of the down slice comes before ``griddepcontrol.wait`` in the PTX
(in the control variant, after it), and before it only the router's k ids are read from global memory; after it h
(one more TMA load), the routing weights and the residual. It also checks that a program's slice is the shared memory it asks for, and keeps the
lab compiling with this environment's Triton and, where ``MXC_GPU_TRITON`` names it, the GPU machines'.
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
import moe_down_smem_lab as lab
fn = lab.down_smem_kernel
w2 = torch.empty(128, 2048, 768, dtype=torch.bfloat16, device="meta")
# the first variant and its control (the same kernel loading its slice after the wait)
for label, bn, bk, warps, maxnreg, early in (lab.VARIANTS[0], lab.VARIANTS[0][:5] + (False,)):
    d = lab.down_descriptor(w2, bn, bk)
    hd = lab.descriptor(torch.empty(8 * 768 // bk, bk, dtype=torch.bfloat16, device="meta"),
                        [32 if bk == 256 else 64, bk])
    sig = {"h_desc": mangle_type(hd), "w_desc": mangle_type(d), "wts_ptr": "*bf16", "ids_ptr": "*i64", "r_ptr": "*bf16",
           "out_ptr": "*bf16", "E": "constexpr", "H": "constexpr", "I": "constexpr", "TOP_K": "constexpr",
           "HAS_R": "constexpr", "USE_PDL": "constexpr", "EARLY": "constexpr"}
    consts = {"E": 128, "H": 2048, "I": 768, "TOP_K": 8, "HAS_R": True, "USE_PDL": True, "EARLY": early}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    lines = [l.strip() for l in k.asm["ptx"].splitlines()]
    wait = next(i for i, l in enumerate(lines) if l.startswith("griddepcontrol.wait"))
    tma = [i for i, l in enumerate(lines) if "cp.async.bulk.tensor" in l]
    lds = [i for i, l in enumerate(lines) if l.startswith("ld.global")]
    print("kernel", bn, bk, int(early), k.metadata.shared, sum(i < wait for i in tma), sum(i > wait for i in tma),
          sum(i < wait for i in lds), sum(i > wait for i in lds))
"""


def _compile(triton_path: str | None = None) -> list[tuple[int, ...]]:
    stdout = run_compile_script(_COMPILE, triton_path)
    return [tuple(int(v) for v in line.split()[1:]) for line in stdout.splitlines() if line.startswith("kernel ")]


def _check(rows: list[tuple[int, ...]]) -> None:
    assert len(rows) == 2, rows
    for bn, bk, early, shared, tma_before, tma_after, ld_before, ld_after in rows:
        assert shared >= 8 * bn * 768 * 2, (bn, shared)  # the k experts' [bn, 768] slices, all at once
        boxes = 8 * 768 // bk
        if early:  # the ids and the slice's boxes before the wait; h's box, the weights and r after it
            assert (tma_before, tma_after) == (boxes, 1) and ld_before == 8 and ld_after > 0, rows
        else:  # the control: every load after it
            assert (tma_before, tma_after) == (0, boxes + 1) and ld_before == 0 and ld_after > 8, rows
    assert {r[2] for r in rows} == {0, 1}, rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_the_down_slice_loads_before_the_pdl_wait():
    _check(_compile())


@pytest.mark.skipif(not os.environ.get("MXC_GPU_TRITON"), reason="MXC_GPU_TRITON not set (the GPU machines' Triton)")
def test_the_gpu_triton_compiles_it_alike():
    _check(_compile(os.environ["MXC_GPU_TRITON"]))
