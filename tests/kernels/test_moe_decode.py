"""Fused MoE for a few tokens (``triton_moe_decode``: one GEMV per (token, expert) pair, the top-k
sum in the down kernel) against ``moe_ref.fused_moe`` and against the sorted ``triton_moe`` path,
under the interpreter: ragged H = 48 / I = 40 with 32-wide K steps (a partial last step) and also
whole steps, T in {1, 3, 4}, k in {1, 2, 4}, E in {4, 8}, fp32/fp16/bf16, fp8 experts with row
scales, the K loops unrolled against the loops (bit for bit), tokens sharing an expert, invalid expert ids dropped as the sorted path drops them;
meta-device recording and an sm_90 compile."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import fp8_ref, moe_ref
from mxc.kernels import triton_moe as tm
from mxc.kernels import triton_moe_decode as tmd
from mxc.kernels.triton_moe import MoeConfig
from mxc.loaders.quantize import quantize_fp8
from tests.sm90_compile import run_compile_script
from tests.triton_interpreter import bf16_ok

_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 48, 40
RAGGED = (tmd.PairConfig(BLOCK_N=16, BLOCK_K=32, num_warps=4), tmd.PairConfig(BLOCK_N=16, BLOCK_K=32, num_warps=4))
TILED = (RAGGED[0], tmd.PairConfig(BLOCK_N=8, BLOCK_K=32, num_warps=4, TILE=True))
WHOLE_TILED = (RAGGED[0], tmd.PairConfig(BLOCK_N=8, BLOCK_K=8, num_warps=4, TILE=True))
SORTED = MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK=16)


def _inputs(T, k, E, dtype, seed, ids=None, h=H, i=I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if ids is None else ids
    weights = torch.rand(T, k, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w_down = (torch.randn(E, h, i, generator=g) * i ** -0.5).to(dtype)
    return x, weights, ids.to(torch.int64), w_gate_up, w_down


def _dev(t):
    return None if t is None else t.to(DEVICE)


def _check(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    y, ref = y.cpu().float(), ref.cpu().float()
    assert not y.isnan().any()
    err, scale = (y - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"max error {err}, output scale {scale}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,k,E", [(1, 2, 4), (3, 1, 8), (4, 2, 8), (1, 4, 8)])
@pytest.mark.parametrize("configs", [RAGGED, None, TILED, WHOLE_TILED],
                         ids=["ragged-k", "default", "tiled-down-ragged-k", "tiled-down"])
def test_pairs_match_reference_and_sorted_path(T, k, E, dtype, configs):
    x, weights, ids, wgu, wd = _inputs(T, k, E, dtype, seed=T * 10 + k + E)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    y = tmd.fused_moe(*args, configs=configs)
    _check(y, moe_ref.fused_moe(x, weights, ids, wgu, wd), TOL[dtype])
    _check(y, tm.fused_moe(*args, config=SORTED), TOL[dtype])


@pytest.mark.parametrize("k", [3, 6])
def test_default_configs_k_not_a_power_of_two(k):
    """``config_for``: a k that is not a power of two takes the expert-by-expert down loop (the tiled kernel's tile
    of k * BLOCK_N rows needs a power of two), and the default configs run against the reference."""
    assert not tmd.config_for(H, I, torch.float32, top_k=k)[1].TILE
    assert tmd.config_for(H, I, torch.float32, top_k=4)[1].TILE
    x, weights, ids, wgu, wd = _inputs(2, k, 8, torch.float32, seed=k)
    y = tmd.fused_moe(*[_dev(t) for t in (x, weights, ids, wgu, wd)])
    _check(y, moe_ref.fused_moe(x, weights, ids, wgu, wd), TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tokens_sharing_experts(dtype):
    ids = torch.tensor([[1, 2], [2, 1], [1, 3]])
    x, weights, ids, wgu, wd = _inputs(3, 2, 4, dtype, seed=7, ids=ids)
    y = tmd.fused_moe(*[_dev(t) for t in (x, weights, ids, wgu, wd)], configs=RAGGED)
    _check(y, moe_ref.fused_moe(x, weights, ids, wgu, wd), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [2, 3])
def test_tiled_down_equals_expert_loop(dtype, k):
    """The tiled down kernel rounds and sums as the expert-by-expert one: equal bits (k = 3, not a
    power of two, takes the loop). On the GPU an fp32 output keeps the bits of its fp32 dot products,
    whose in-register reduction order follows the tile's layout: there, within 1e-6."""
    x, weights, ids, wgu, wd = _inputs(3, k, 8, dtype, seed=11)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    tiled, loop = tmd.fused_moe(*args, configs=TILED), tmd.fused_moe(*args, configs=RAGGED)
    if DEVICE == "cuda" and dtype == torch.float32:
        _check(tiled, loop, 1e-6)
    else:
        assert torch.equal(tiled, loop)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("configs", [RAGGED, TILED], ids=["loop", "tiled"])
def test_residual(dtype, configs):
    """``fuse_linear_io``'s residual, added by the down kernel as ``torch_ref.add`` adds it: equal bits."""
    from mxc.kernels import torch_ref

    x, weights, ids, wgu, wd = _inputs(3, 2, 8, dtype, seed=13)
    r = torch.randn(3, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    plain = tmd.fused_moe(*args, configs=configs)
    y = tmd.fused_moe(*args, residual=_dev(r), configs=configs)
    assert torch.equal(y.cpu(), torch_ref.add(r, plain.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("configs", [RAGGED, TILED], ids=["loop", "tiled"])
def test_fp8_experts(dtype, configs):
    x, weights, ids, wgu, wd = _inputs(2, 2, 4, torch.float32, seed=3)
    wgu[:, :I] *= 3  # gate and up rows at different scales
    (q1, s1), (q2, s2) = quantize_fp8(wgu, "channel"), quantize_fp8(wd, "channel")  # as the loader stores them
    x, weights = x.to(dtype), weights.to(dtype)
    deq = lambda q, s: (q.float() * s[..., None]).to(dtype)  # noqa: E731
    y = tmd.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(q1), _dev(q2), s_gate_up=_dev(s1), s_down=_dev(s2),
                      configs=configs)
    _check(y, moe_ref.fused_moe(x, weights, ids, deq(q1, s1), deq(q2, s2)), TOL[dtype])


def _block_scaled_experts(E, h, i, seed):
    """fp8 expert stacks with 128x128 block scales (as an already-fp8 checkpoint holds them), each block of the
    weights at its own magnitude (up to 16x apart), so a scale read for the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    wgu = torch.randn(E, 2 * i, h, generator=g) * h ** -0.5
    wd = torch.randn(E, h, i, generator=g) * i ** -0.5
    for w in (wgu, wd):
        w *= torch.rand(E, -(-w.shape[1] // 128), -(-w.shape[2] // 128), generator=g).mul(4).exp2().repeat_interleave(
            128, 1)[:, :w.shape[1]].repeat_interleave(128, 2)[:, :, :w.shape[2]]
    return quantize_fp8(wgu, "block128"), quantize_fp8(wd, "block128")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("configs", [
    (tmd.PairConfig(BLOCK_N=16, BLOCK_K=64, num_warps=4), tmd.PairConfig(BLOCK_N=16, BLOCK_K=64, num_warps=4)),
    (tmd.PairConfig(BLOCK_N=16, BLOCK_K=256, num_warps=4), tmd.PairConfig(BLOCK_N=8, BLOCK_K=256, num_warps=4,
                                                                          TILE=True))], ids=["loop", "tiled"])
def test_fp8_experts_block_scales(dtype, configs):
    """Block scales at ragged H = 200 (a short last K block of gate/up) and I = 256 (two K blocks of down; the
    256-wide steps span both)."""

    h, i = 200, 256
    x, weights, ids, _, _ = _inputs(3, 2, 4, dtype, seed=4, h=h, i=i)
    (q1, s1), (q2, s2) = _block_scaled_experts(4, h, i, seed=9)
    y = tmd.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(q1), _dev(q2), s_gate_up=_dev(s1), s_down=_dev(s2),
                      configs=configs)
    _check(y, moe_ref.fused_moe(x, weights, ids, fp8_ref.dequantize_experts(q1, s1, dtype),
                                fp8_ref.dequantize_experts(q2, s2, dtype)),
           TOL[dtype])


UNROLL_CASES = [(dtype, "none", 48, 32, False) for dtype in DTYPES] + [  # dtype, scales, H, gate/up step, tiled down
    (DTYPES[-1], "none", 64, 16, True),  # whole steps
    (torch.float16, "channel", 48, 32, True),
    (DTYPES[-1], "block128", 200, 64, False),  # steps across 128-column scale blocks
    (torch.float32, "block128", 200, 64, True),
]


@pytest.mark.parametrize("dtype,scales,h,block_k,tile", UNROLL_CASES,
                         ids=[f"{c[0]}-{c[1]}-H{c[2]}-k{c[3]}" + "-tiled" * c[4] for c in UNROLL_CASES])
def test_unrolled_loops_equal_the_loops(dtype, scales, h, block_k, tile):
    """``PairConfig.UNROLL`` (a kernel's K loop unrolled) computes the same sums in the same order: the same bits as
    the loops, for gate/up and for both down kernels, at a partial last K step, whole steps, and steps across
    128-column scale blocks."""
    i = 128 if scales == "block128" else 40  # block-scaled gate/up: whole 128-row blocks
    x, weights, ids, wgu, wd = _inputs(3, 2, 4, dtype, seed=6, h=h, i=i)
    kw = {}
    if scales == "block128":
        (wgu, s1), (wd, s2) = _block_scaled_experts(4, h, i, seed=7)
        kw = dict(s_gate_up=_dev(s1), s_down=_dev(s2))
    elif scales == "channel":
        (wgu, s1), (wd, s2) = quantize_fp8(wgu.float(), "channel"), quantize_fp8(wd.float(), "channel")
        kw = dict(s_gate_up=_dev(s1), s_down=_dev(s2))
    up = tmd.PairConfig(BLOCK_N=16, BLOCK_K=block_k, num_warps=4)
    down = tmd.PairConfig(BLOCK_N=8, BLOCK_K=32, num_warps=4, TILE=tile)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    rolled = tmd.fused_moe(*args, configs=(up, down), **kw)
    for u, d in ((True, False), (False, True), (True, True)):
        unrolled = tmd.fused_moe(*args, configs=(replace(up, UNROLL=u), replace(down, UNROLL=d)), **kw)
        assert torch.equal(unrolled, rolled), (u, d)
    if scales == "none":  # and against the reference (the fp8 cases have their own tests above)
        _check(rolled, moe_ref.fused_moe(x, weights, ids, wgu, wd), TOL[dtype])


@pytest.mark.parametrize("configs", [RAGGED, TILED], ids=["loop", "tiled"])
def test_invalid_ids_are_dropped_as_by_the_sorted_path(configs):
    ids = torch.tensor([[0, 9], [-1, 2]])  # 9 and -1 are not experts of E = 4
    x, weights, ids, wgu, wd = _inputs(2, 2, 4, torch.float32, seed=5, ids=ids)
    y = tmd.fused_moe(*[_dev(t) for t in (x, weights, ids, wgu, wd)], configs=configs).cpu()
    keep = (ids >= 0) & (ids < 4)
    ref = moe_ref.fused_moe(x, weights * keep, ids.clamp(0, 3), wgu, wd)
    _check(y, ref, TOL[torch.float32])


WIDE = tmd.PairConfig(BLOCK_N=16, BLOCK_K=256, num_warps=4)
GUARD_CASES = {  # name: (H, I, configs, block scales)
    # H = 52: a partial last n-tile of the down kernels (16- and 8-row tiles) and a partial last K step of gate/up;
    # I = 40: a partial last n-tile of gate/up and a partial last K step of down
    "loop": (52, 40, RAGGED, False),
    "tiled": (52, 40, TILED, False),
    # H = 100 and I = 128 in one 256-wide step each: the step's masked columns lie in a 128-column block past K
    "block-scales-wide-steps": (100, 128, (WIDE, replace(WIDE, BLOCK_N=8, TILE=True)), True),
}


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_no_access_outside_tensors(case):
    """Every launch under ``guarded``: the partial last tiles' masks keep the stores inside h and out (a store one
    column past the last pair's h row or the last token's output row fails, though a neighbour's inside the tensor
    would be overwritten in the interpreter's program order), and the masked columns of a last K step read no
    weight or scale past the experts' last (their surroundings are NaN). Expert E - 1 is used, so its last rows
    and scales are read."""
    from tests.kernels.guarded import guarded

    h, i, configs, blocks = GUARD_CASES[case]
    ids = torch.tensor([[3, 0], [1, 3]])
    x, weights, ids, wgu, wd = _inputs(2, 2, 4, torch.float32, seed=12, ids=ids, h=h, i=i)
    kw = {}
    if blocks:
        (wgu, s1), (wd, s2) = _block_scaled_experts(4, h, i, seed=3)
        kw = dict(s_gate_up=_dev(s1), s_down=_dev(s2))
    with guarded():
        y = tmd.fused_moe(*[_dev(t) for t in (x, weights, ids, wgu, wd)], configs=configs, **kw)
    if blocks:
        wgu, wd = (fp8_ref.dequantize_experts(w, s, torch.float32) for w, s in ((wgu, s1), (wd, s2)))
    _check(y, moe_ref.fused_moe(x, weights, ids, wgu, wd), TOL[torch.float32])


def test_rejects_bad_inputs():
    x, weights, ids, wgu, wd = _inputs(2, 2, 4, torch.float16, seed=0)
    with pytest.raises(ValueError):
        tmd.fused_moe(x, weights, ids.int(), wgu, wd)
    with pytest.raises(ValueError):
        tmd.fused_moe(x, weights, ids, wgu.float(), wd)


def test_meta_recording():
    """Two launches (no sort, no sum kernel); grids from T, k, I and H only."""
    seen = []
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append((kernel, grid, consts))):
        y = tmd.fused_moe(meta(3, 2048), meta(3, 8), meta(3, 8, dtype=torch.int64), meta(128, 1536, 2048),
                          meta(128, 2048, 768))
    assert y.shape == (3, 2048)
    (k1, g1, c1), (k2, g2, c2) = seen
    assert (k1, k2) == (tmd._pair_up_kernel, tmd._pair_down_tile_kernel)  # k = 8: the tiled down kernel
    assert g1 == (24, 768 // 16) and g2 == (3, 2048 // 2)
    assert c1["BLOCK_K"] == 256 and c2["BLOCK_K"] == 128 and c1["TOP_K"] == 8 and c1["E"] == 128
    assert c1["UNROLL"] and "UNROLL" not in c2  # 8 steps of gate/up unrolled (``UNROLL_MAX_STEPS``)
    seen.clear()
    with launch_mod.using(lambda kernel, grid, args, consts, nw, ns: seen.append((kernel, grid, consts))):
        f8 = torch.float8_e4m3fn
        tmd.fused_moe(meta(3, 2048), meta(3, 8), meta(3, 8, dtype=torch.int64), meta(128, 1536, 2048, dtype=f8),
                      meta(128, 2048, 768, dtype=f8), s_gate_up=meta(128, 1536, dtype=torch.float32),
                      s_down=meta(128, 2048, dtype=torch.float32))
        tmd.fused_moe(meta(3, 8192), meta(3, 8), meta(3, 8, dtype=torch.int64), meta(8, 256, 8192),
                      meta(8, 8192, 128))
    assert seen[0][2]["UNROLL"] and seen[1][2]["UNROLL"]  # fp8 experts: both loops (``UNROLL_SCALED``, measured)
    assert "UNROLL" not in seen[2][2]  # 32 steps: over UNROLL_MAX_STEPS


def test_scaled_configs(monkeypatch):
    """fp8 experts' configs: block scales keep each step inside one 128-column block, the unroll counts the steps
    after that, and ``OVERRIDES`` win over both."""
    row_up, row_down = tmd.config_for(3072, 768, torch.bfloat16, scales="row")
    blk_up, blk_down = tmd.config_for(3072, 768, torch.bfloat16, scales="block")
    assert (row_up.BLOCK_K, blk_up.BLOCK_K, blk_down.BLOCK_K) == (256, 128, 128)
    assert row_up.UNROLL and row_down.UNROLL and blk_down.UNROLL  # 12, 6 and 6 steps
    assert not blk_up.UNROLL  # 24 steps: over UNROLL_MAX_STEPS
    assert not tmd.config_for(3072, 768, torch.bfloat16)[1].UNROLL  # bf16 experts: the down loop stays
    monkeypatch.setattr(tmd, "OVERRIDES", {(3072, 768, "down"): {"UNROLL": False}})
    assert not tmd.config_for(3072, 768, torch.bfloat16, scales="row")[1].UNROLL
    monkeypatch.setattr(tmd, "UNROLL_SCALED", False)
    assert not tmd.config_for(3072, 768, torch.bfloat16, scales="row")[0].UNROLL


_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxc.kernels import launch as L, triton_moe_decode as tmd
meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")
rec = L.Recorder(pdl=True)
with L.using(rec):
    tmd.fused_moe(meta(1, 2048), meta(1, 8), meta(1, 8, dtype=torch.int64), meta(128, 1536, 2048), meta(128, 2048, 768))
    f8 = torch.float8_e4m3fn
    tmd.fused_moe(meta(2, 2048), meta(2, 8), meta(2, 8, dtype=torch.int64), meta(128, 1536, 2048, dtype=f8),
                  meta(128, 2048, 768, dtype=f8), s_gate_up=meta(128, 1536, dtype=torch.float32),
                  s_down=meta(128, 2048, dtype=torch.float32))
    tiled = (tmd.PairConfig(), tmd.PairConfig(BLOCK_N=8, BLOCK_K=256, TILE=True))
    tmd.fused_moe(meta(1, 2048), meta(1, 8), meta(1, 8, dtype=torch.int64), meta(128, 1536, 2048),
                  meta(128, 2048, 768), configs=tiled)
    tmd.fused_moe(meta(1, 2048), meta(1, 8), meta(1, 8, dtype=torch.int64), meta(128, 1536, 2048),
                  meta(128, 2048, 768), residual=meta(1, 2048))
    tmd.fused_moe(meta(1, 2048), meta(1, 8), meta(1, 8, dtype=torch.int64), meta(128, 1536, 2048, dtype=f8),
                  meta(128, 2048, 768, dtype=f8), s_gate_up=meta(128, 1536, dtype=torch.float32),
                  s_down=meta(128, 2048, dtype=torch.float32), configs=tiled)
    for cfgs in (None, (tmd.PairConfig(), tmd.PairConfig())):  # 128x128 block scales: tiled and looped down
        tmd.fused_moe(meta(1, 2048), meta(1, 8), meta(1, 8, dtype=torch.int64), meta(128, 1536, 2048, dtype=f8),
                      meta(128, 2048, 768, dtype=f8), s_gate_up=meta(128, 12, 16, dtype=torch.float32),
                      s_down=meta(128, 16, 6, dtype=torch.float32), configs=cfgs)
fns = {"_pair_up_kernel": tmd._pair_up_kernel, "_pair_down_sum_kernel": tmd._pair_down_sum_kernel,
       "_pair_down_tile_kernel": tmd._pair_down_tile_kernel}
for spec in rec.specs.values():
    fn = fns[spec["kernel"].split(":")[1]]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in spec["signature"].items()
             if t.startswith("*")}
    src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]})
    ptx = k.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "ld.global.v4" in ptx, fn.__name__
    assert not getattr(k.metadata, "global_scratch_size", 0)
print("ok", len(rec.specs))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    out = run_compile_script(_COMPILE)
    assert "ok 13" in out, out


@pytest.mark.interpreter
@pytest.mark.parametrize("configs", [RAGGED, TILED], ids=["loop", "tiled"])
def test_an_id_equal_to_e_is_dropped_without_reading_past_the_experts(configs):
    """Expert id E (one past the last) is invalid like any other: its pair reads expert 0 (no row of its h is read
    from past the weights: ``guarded`` surrounds them with NaN) and contributes nothing."""
    from tests.kernels.guarded import guarded

    E = 4
    ids = torch.tensor([[0, E], [E, 2], [3, 1]])
    x, weights, ids, wgu, wd = _inputs(3, 2, E, torch.float32, seed=14, ids=ids)
    hs = []
    with guarded():
        inner = launch_mod._launcher

        def capture(kernel, grid, args, consts, nw, ns):
            inner(kernel, grid, args, consts, nw, ns)
            if kernel is tmd._pair_up_kernel:
                hs.append(args[4])

        with launch_mod.using(capture):
            y = tmd.fused_moe(x, weights, ids, wgu, wd, configs=configs)
    (h,) = hs
    assert h.isfinite().all()
    keep = (ids >= 0) & (ids < E)
    _check(y, moe_ref.fused_moe(x, weights * keep, ids.clamp(0, E - 1), wgu, wd), TOL[torch.float32])


def test_loops_unrolled_up_to_unroll_max_steps():
    """``UNROLL_MAX_STEPS`` steps are unrolled, one more are not: gate/up of bf16 experts, and both loops of fp8
    experts (the down loop at its own step)."""
    n = tmd.UNROLL_MAX_STEPS
    step = tmd.config_for(4096, 768, torch.bfloat16)[0].BLOCK_K
    assert tmd.config_for(n * step, 768, torch.bfloat16)[0].UNROLL
    assert not tmd.config_for(n * step + 1, 768, torch.bfloat16)[0].UNROLL
    for scales in ("row", "block"):
        up_step, down_step = (c.BLOCK_K for c in tmd.config_for(4096, 4096, torch.bfloat16, scales=scales))
        at = tmd.config_for(n * up_step, n * down_step, torch.bfloat16, scales=scales)
        past = tmd.config_for(n * up_step + 1, n * down_step + 1, torch.bfloat16, scales=scales)
        assert at[0].UNROLL and at[1].UNROLL and not past[0].UNROLL and not past[1].UNROLL, scales


def test_no_launch_for_no_tokens():
    """Zero tokens: an empty output and no launch (an empty grid, which the runtime's cubin launcher would hand to
    the driver)."""
    seen = []
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(lambda *a: seen.append(a)):
        y = tmd.fused_moe(meta(0, 64), meta(0, 2), meta(0, 2, dtype=torch.int64), meta(4, 64, 64), meta(4, 64, 32))
    assert y.shape == (0, 64) and seen == []


@pytest.mark.interpreter  # the GPU's exp may round silu an fp32 ulp apart from torch's, flipping a rare rounding
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if _BF16_OK else []), ids=str)
@pytest.mark.parametrize("configs", [RAGGED, TILED], ids=["loop", "tiled"])
def test_rounds_as_the_reference(dtype, configs):
    """Inputs whose every dot product is exact in fp32 (small multiples of 1/8; each down row picks one value of
    h, times a power of two): then only the roundings differ, and they are the reference's (gate and up rounded,
    silu in fp32 rounded, the product rounded, each expert's output times its weight rounded): equal bits."""
    x, weights, ids, wgu, wd = _exact_inputs(dtype, T=3, k=2)
    y = tmd.fused_moe(*[_dev(t) for t in (x, weights, ids, wgu, wd)], configs=configs).cpu()
    assert torch.equal(y, moe_ref.fused_moe(x, weights, ids, wgu, wd))


def _exact_inputs(dtype, T, k, E=4, seed=17):
    """``test_rounds_as_the_reference``'s inputs: every dot product exact in fp32; weights powers of two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, H), generator=g).to(dtype)
    wgu = (torch.randint(-2, 3, (E, 2 * I, H), generator=g) / 8).to(dtype)
    wd = torch.zeros(E, H, I)
    wd[:, torch.arange(H), torch.arange(H) % I] = 2.0 ** torch.randint(-2, 3, (E, H), generator=g).float()
    wd = wd.to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = (2.0 ** -torch.randint(0, 3, (T, k), generator=g).float()).to(dtype)
    return x, weights, ids, wgu, wd


@pytest.mark.interpreter  # as test_rounds_as_the_reference: exact dot products, only the roundings differ
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if _BF16_OK else []), ids=str)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_fp32_weights_round_as_the_reference(dtype, k):
    """Mixtral's float32 routing weights with 16-bit x (``route(fp32_weights=True)``): each expert's output times
    its weight stays float32 (torch's promotion), the k products are summed in fp32 and rounded once, as
    ``moe_ref`` (and transformers' default experts path) does: equal bits for the pair kernels (the expert loop
    and the tiled one) and the sorted path, with and without a residual. The weights carry bits past x's dtype,
    so rounding them or the products to it shows (the bf16 weights' result is another)."""
    from mxc.kernels import torch_ref

    x, _, ids, wgu, wd = _exact_inputs(dtype, T=4, k=k, seed=19 + k)
    g = torch.Generator().manual_seed(k)
    weights = 2.0 ** -torch.randint(0, 3, (4, k), generator=g).float() * (1 + torch.randint(1, 64, (4, k),
                                                                                             generator=g) / 2**13)
    assert weights.dtype == torch.float32 and not torch.equal(weights, weights.to(dtype).float())
    ref = moe_ref.fused_moe(x, weights, ids, wgu, wd)
    assert not torch.equal(ref, moe_ref.fused_moe(x, weights.to(dtype), ids, wgu, wd))
    r = torch.randint(-4, 5, (4, H), generator=g).to(dtype)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    for configs in (RAGGED, TILED):
        assert torch.equal(tmd.fused_moe(*args, configs=configs).cpu(), ref), configs
        assert torch.equal(tmd.fused_moe(*args, residual=_dev(r), configs=configs).cpu(), torch_ref.add(r, ref))
    assert torch.equal(tm.fused_moe(*args, config=SORTED).cpu(), ref)
    assert torch.equal(tm.fused_moe(*args, residual=_dev(r), config=SORTED).cpu(), torch_ref.add(r, ref))
