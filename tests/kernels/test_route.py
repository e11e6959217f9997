"""Triton MoE router (``triton_route.route``) against ``moe_ref.route``, under the interpreter on the
CPU: softmax and sigmoid scoring, with and without renormalisation, E not a power of two (masked
lanes), k = 1 and k = E, fp32/fp16/bf16 logits; ties go to the lower expert id; bad inputs refused;
meta-device recording and an sm_90 compile; the same with the bitonic top-k (``topk="bitonic"``)."""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import moe_ref, triton_route
from tests.sm90_compile import run_compile_script
from tests.triton_interpreter import bf16_ok

_BF16_OK = bf16_ok()
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


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
def test_fp32_weights(dtype, topk):
    """``fp32_weights`` (Mixtral's router, which keeps them in float32): 16-bit logits, the weights stored in fp32
    as ``moe_ref.route(fp32_weights=True)`` gives them, unrounded; the same experts as without it."""
    logits = (torch.randn(6, 8, generator=torch.Generator().manual_seed(8)) * 2).to(dtype)
    w, ids = triton_route.route(logits.to(DEVICE), 2, renormalize=True, fp32_weights=True, topk=topk)
    ref_w, ref_ids = moe_ref.route(logits, 2, renormalize=True, fp32_weights=True)
    assert w.dtype == ref_w.dtype == torch.float32 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert not torch.equal(w.cpu(), w.cpu().to(dtype).float())  # not rounded to the logits' dtype
    w16, ids16 = triton_route.route(logits.to(DEVICE), 2, renormalize=True, topk=topk)
    assert w16.dtype == dtype and torch.equal(ids16, ids)


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
    args = []
    with launch_mod.using(lambda kernel, grid, a, consts, nw, ns: args.append(a)):
        for fp32 in (False, True):  # the weights buffer, which the kernel stores in its dtype
            w, _ = triton_route.route(torch.empty(9, 8, dtype=torch.bfloat16, device="meta"), 2, fp32_weights=fp32)
            assert w.dtype == args[-1][1].dtype == (torch.float32 if fp32 else torch.bfloat16)


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
    triton_route.route(torch.empty(1, 8, dtype=torch.bfloat16, device="meta"), 2, renormalize=True, fp32_weights=True)
assert any(s["signature"]["weights_ptr"] == "*fp32" and s["signature"]["logits_ptr"] == "*bf16"
           for s in rec.specs.values())
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
    out = run_compile_script(_COMPILE)
    assert out.strip().endswith("ok"), out


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's sigmoid
@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_scores_that_underflow_are_still_distinct_experts(topk, scoring):
    """Logits far below the top one score exactly 0 in fp32 (softmax and sigmoid alike): the k experts are still
    k distinct ones, the ties among the zeros going to the lower ids, as ``moe_ref.route``'s scores order them."""
    logits = torch.tensor([[-300.0, 0.0, -250.0, -200.0, 30.0], [-400.0, -300.0, 5.0, -350.0, -500.0]])
    k = 4
    w, ids = triton_route.route(logits.to(DEVICE), k, scoring, topk=topk)
    ref_w, _ = moe_ref.route(logits, k, scoring)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    assert (scores == 0).sum(-1).min() >= 2  # the case at hand: ties at 0 among the k
    # the reference order with ties to the lower id: a stable sort of the scores, descending
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    assert ids.cpu().tolist() == want.tolist()
    torch.testing.assert_close(w.cpu(), ref_w)


@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
def test_large_logits_do_not_overflow_the_softmax(topk):
    """Logits over ~88 overflow exp in fp32: the softmax subtracts the row's max first, as torch does."""
    logits = torch.tensor([[100.0, 99.0, 0.0, 98.5, -3.0], [200.0, 300.0, 250.0, 299.0, 1.0]])
    w, ids = triton_route.route(logits.to(DEVICE), 2, "softmax", renormalize=False, topk=topk)
    ref_w, ref_ids = moe_ref.route(logits, 2, "softmax")
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w)


def test_packed_way_runs_as_rounds():
    """``route`` has no packed way: ``topk="packed"`` runs the rounds (the same result); every way launches with
    the kernel's own constexprs only (Triton's JIT and the AOT compile refuse any other name)."""
    seen = []
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append(consts)):
        for topk in triton_route.TOPK_WAYS:
            triton_route.route(torch.empty(1, 12, device="meta"), 3, topk=topk)
    assert all(set(c) <= set(triton_route.route_kernel.arg_names) for c in seen), seen
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))
    w, ids = triton_route.route(logits.to(DEVICE), 3, renormalize=True, topk="packed")
    ref_w, ref_ids = moe_ref.route(logits, 3, renormalize=True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w)


def test_the_largest_expert_count():
    """E = MAX_EXPERTS is taken (and routes as the reference); one more expert is refused."""
    E = triton_route.MAX_EXPERTS
    logits = torch.randn(2, E, generator=torch.Generator().manual_seed(4))
    w, ids = triton_route.route(logits.to(DEVICE), 8, renormalize=True)
    ref_w, ref_ids = moe_ref.route(logits, 8, renormalize=True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w)
    with pytest.raises(ValueError, match=f"E <= {E}"):
        triton_route.route(torch.zeros(1, E + 1), 2)


@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
@pytest.mark.interpreter
def test_no_store_outside_the_outputs(topk):
    """k = 3 (a block of 4): the last token's masked lane stores nothing past the weights and ids (``guarded``)."""
    from tests.kernels.guarded import guarded

    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(6))
    with guarded():
        w, ids = triton_route.route(logits, 3, renormalize=True, topk=topk)
    ref_w, ref_ids = moe_ref.route(logits, 3, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_no_launch_for_no_tokens():
    """Zero tokens launch nothing (an empty grid, which the runtime's cubin launcher would hand to the driver)."""
    seen = []
    with launch_mod.using(lambda *a: seen.append(a)):
        w, ids = triton_route.route(torch.empty(0, 8, dtype=torch.bfloat16, device="meta"), 2)
    assert w.shape == ids.shape == (0, 2) and seen == []
