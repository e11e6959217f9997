"""Triton MoE router (``triton_route.route``) against ``moe_ref.route``, under the interpreter on the
CPU: softmax and sigmoid scoring, with and without renormalisation, E not a power of two (masked
lanes), k = 1 and k = E, fp32/fp16/bf16 logits; ties go to the lower expert id; bad inputs refused;
meta-device recording and an sm_90 compile; the same with the bitonic top-k (``topk="bitonic"``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import moe_ref, triton_route

_BF16_OK = torch.cuda.is_available() or Path(__file__).with_name("conftest.py").exists()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 12, 3), (7, 60, 8), (3, 5, 5), (4, 6, 1)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
def test_route_matches_reference(T, E, k, scoring, renormalize, dtype, topk):
    logits = (torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k)) * 2).to(dtype)
    w, ids = triton_route.route(logits.to(DEVICE), k, scoring, renormalize, topk=topk)
    ref_w, ref_ids = moe_ref.route(logits, k, scoring, renormalize)
    assert w.dtype == dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    # ids as a set per token (top-k order of equal scores is free), weights in the same order
    assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)
    torch.testing.assert_close(w.cpu().float(), ref_w.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
def test_ties_go_to_the_lower_expert(topk):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    w, ids = triton_route.route(logits.to(DEVICE), 2, topk=topk)
    assert ids.cpu().tolist() == [[1, 2]]
    torch.testing.assert_close(w.cpu(), logits.softmax(-1)[:, [1, 2]])


def test_refuses_bad_inputs():
    x = torch.zeros(2, 4)
    for bad in (dict(k=5), dict(k=0), dict(k=2, scoring="relu")):
        with pytest.raises(ValueError):
            triton_route.route(x, **bad)
    with pytest.raises(ValueError):
        triton_route.route(torch.zeros(2, 4, 3), 2)
    with pytest.raises(ValueError):
        triton_route.route(torch.zeros(2, 2048), 2)
    with pytest.raises(ValueError, match="topk must be one of"):
        triton_route.route(x, 2, topk="heap")


def test_meta_recording():
    seen = []
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append((grid, consts))):
        w, ids = triton_route.route(torch.empty(9, 128, dtype=torch.bfloat16, device="meta"), 8,
                                    renormalize=True)
    assert w.shape == (9, 8) and ids.dtype == torch.int64
    assert seen == [((9,), dict(E=128, K=8, BLOCK_E=128, BLOCK_K=8, SIGMOID=False, RENORMALIZE=True, BITONIC=True))]


def test_topk_knob_is_read_at_launch(monkeypatch):
    """``TOPK`` picks the way when the call names none; only the bitonic way adds a constexpr."""
    seen = []
    monkeypatch.setattr(triton_route, "TOPK", "rounds")
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append(consts)):
        triton_route.route(torch.empty(1, 128, dtype=torch.bfloat16, device="meta"), 8)
        triton_route.route(torch.empty(1, 128, dtype=torch.bfloat16, device="meta"), 8, topk="bitonic")
    assert "BITONIC" not in seen[0] and seen[1]["BITONIC"] is True


_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_route
rec = L.Recorder(pdl=True)
with L.using(rec):
    triton_route.route(torch.empty(1, 128, dtype=torch.bfloat16, device="meta"), 8, renormalize=True)
    triton_route.route(torch.empty(1, 60, dtype=torch.float32, device="meta"), 4, scoring="sigmoid")
    triton_route.route(torch.empty(1, 128, dtype=torch.bfloat16, device="meta"), 8, renormalize=True, topk="bitonic")
for spec in rec.specs.values():
    fn = triton_route.route_kernel
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
             if t.startswith("*")}
    src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=Path(__file__).resolve().parents[2], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
