"""The fused residual add + RMSNorm + router GEMV + router kernel (``triton_route.add_rms_norm_route``)
against ``torch_ref.add_rms_norm_route`` under the interpreter on the CPU: ragged hidden sizes and
expert counts (masked lanes, programs past E), one to many tokens, softmax/sigmoid, renormalised or
not; its counter is back at 0 after every call, so a context's calls can follow each other; meta
recording. (The sm_90 compile, with Triton 3.9 and 3.6, runs in tests/build: the OLMoE build.)"""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import torch_ref, triton_route
from mxc.kernels.context import ForwardContext
from tests.sm90_compile import run_compile_script
from tests.triton_interpreter import bf16_ok

_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(T, H, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    router_w = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    return a, b, norm_w, router_w


def _run(args, ctx, **kw):
    out = triton_route.add_rms_norm_route(*(t.to(DEVICE) for t in args), ctx, **kw)
    return [t.cpu() for t in out]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,E,k", [(1, 96, 8, 2), (3, 256, 60, 8), (2, 2048, 128, 8), (5, 200, 12, 3),
                                     (1, 64, 5, 5)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_matches_reference(T, H, E, k, scoring, renormalize, dtype):
    args = _inputs(T, H, E, dtype, seed=T * 1000 + H + E)
    kw = dict(eps=1e-6, k=k, scoring=scoring, renormalize=renormalize)
    s, h, w, ids = _run(args, ForwardContext([1] * T, [0] * T, list(range(T))), **kw)
    ref_s, ref_h, ref_w, ref_ids = torch_ref.add_rms_norm_route(*args, **kw)
    assert torch.equal(s, ref_s)  # the rounded sum: one fp32 add and a cast, as torch
    torch.testing.assert_close(h.float(), ref_h.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert w.dtype == dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    # the same experts (in order of score); the logits may differ by an ulp (fp32 sums in another order)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(w.float(), ref_w.float(), atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.parametrize("topk", ["rounds", "bitonic"])
def test_fp32_weights(topk):
    """``fp32_weights`` (Mixtral's router): the fused kernel stores the routing weights in fp32, unrounded, as
    ``torch_ref.add_rms_norm_route(fp32_weights=True)``; the sum, the normalised rows and the experts as without."""
    dtype = DTYPES[-1]
    args = _inputs(3, 96, 8, dtype, seed=41)
    kw = dict(eps=1e-6, k=2, scoring="softmax", renormalize=True)
    s, h, w, ids = _run(args, None, **kw, fp32_weights=True, topk=topk)
    ref_s, ref_h, ref_w, ref_ids = torch_ref.add_rms_norm_route(*args, **kw, fp32_weights=True)
    assert w.dtype == ref_w.dtype == torch.float32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=2 * TOL[torch.float32], rtol=2 * TOL[torch.float32])
    assert not torch.equal(w, w.to(dtype).float())  # not rounded to the activations' dtype
    s16, h16, w16, ids16 = _run(args, None, **kw, topk=topk)
    assert torch.equal(s16, s) and torch.equal(h16, h) and torch.equal(ids16, ids) and w16.dtype == dtype
    if topk == "bitonic":  # past 32 tokens: the Triton add + RMSNorm, the router GEMM, the Triton router
        from mxc.kernels import cuda_ops

        *_, w3, ids3 = (t.cpu() for t in cuda_ops.add_rms_norm_route(*(t.to(DEVICE) for t in args), **kw,
                                                                     fp32_weights=True))
        assert w3.dtype == torch.float32 and torch.equal(ids3, ref_ids)
        torch.testing.assert_close(w3, ref_w, atol=2 * TOL[torch.float32], rtol=2 * TOL[torch.float32])


@pytest.mark.parametrize("topk", triton_route.TOPK_WAYS)
def test_ties_go_to_the_lower_expert(topk):
    """Experts 3 and 5 with the same router row (the same logit, the top score): 3 comes first."""
    a, b, nw, rw = _inputs(1, 64, 8, torch.float32, 3)
    rw[3] = rw[5] = 4 * rw[3]
    _, _, w, ids = _run((a, b, nw, rw), None, eps=1e-6, k=3, topk=topk)
    assert ids[0, :2].tolist() == [3, 5] and w[0, 0] == w[0, 1]


# every pair of (way, scoring), (way, dtype) and (scoring, dtype) at least once: each dtype takes both scorings,
# one a way
# (all 12 combinations took 56 s of CI)
SCORINGS = [("softmax", True), ("sigmoid", False)]
OTHER_WAYS = [(topk, *SCORINGS[(i + j) % 2], dtype) for i, dtype in enumerate(DTYPES)
              for j, topk in enumerate(("packed", "bitonic"))]


@pytest.mark.parametrize("topk,scoring,renormalize,dtype", OTHER_WAYS,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in OTHER_WAYS])
def test_other_top_k_ways_match_reference(scoring, renormalize, dtype, topk):
    """The packed top-k (one reduction a round) and the bitonic one at the Qwen3-30B-A3B router's shape and
    ragged ones (k = E, and k not a power of two with E past it)."""
    for T, H, E, k in ((2, 2048, 128, 8), (3, 96, 60, 4), (1, 64, 5, 5), (2, 80, 9, 6)):
        args = _inputs(T, H, E, dtype, seed=E + k)
        kw = dict(eps=1e-6, k=k, scoring=scoring, renormalize=renormalize)
        got = _run(args, None, **kw, topk=topk)
        ref = torch_ref.add_rms_norm_route(*args, **kw)
        assert torch.equal(got[3], ref[3])
        torch.testing.assert_close(got[2].float(), ref[2].float(), atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.parametrize("rows,num_warps,topk", [(1, 1, "rounds"), (4, 2, "packed"), (8, 4, "bitonic"),
                                                  (2, 8, "packed"), (1, 1, "bitonic")])
def test_tile_overrides(rows, num_warps, topk):
    """Other rows a program (E = 12: the last program's rows run past E), warps and the packed top-k:
    the same result."""
    args = _inputs(3, 160, 12, torch.float32, 9)
    kw = dict(eps=1e-6, k=3, scoring="sigmoid", renormalize=True)
    got = triton_route.add_rms_norm_route(*(t.to(DEVICE) for t in args), None, **kw, rows=rows, num_warps=num_warps,
                                          topk=topk)
    ref = torch_ref.add_rms_norm_route(*args, **kw)
    assert torch.equal(got[3].cpu(), ref[3])
    torch.testing.assert_close(got[2].cpu(), ref[2])


def test_calls_in_a_row_share_the_counters_and_leave_them_at_zero():
    """Every MoE layer of a call, at any token count, uses the context's one tensor of counts (one a token, the most
    tokens' worth, so that a CUDA graph captured at one batch keeps a tensor no other batch replaces): the last of
    each token's programs resets its count."""
    ctx = ForwardContext([1] * 5, [0] * 5, list(range(5)))
    kw = dict(eps=1e-5, k=2, scoring="softmax", renormalize=False)
    counts = None
    for seed, T in enumerate((2, 5, 1, 3)):
        args = _inputs(T, 128, 16, torch.float32, seed)
        got = _run(args, ctx, **kw)
        ref = torch_ref.add_rms_norm_route(*args, **kw)
        assert torch.equal(got[3], ref[3])
        torch.testing.assert_close(got[2], ref[2])
        now = ctx.counters("route", 1, DEVICE)  # "cuda" finds the kernels' tensor on cuda:0
        assert now.numel() == triton_route.NORM_ROUTE_TOKENS and not now.any()
        assert counts is None or now is counts
        counts = now


def test_builds_send_it_no_more_tokens_than_it_takes():
    """The build's dispatch bound (past it the three kernels are faster) fits the kernel's counts."""
    from mxc.kernels.candidates import NORM_ROUTE_MAX_TOKENS

    assert 1 <= NORM_ROUTE_MAX_TOKENS <= triton_route.NORM_ROUTE_TOKENS


def test_refuses_bad_inputs():
    a, b, nw, rw = _inputs(2, 64, 8, torch.float32, 0)
    with pytest.raises(ValueError):
        triton_route.add_rms_norm_route(a, b, nw, rw, eps=1e-6, k=9)
    with pytest.raises(ValueError):
        triton_route.add_rms_norm_route(a, b, nw, rw, eps=1e-6, k=2, scoring="relu")
    with pytest.raises(AssertionError):
        triton_route.add_rms_norm_route(torch.zeros(33, 64), torch.zeros(33, 64), nw, rw, eps=1e-6, k=2)
    with pytest.raises(AssertionError):
        triton_route.add_rms_norm_route(a, b, nw, rw[:, :32].contiguous(), eps=1e-6, k=2)


def test_meta_recording():
    seen = []
    meta = dict(dtype=torch.bfloat16, device="meta")
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append((grid, consts, nw))):
        out = triton_route.add_rms_norm_route(torch.empty(1, 2048, **meta), torch.empty(1, 2048, **meta),
                                              torch.empty(2048, **meta), torch.empty(128, 2048, **meta),
                                              eps=1e-6, k=8, renormalize=True)
    assert [tuple(t.shape) for t in out] == [(1, 2048), (1, 2048), (1, 8), (1, 8)]
    # the measured default: one router row and two warps a program (triton_route._config), the bitonic top-k
    assert seen == [((128, 1), dict(H=2048, BLOCK_H=2048, E=128, ROWS=1, K=8, BLOCK_E=128, BLOCK_K=8, SIGMOID=False,
                                  RENORMALIZE=True, BITONIC=True), 2)]
    seen.clear()  # a column of programs a token
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append(grid)):
        triton_route.add_rms_norm_route(torch.empty(5, 2048, **meta), torch.empty(5, 2048, **meta),
                                        torch.empty(2048, **meta), torch.empty(128, 2048, **meta), eps=1e-6, k=8)
    assert seen == [(128, 5)]
    args = []
    with launch_mod.using(lambda kernel, grid, a, consts, nw, ns: args.append(a)):
        for fp32 in (False, True):  # the weights buffer (argument 7), which the kernel stores in its dtype
            shapes = ((1, 64), (1, 64), (64,), (8, 64))
            out = triton_route.add_rms_norm_route(*(torch.empty(*s, **meta) for s in shapes), eps=1e-6, k=2,
                                                  fp32_weights=fp32)
            assert out[2].dtype == args[-1][7].dtype == (torch.float32 if fp32 else torch.bfloat16)


_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_route
meta = dict(dtype=torch.bfloat16, device="meta")
rec = L.Recorder(pdl=True)
with L.using(rec):
    for topk in triton_route.TOPK_WAYS:
        triton_route.add_rms_norm_route(torch.empty(1, 2048, **meta), torch.empty(1, 2048, **meta),
                                        torch.empty(2048, **meta), torch.empty(128, 2048, **meta), eps=1e-6, k=8,
                                        renormalize=True, topk=topk)
fn = triton_route.norm_route_kernel
for spec in rec.specs.values():
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
             if t.startswith("*")}
    src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "atom" in ptx
    print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    """Every top-k way compiles for Hopper with PDL (the OLMoE build in tests/build also
    compiles the default one with the GPU machines' Triton 3.6)."""
    out = run_compile_script(_COMPILE)
    assert out.count("ok") == 3, out


@pytest.mark.parametrize("topk", triton_route.TOPK_WAYS)
def test_most_tokens_in_one_program(topk):
    """``NORM_ROUTE_TOKENS`` tokens (the most taken), with every router row in one program a token (rows >= E):
    that program is both its token's first (it writes the sum and the normalised row) and last (it routes)."""
    T = triton_route.NORM_ROUTE_TOKENS
    args = _inputs(T, 40, 6, torch.float32, seed=31)
    kw = dict(eps=1e-6, k=2, scoring="softmax", renormalize=True)
    s, h, w, ids = _run(args, None, **kw, rows=8, topk=topk)
    ref_s, ref_h, ref_w, ref_ids = torch_ref.add_rms_norm_route(*args, **kw)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(h, ref_h, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=2 * TOL[torch.float32], rtol=2 * TOL[torch.float32])


def test_the_largest_expert_count():
    """E = MAX_EXPERTS is taken (64 router rows a program here) and routes as the reference; one more is refused."""
    E = triton_route.MAX_EXPERTS
    args = _inputs(1, 16, E, torch.float32, seed=5)
    kw = dict(eps=1e-6, k=4, scoring="sigmoid", renormalize=True)
    _, _, w, ids = _run(args, None, **kw, rows=64)
    _, _, ref_w, ref_ids = torch_ref.add_rms_norm_route(*args, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=2 * TOL[torch.float32], rtol=2 * TOL[torch.float32])
    a, b, nw, rw = _inputs(1, 16, E + 1, torch.float32, seed=5)
    with pytest.raises(ValueError, match=f"E <= {E}"):
        triton_route.add_rms_norm_route(a, b, nw, rw, eps=1e-6, k=2)
