"""A kernel with TMA tensor-descriptor arguments compiled ahead of time (sm_90, on the CPU): the prefill
attention's q, K and V descriptors become a 128-byte map parameter each, followed by the tensor's shape and
strides; the index entry keeps Triton's descriptor metadata, from which the runtime encodes the maps, and
the PDL check names the expanded parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mxc.codegen import aot
from mxc.kernels import launch


def test_param_names_expand_descriptors():
    sig = {"x_ptr": "*bf16", "d": "tensordesc<bf16[64, 128]>", "n": "i32", "B": "constexpr"}
    assert aot.param_names(sig) == ["x_ptr", "d", "d.shape", "d.shape", "d.strides", "d.strides", "n"]
    assert launch.descriptor_rank("tensordesc<fp16[16, 32, 8]>") == 3 and launch.descriptor_rank("*fp16") is None


_COMPILE = """
import json, sys, torch
from mxc.codegen import aot
from mxc.kernels import kernel_templates, launch
from mxc.kernels import triton_attention as ta
q = torch.empty(300, 8, 128, dtype=torch.bfloat16, device="meta")
cache = torch.empty(4, 512, 2, 128, dtype=torch.bfloat16, device="meta")
i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="meta")
recorder = launch.Recorder(pdl=sys.argv[1] == "pdl")
with launch.using(recorder), kernel_templates.unpinned():
    ta.prefill_attention(q, cache, cache, i32([1, 0]), i32([100, 200]), i32([0, 100, 300]), 300, 0.1, None)
((key, spec),) = recorder.specs.items()
_, _, entry = aot._compile_one(key, spec, 90, kernel_templates.source(spec["kernel"].partition(":")[0]))
print(json.dumps(entry))
"""


@pytest.mark.parametrize("pdl", [False, True])
def test_prefill_attention_compiles_with_tma_maps(pdl):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiles for sm_90 with ptxas
    proc = subprocess.run([sys.executable, "-c", _COMPILE, "pdl" if pdl else "plain"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = json.loads(proc.stdout.strip().splitlines()[-1])
    tmap = ["tmap", "i32", "i32", "i64", "i64"]
    # q, k_cache, v_cache, slots, kv_lens, q_start, out pointers, the scale, then the three descriptors
    assert entry["params"][:8] == ["ptr"] * 7 + ["f32"]
    assert entry["params"][8:23] == tmap * 3 and set(entry["params"][23:]) <= {"ptr"}
    assert entry["args"][8:] == ["tensordesc<bf16[64, 128]>"] * 3
    assert len(entry["tensordesc"]) == 3 and entry["pdl"] == pdl
    for meta in entry["tensordesc"]:  # a bf16 [64, 128] block moves as [64, 64] boxes under the 128-byte swizzle
        assert meta["elem_size"] == 2 and meta["block_size"][0] == 64 and meta["block_size"][1] * 2 <= 128
