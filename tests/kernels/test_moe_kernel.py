"""Triton fused MoE (``triton_moe.moe_align`` / ``fused_moe``) against ``moe_ref.fused_moe``.

Runs under TRITON_INTERPRET=1 on the CPU (tests/triton_interpreter.py makes the interpreter's
bf16/fp8 conversions round as the GPU does), with small explicit configs on ragged shapes:
H = 48 and I = 40 are not multiples of the 32-wide tiles (partial K steps and n-tiles in both
GEMMs), CHUNK = 16 makes the sort span several chunks. ``moe_align`` is checked for its
invariants on random and degenerate routings; ``fused_moe`` against the reference for
T in {1, 5, 13}, E in {4, 8}, k in {1, 2}, fp32/fp16/bf16 (tolerance relative to the output's
largest magnitude: 1e-4, 2e-3, 2e-2), tokens that all pick one expert, experts with no tokens,
fp8 experts against the reference on dequantized weights. Also: meta-device recording (grids
and binaries from shapes only) and an sm_90 compile of every kernel (a subprocess without
the interpreter).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from mxc.kernels import launch as launch_mod
from mxc.kernels import fp8_ref, moe_ref
from mxc.kernels import triton_moe as tm
from mxc.kernels.triton_moe import MoeConfig
from mxc.loaders.quantize import quantize_fp8
from tests.sm90_compile import run_compile_script
from tests.triton_interpreter import bf16_ok

# bf16 needs the interpreter's float conversions fixed (tests/triton_interpreter.py) off the GPU
_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 48, 40
SMALL = MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK=16)


def _random_ids(T, k, E, g):
    """Distinct experts per token, as top-k routing gives."""
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int64)


def _inputs(T, k, E, dtype, seed, ids=None, h=H, i=I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g).to(dtype)
    ids = _random_ids(T, k, E, g) if ids is None else ids
    weights = torch.rand(T, k, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w_down = (torch.randn(E, h, i, generator=g) * i ** -0.5).to(dtype)
    return x, weights, ids, w_gate_up, w_down


def _dev(t):
    return None if t is None else t.to(DEVICE)


def _check(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    y, ref = y.cpu().float(), ref.float()
    assert not y.isnan().any()
    err, scale = (y - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"max error {err}, output scale {scale}"


def _run(T, k, E, dtype, seed, cfg=SMALL, ids=None, h=H, i=I):
    x, weights, ids, w_gate_up, w_down = _inputs(T, k, E, dtype, seed, ids, h, i)
    y = tm.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(w_gate_up), _dev(w_down), config=cfg)
    _check(y, moe_ref.fused_moe(x, weights, ids, w_gate_up, w_down), TOL[dtype])
    return y


# ----------------------------------------------------------------------------------------------
# moe_align


@pytest.fixture
def three_kernel_sort(monkeypatch):
    """The count, offsets and scatter kernels even where one chunk would take the one-program sort (the default)."""
    monkeypatch.setattr(tm, "ONE_CHUNK_SORT", False)


def _check_align(ids, E, block_m, chunk):
    sorted_ids, expert_of_block, ntpp = (t.cpu() for t in tm.moe_align(_dev(ids), E, block_m, chunk=chunk))
    numel = ids.numel()
    flat = ids.flatten()
    P = tm.padded_size(numel, E, block_m)
    assert sorted_ids.shape == (P,) and expert_of_block.shape == (P // block_m,) and ntpp.shape == (1,)
    assert sorted_ids.dtype == expert_of_block.dtype == ntpp.dtype == torch.int32
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert ntpp.item() == padded.sum().item() <= P
    start = 0
    for e in range(E):
        group = sorted_ids[start:start + padded[e]]
        expected = torch.nonzero(flat == e).flatten().to(torch.int32)  # ascending assignments
        assert torch.equal(group[:counts[e]], expected), f"expert {e}"
        assert (group[counts[e]:] == numel).all(), f"padding of expert {e}"
        assert (expert_of_block[start // block_m:(start + padded[e]) // block_m] == e).all()
        start += padded[e].item()
    assert (sorted_ids[start:] == numel).all() and (expert_of_block[start // block_m:] == -1).all()
    # every valid assignment exactly once; dropped ones (ids outside [0, E)) never
    real = sorted_ids[sorted_ids < numel].long()
    assert torch.equal(torch.sort(real).values, torch.nonzero(valid).flatten())


@pytest.mark.usefixtures("three_kernel_sort")
@pytest.mark.parametrize("T,k,E,block_m,chunk", [
    (1, 1, 4, 16, 1024), (1, 2, 8, 16, 16), (5, 2, 4, 16, 16), (13, 2, 8, 16, 16),
    (40, 2, 8, 16, 16), (40, 4, 16, 4, 32), (33, 3, 5, 8, 64), (7, 8, 64, 16, 16),
])
def test_moe_align_random(T, k, E, block_m, chunk):
    g = torch.Generator().manual_seed(T * 100 + E)
    _check_align(_random_ids(T, k, E, g), E, block_m, chunk)


@pytest.mark.usefixtures("three_kernel_sort")
@pytest.mark.parametrize("T,k,E,block_m,chunk", [(1, 1, 4, 16, 64), (33, 3, 5, 8, 64)])
def test_moe_align_writes_only_inside_tensors(T, k, E, block_m, chunk):
    """Under ``guarded`` (tests/kernels/guarded.py): P (16; 136) is not a multiple of CHUNK, so the count kernel's
    last chunk of sentinels must stop at P, and the scatter writes only inside ``sorted_token_ids``."""
    from tests.kernels.guarded import guarded

    with guarded():
        _check_align(_random_ids(T, k, E, torch.Generator().manual_seed(T + E)), E, block_m, chunk)


@pytest.mark.usefixtures("three_kernel_sort")
def test_moe_align_tile_loops(monkeypatch):
    """The sort's loops over tiles of chunks and blocks, several steps each (tiles shrunk)."""
    monkeypatch.setattr(tm, "_OFFSETS_TILE_ELEMS", 8)  # E = 3 -> E_PAD 4 -> 2 chunks / blocks a step
    monkeypatch.setattr(tm, "_SCATTER_C_TILE", 2)
    g = torch.Generator().manual_seed(5)
    _check_align(_random_ids(40, 2, 3, g), 3, 4, 16)  # 5 chunks, 23 blocks


@pytest.mark.parametrize("T,k,E,block_m,chunk", [
    (1, 1, 4, 16, 256), (1, 2, 8, 16, 16), (8, 2, 4, 16, 16), (7, 2, 8, 4, 16), (33, 3, 5, 8, 128),
    (7, 8, 64, 16, 64), (40, 4, 16, 4, 256), (8, 8, 128, 16, 64), (32, 8, 128, 16, 256),
])
def test_moe_align_one_chunk(T, k, E, block_m, chunk, monkeypatch):
    """``ONE_CHUNK_SORT``: assignments that fit one chunk are sorted by one program with the same results (the
    invariants, every group in ascending order). P (up to 2176) spans several chunks of sentinels."""
    monkeypatch.setattr(tm, "ONE_CHUNK_SORT", True)
    assert chunk <= tm.ONE_CHUNK_MAX  # up to its largest chunk (a 1024-key sort ran slower: never built)
    names = []
    real = tm.launch
    monkeypatch.setattr(tm, "launch", lambda kernel, *a, **kw: (names.append(kernel.fn.__name__),
                                                                 real(kernel, *a, **kw)))
    g = torch.Generator().manual_seed(T * 10 + k)
    _check_align(_random_ids(T, k, E, g), E, block_m, chunk)
    assert names == ["_moe_align_one_chunk_kernel"]
    names.clear()
    ids = torch.full((T, k), E - 1, dtype=torch.int64)  # every assignment on the last expert
    ids[0, 0] = -1  # and one dropped
    _check_align(ids, E, block_m, chunk)
    from tests.kernels.guarded import guarded

    with guarded():  # writes only inside its tensors
        _check_align(_random_ids(T, k, E, g), E, block_m, chunk)


def test_moe_align_one_chunk_only_where_it_fits(monkeypatch):
    """Past one chunk of assignments, or with chunks past ``ONE_CHUNK_MAX``, the three kernels run, knob or not."""
    monkeypatch.setattr(tm, "ONE_CHUNK_SORT", True)
    three = ["_moe_count_kernel", "_moe_offsets_kernel", "_moe_scatter_kernel"]
    names = []
    with launch_mod.using(lambda kernel, grid, *a: names.append(kernel.fn.__name__)):
        for T, chunk in ((2, 16), (3, 16), (2, tm.ONE_CHUNK_MAX), (2, 2 * tm.ONE_CHUNK_MAX)):
            tm.moe_align(torch.zeros((T, 8), dtype=torch.int64, device="meta"), 8, 16, chunk=chunk)
    assert names == ["_moe_align_one_chunk_kernel", *three, "_moe_align_one_chunk_kernel", *three]


@pytest.mark.usefixtures("three_kernel_sort")
def test_moe_align_degenerate():
    # all tokens on one expert (two blocks of it), the other experts empty
    _check_align(torch.full((20, 1), 2, dtype=torch.int64), 4, 16, 16)
    # two experts of eight used, groups exactly block-sized (no padding)
    _check_align(torch.tensor([[1, 6]] * 16, dtype=torch.int64), 8, 16, 16)
    # a single expert
    _check_align(torch.zeros((9, 1), dtype=torch.int64), 1, 4, 16)
    # ids outside [0, E) are dropped
    _check_align(torch.tensor([[0, -1], [5, 3], [3, 1]], dtype=torch.int64), 4, 4, 16)


# ----------------------------------------------------------------------------------------------
# fused_moe


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("T", [1, 5, 13])
def test_fused_moe(T, E, k, dtype):
    _run(T, k, E, dtype, seed=T * 10 + E + k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_expert_for_all(dtype):
    """20 tokens on expert 2 (two BLOCK_M blocks of one expert); the other three get none."""
    _run(20, 1, 4, dtype, seed=3, ids=torch.full((20, 1), 2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_experts(dtype):
    """k = 2 over 8 experts, only experts 1 and 6 used (and 6 by exactly BLOCK_M assignments)."""
    ids = torch.tensor([[1, 6]] * 16, dtype=torch.int64)
    ids[::3] = torch.tensor([6, 1])
    _run(16, 2, 8, dtype, seed=4, ids=ids)


@pytest.mark.parametrize("T,k,E,cfg,h,i,dtype", [
    (5, 2, 4, None, H, I, torch.bfloat16),  # config_for's tiles (64 wide) on a small shape
    (6, 3, 4, MoeConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, CHUNK=16), H, I, torch.float16),  # k = 3
    (9, 2, 8, MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK=1024), 64, 32, torch.float32),  # EVEN_K
    (3, 4, 8, MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, CHUNK=16), 64, 48, torch.bfloat16),
], ids=["default", "k3-bm32", "even-k", "k4"])
def test_variants(T, k, E, cfg, h, i, dtype):
    _run(T, k, E, dtype, seed=T + k + E, cfg=cfg, h=h, i=i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2])
def test_residual(k, dtype):
    """``fuse_linear_io``'s residual: added by the sum kernel (which then runs at k = 1 too) as
    ``torch_ref.add`` adds it to the unfused output: equal bits."""
    from mxc.kernels import torch_ref

    x, weights, ids, wgu, wd = _inputs(7, k, 4, dtype, seed=k)
    r = torch.randn(7, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    args = [_dev(t) for t in (x, weights, ids, wgu, wd)]
    plain = tm.fused_moe(*args, config=SMALL)
    y = tm.fused_moe(*args, residual=_dev(r), config=SMALL)
    assert torch.equal(y.cpu(), torch_ref.add(r, plain.cpu()))
    with pytest.raises(ValueError, match="residual"):
        tm.fused_moe(*args, residual=_dev(r[:, :-1].contiguous()), config=SMALL)


@pytest.mark.parametrize("k,residual", [(1, False), (2, False), (1, True)])
def test_writes_only_inside_tensors(k, residual):
    """Every launch (the sort's three kernels, both GEMMs, the sum) under ``guarded`` (tests/kernels/guarded.py):
    H = 52 leaves a partial last n-tile in GEMM 2 and a partial last column block in the sum kernel (64 wide),
    whose stores one column past the last token's row would land outside the output; loads past it read NaN."""
    from mxc.kernels import torch_ref
    from tests.kernels.guarded import guarded

    h = 52
    x, weights, ids, wgu, wd = _inputs(5, k, 4, torch.float32, seed=21 + k, h=h)
    r = torch.randn(5, h, generator=torch.Generator().manual_seed(2)) if residual else None
    with guarded():
        y = tm.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(wgu), _dev(wd), residual=_dev(r), config=SMALL)
    ref = moe_ref.fused_moe(x, weights, ids, wgu, wd)
    _check(y, ref if r is None else torch_ref.add(r, ref), TOL[torch.float32])


@pytest.mark.parametrize("T,k,residual", [(13, 2, False), (5, 3, True), (6, 1, False)])
def test_fp32_weights(T, k, residual):
    """Mixtral's float32 routing weights with 16-bit x (bf16 where the interpreter's conversions are fixed): taken
    (not refused as another dtype than x's) and checked as the bf16 weights are; the products stay float32 until
    the k-sum (``y`` float32; at k = 1 without a residual y is the output itself). Bit for bit: test_moe_decode's
    ``test_fp32_weights_round_as_the_reference``."""
    from mxc.kernels import torch_ref

    dtype = torch.bfloat16 if _BF16_OK else torch.float16
    x, _, ids, wgu, wd = _inputs(T, k, 4, dtype, seed=T + k)
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(k))  # float32, not rounded to x's dtype
    r = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype) if residual else None
    seen = []

    def spy(kernel, grid, args, constexprs, num_warps, num_stages):
        seen.append((kernel, args))
        launch_mod.jit_launch(kernel, grid, args, constexprs, num_warps, num_stages)

    with launch_mod.using(spy):
        y = tm.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(wgu), _dev(wd), residual=_dev(r), config=SMALL)
    ref = moe_ref.fused_moe(x, weights, ids, wgu, wd)
    _check(y, ref if r is None else torch_ref.add(r, ref), TOL[dtype])
    (gemm2_args,) = [args for kernel, args in seen if kernel is tm._moe_gemm2_kernel]
    assert gemm2_args[3].dtype == torch.float32  # the weights as given
    assert gemm2_args[7].dtype == (torch.float32 if k > 1 or residual else dtype)  # y


def test_deterministic():
    a = _run(13, 2, 4, torch.bfloat16, seed=1)
    b = _run(13, 2, 4, torch.bfloat16, seed=1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,k,E", [(1, 2, 4), (13, 2, 8)])
def test_fp8_experts(T, k, E, dtype):
    x, weights, ids, w_gate_up, w_down = _inputs(T, k, E, torch.float32, seed=T + E)
    w_gate_up[:, :I] *= 3  # gate and up rows at different scales
    (q1, s1), (q2, s2) = quantize_fp8(w_gate_up, "channel"), quantize_fp8(w_down, "channel")  # as the loader
    x, weights = x.to(dtype), weights.to(dtype)
    y = tm.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(q1), _dev(q2), s_gate_up=_dev(s1), s_down=_dev(s2),
                     config=SMALL)
    _check(y, moe_ref.fused_moe(x, weights, ids, fp8_ref.dequantize_experts(q1, s1, dtype),
                                fp8_ref.dequantize_experts(q2, s2, dtype)), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,k,E,h,i,cfg", [
    (1, 2, 4, 200, 128, SMALL),  # ragged H: the last K block short, the K loop masked
    # steps span K blocks (two stages of 32 x 256 tiles: within an H200's shared memory, unlike three of 64 x 256)
    (13, 2, 8, 300, 256, MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_stages=2, CHUNK=16)),
])
def test_fp8_experts_block_scales(T, k, E, h, i, cfg, dtype):
    """Already-fp8 checkpoints' 128x128 block scales: every tile dequantized as the reference does. Each expert's
    blocks at very different scales, so a block scale read for the wrong rows or columns shows."""
    x, weights, ids, w_gate_up, w_down = _inputs(T, k, E, torch.float32, seed=T + E, h=h, i=i)
    g = torch.Generator().manual_seed(7)
    w_gate_up *= torch.rand(E, 2 * i // 128, -(-h // 128), generator=g).mul(4).exp2().repeat_interleave(
        128, 1).repeat_interleave(128, 2)[:, :, :h]
    w_down *= torch.rand(E, -(-h // 128), -(-i // 128), generator=g).mul(4).exp2().repeat_interleave(
        128, 1)[:, :h].repeat_interleave(128, 2)[:, :, :i]
    (q1, s1), (q2, s2) = quantize_fp8(w_gate_up, "block128"), quantize_fp8(w_down, "block128")
    assert s1.shape == (E, 2 * i // 128, -(-h // 128)) and s2.shape == (E, -(-h // 128), -(-i // 128))
    x, weights = x.to(dtype), weights.to(dtype)
    y = tm.fused_moe(_dev(x), _dev(weights), _dev(ids), _dev(q1), _dev(q2), s_gate_up=_dev(s1), s_down=_dev(s2),
                     config=cfg)
    _check(y, moe_ref.fused_moe(x, weights, ids, fp8_ref.dequantize_experts(q1, s1, dtype),
                                fp8_ref.dequantize_experts(q2, s2, dtype)), TOL[dtype])


def _formatted_inputs(T, k, E, h, i, dtype, weights, seed):
    """x and routing weights in ``dtype``, ids, the experts in a weight format ("bf16": ``dtype``; "channel",
    "block128": e4m3 with row or 128x128 block scales), fused_moe's scale keywords, and the weights the reference
    multiplies (the fp8 ones dequantized as the kernels do)."""
    x, rw, ids, w_gate_up, w_down = _inputs(T, k, E, torch.float32, seed=seed, h=h, i=i)
    x, rw = x.to(dtype), rw.to(dtype)
    if weights == "bf16":
        ws = (w_gate_up.to(dtype), w_down.to(dtype))
        return x, rw, ids, ws, {}, ws
    (q1, s1), (q2, s2) = quantize_fp8(w_gate_up, weights), quantize_fp8(w_down, weights)
    ref_ws = (fp8_ref.dequantize_experts(q1, s1, dtype), fp8_ref.dequantize_experts(q2, s2, dtype))
    return x, rw, ids, (q1, q2), dict(s_gate_up=_dev(s1), s_down=_dev(s2)), ref_ws


@pytest.mark.parametrize("weights", ["bf16", "channel", "block128"])
@pytest.mark.parametrize("T", [64, 256, 512])
def test_default_prefill_tiles(T, weights):
    """The tiles config_for gives past 16 rows an expert (bf16 experts 64 x 256, the down GEMM on its own tile; fp8
    experts 32 x 128 with 128-wide K steps, 64 x 128, 128 x 128 as rows an expert grow: 32, 128 and 256 here), run
    as fused_moe picks them, against the reference."""
    E, k, h, i, dtype = 4, 2, 256, 256, torch.bfloat16
    cfg = tm.config_for(tm.token_bucket(T), E, k, h, i, dtype, fp8_weights=weights != "bf16")
    assert (cfg.BLOCK_M, cfg.BLOCK_N) == ((64, 256) if weights == "bf16" else
                                          {64: (32, 128), 256: (64, 128), 512: (128, 128)}[T])
    x, rw, ids, ws, scales, ref_ws = _formatted_inputs(T, k, E, h, i, dtype, weights, seed=T)
    y = tm.fused_moe(_dev(x), _dev(rw), _dev(ids), *map(_dev, ws), **scales)
    _check(y, moe_ref.fused_moe(x, rw, ids, *ref_ws), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["channel", "block128"])
@pytest.mark.parametrize("T", [3, 8, 32])
def test_default_decode_tiles_fp8(T, weights, dtype):
    """fp8 experts up to 16 rows an expert: config_for's 256-element K steps (row scales; block scales keep 128),
    run as fused_moe picks them, against the reference, for either 16-bit activation; H = 384 ends in a half step
    (masked)."""
    E, k, h, i = 8, 2, 384, 256
    cfg = tm.config_for(tm.token_bucket(T), E, k, h, i, dtype, fp8_weights=True, block_scales=weights == "block128")
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (16, 64, 256 if weights == "channel" else 128)
    x, rw, ids, ws, scales, ref_ws = _formatted_inputs(T, k, E, h, i, dtype, weights, seed=T)
    y = tm.fused_moe(_dev(x), _dev(rw), _dev(ids), *map(_dev, ws), **scales)
    _check(y, moe_ref.fused_moe(x, rw, ids, *ref_ws), TOL[dtype])


@pytest.mark.parametrize("weights", ["bf16", "channel", "block128"])
def test_down_tile_of_its_own(weights):
    """MoeConfig.DOWN gives GEMM 2 its own tile (here wider N, narrower K, other warps and stages than GEMM 1's; I =
    192 ends in a masked step), with the same result as the shared tile, against the reference."""
    E, k, T, h, i, dtype = 4, 2, 24, 256, 192 if weights != "block128" else 256, torch.bfloat16
    x, rw, ids, ws, scales, ref_ws = _formatted_inputs(T, k, E, h, i, dtype, weights, seed=3)
    shared = tm.MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3, CHUNK=64)
    own = tm.MoeConfig(**{**vars(shared), "DOWN": (128, 32, 8, 2)})
    assert own.down() == (128, 32, 8, 2) and shared.down() == (32, 64, 4, 3)
    args = (_dev(x), _dev(rw), _dev(ids), *map(_dev, ws))
    y = tm.fused_moe(*args, **scales, config=own)
    _check(y, moe_ref.fused_moe(x, rw, ids, *ref_ws), TOL[dtype])
    torch.testing.assert_close(y, tm.fused_moe(*args, **scales, config=shared), rtol=0, atol=2e-2)


def test_rejects_bad_inputs():
    x, weights, ids, wgu, wd = _inputs(3, 2, 4, torch.float16, seed=0)
    ok = dict(config=SMALL)
    with pytest.raises(ValueError):
        tm.fused_moe(x, weights, ids.int(), wgu, wd, **ok)
    with pytest.raises(ValueError, match="weights must be contiguous"):  # x's dtype or float32 (Mixtral's)
        tm.fused_moe(x, weights.to(torch.bfloat16), ids, wgu, wd, **ok)
    with pytest.raises(ValueError, match="weights must be contiguous"):
        tm.fused_moe(x, weights.double(), ids, wgu, wd, **ok)
    with pytest.raises(ValueError):
        tm.fused_moe(x, weights, ids, wgu.float(), wd, **ok)
    with pytest.raises(ValueError):
        tm.fused_moe(x, weights, ids, wgu[:, :, :40].contiguous(), wd, **ok)
    with pytest.raises(ValueError):
        tm.fused_moe(x, weights, ids, wgu, wd.transpose(1, 2), **ok)
    with pytest.raises(ValueError):  # fp8 without scales
        tm.fused_moe(x, weights, ids, wgu.to(torch.float8_e4m3fn), wd, **ok)
    fp8 = dict(s_gate_up=torch.ones(4, 1, 1), s_down=torch.ones(4, H))  # block scales for one, row for the other
    with pytest.raises(ValueError, match="one granularity"):
        tm.fused_moe(x, weights, ids, wgu.to(torch.float8_e4m3fn), wd.to(torch.float8_e4m3fn), **fp8, **ok)
    fp8 = dict(s_gate_up=torch.ones(4, 1, 1), s_down=torch.ones(4, 1, 1))  # I = 40: gate/up blocks straddle
    with pytest.raises(ValueError, match="multiple of 128"):
        tm.fused_moe(x, weights, ids, wgu.to(torch.float8_e4m3fn), wd.to(torch.float8_e4m3fn), **fp8, **ok)
    with pytest.raises(ValueError):
        tm.moe_align(ids, 4, 12)
    with pytest.raises(ValueError):
        tm.moe_align(ids[:0], 4, 16)


def test_config_table():
    """config_for's table: vLLM-style heuristics for fp32 activations and bf16 experts up to 16 rows an expert (fp8
    experts there: the same tile with 256-element K steps); past 16 rows, for 16-bit activations, the tiles
    bench/moe_prefill_lab.py found fastest (bf16 experts where H and I are multiples of 256; fp8 experts by rows an
    expert), the bf16 tile's down GEMM a tile of its own. Every config's stages fit sm_90's shared memory."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        size = torch.empty((), dtype=dtype).element_size()
        for E, k in ((8, 2), (64, 8), (128, 8), (256, 8)):
            for t in (1, 2, 8, 32, 128, 1024, 8192):
                for fp8 in (False, True):
                    cfg = tm.config_for(t, E, k, 4096, 1024, dtype, fp8_weights=fp8)
                    assert cfg == tm.config_for(t, E, k, 4096, 1024, dtype, fp8_weights=fp8)
                    per_expert = t * k / E
                    tile = (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K * size, cfg.num_warps, cfg.num_stages)
                    if dtype == torch.float32 or (per_expert <= 16 and not fp8):
                        assert cfg.BLOCK_M == (16 if per_expert <= 16 else 32 if per_expert <= 64 else 64)
                        assert cfg.BLOCK_K * size in (128, 256)
                    elif per_expert <= 16:  # fp8 experts at decode: 256 weight bytes a K step, as bf16's 128
                        assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages) == \
                            (16, 64, 256, 4, 3)
                    elif fp8:
                        assert tile == ((32, 128, 256, 4, 3) if per_expert <= 64 else (64, 128, 128, 4, 3)
                                        if per_expert <= 128 else (128, 128, 128, 8, 4))
                        assert cfg.DOWN is None
                    else:
                        assert tile == (64, 256, 128, 8, 3) and cfg.DOWN == (256, 64, 4, 4)
                    if cfg.DOWN is None:  # the heuristic and the decode tiles: one tile for both GEMMs
                        assert cfg.down() == (cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages)
                    w_size = 1 if fp8 else size
                    smem = cfg.num_stages * (cfg.BLOCK_M * size + 2 * cfg.BLOCK_N * w_size) * cfg.BLOCK_K
                    down_n, down_k, _, down_stages = cfg.down()
                    down_smem = down_stages * (cfg.BLOCK_M * size + down_n * w_size) * down_k
                    assert max(smem, down_smem) <= 227 * 1024, (cfg, smem, down_smem)
    # fp8 experts with block scales keep the heuristic's 128-element steps at decode (a step spans one block)
    for t in (1, 8, 32):
        assert tm.config_for(t, 128, 8, 2048, 768, torch.bfloat16, fp8_weights=True, block_scales=True) == \
            tm.heuristic_config(t, 128, 8, 2048, 768, torch.bfloat16)
    # bf16 experts whose I is no multiple of 256 (Qwen1.5-MoE's 1408) keep the heuristic: no wasted columns
    assert tm.config_for(2048, 60, 4, 2048, 1408, torch.bfloat16).BLOCK_N == 128
    assert tm.config_for(2048, 60, 4, 2048, 1408, torch.bfloat16, fp8_weights=True).BLOCK_N == 128
    assert tm.config_for(1, 8, 2, 48, 40, torch.float16).BLOCK_N == 64  # tiles shrink to the shape
    assert [tm.token_bucket(t) for t in (1, 2, 3, 5, 17, 4096, 4097)] == [1, 2, 4, 8, 32, 4096, 8192]
    assert tm.padded_size(2, 128, 16) == 32 and tm.padded_size(26, 8, 16) == 160
    with pytest.raises(ValueError):
        tm.config_for(3, 8, 2, 64, 64, torch.float16)


# ----------------------------------------------------------------------------------------------
# recording and ahead-of-time compilation


def test_meta_recording():
    """On meta tensors nothing runs; T = 1, 3 and 4 launch the same binaries (constexprs, warps,
    stages, argument types; T*k is a dynamic argument) with grids from shapes; k = 1 needs no
    sum kernel."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, launch_mod.spec_of(kernel, args, constexprs, num_warps, num_stages)))

    E, k, h, i, dtype = 64, 8, 2048, 768, torch.bfloat16
    meta = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device="meta")  # noqa: E731
    w_gate_up, w_down = meta(E, 2 * i, h), meta(E, h, i)
    specs = {}
    with launch_mod.using(record):
        for T in (1, 3, 4, 4096):
            launches.clear()
            y = tm.fused_moe(meta(T, h), meta(T, k), meta(T, k, dt=torch.int64), w_gate_up, w_down)
            assert y.shape == (T, h) and y.device.type == "meta"
            names = [kern.fn.__name__ if hasattr(kern, "fn") else kern.__name__ for kern, _, _ in launches]
            # decode batches' assignments fit one chunk: one sort program (ONE_CHUNK_SORT); prefill's take three
            sort = (["_moe_align_one_chunk_kernel"] if T < 4096 else
                    ["_moe_count_kernel", "_moe_offsets_kernel", "_moe_scatter_kernel"])
            assert names == [*sort, "_moe_gemm1_kernel", "_moe_gemm2_kernel", "_moe_sum_kernel"]
            gemm1 = launches[len(sort)]
            bm = gemm1[2]["constexprs"]["BLOCK_M"]
            P = tm.padded_size(T * k, E, bm)
            assert gemm1[1] == (P // bm, -(-i // gemm1[2]["constexprs"]["BLOCK_N"]))
            specs[T] = [spec for _, _, spec in launches]
        launches.clear()
        tm.fused_moe(meta(5, h), meta(5, 1), meta(5, 1, dt=torch.int64), w_gate_up, w_down)
        assert len(launches) == 3  # the sort, the two GEMMs
    # T = 1..4 (<= 16 rows per expert) share binaries; the prefill bucket has its own tiles
    assert specs[1] == specs[3] == specs[4] and specs[4] != specs[4096]
    assert specs[1][1]["constexprs"]["BLOCK_M"] == 16 and specs[4096][3]["constexprs"]["BLOCK_M"] == 64


_COMPILE_SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mxc.kernels import launch as L, triton_moe as tm

    specs = {}
    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        spec = L.spec_of(kernel, args, constexprs, num_warps, num_stages)
        specs.setdefault(L.spec_key(spec), (kernel, spec))
    meta = lambda *shape, dt: torch.empty(*shape, dtype=dt, device="meta")
    bf16, fp8, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
    # (T, E, k, H, I, activations, weights): decode and prefill buckets, every dtype, fp8 experts
    cases = [(1, 128, 8, 2048, 768, bf16, bf16), (64, 128, 8, 2048, 768, bf16, bf16),
             (4096, 128, 8, 2048, 768, bf16, bf16), (16, 8, 2, 4096, 14336, torch.float16, torch.float16),
             (1, 8, 2, 1024, 512, f32, f32), (4096, 8, 1, 1024, 512, f32, f32),
             (1, 256, 8, 7168, 2048, bf16, fp8), (4096, 256, 8, 7168, 2048, bf16, fp8),
             (1, 128, 8, 2048, 768, bf16, "block"), (4096, 128, 8, 2048, 768, bf16, "block"),
             # fp8 experts' prefill tiles at 32 and 1024 rows an expert (32 x 128, 128 x 128)
             (1024, 256, 8, 7168, 2048, bf16, fp8), (4096, 8, 2, 4096, 14336, bf16, fp8),
             (512, 128, 8, 2048, 768, bf16, "block"),
             # fp8 experts' decode tile (256-element K steps) at 16 rows an expert
             (64, 8, 2, 4096, 14336, bf16, fp8)]
    with L.using(record):
        tm.ONE_CHUNK_SORT = True  # the one-program sort too, at chunks of 64 and 256 (its largest)
        for T, E in ((8, 128), (1, 8), (32, 256)):
            tm.moe_align(meta(T, 8, dt=torch.int64), E, 16, chunk=max(64, T * 8))
        tm.ONE_CHUNK_SORT = False
        for T, E, k, H, I, dt, wdt in cases:
            scales = dict(s_gate_up=meta(E, 2 * I, dt=f32), s_down=meta(E, H, dt=f32)) if wdt == fp8 else {}
            if wdt == "block":  # 128x128 block scales (already-fp8 checkpoints)
                wdt, scales = fp8, dict(s_gate_up=meta(E, 2 * I // 128, H // 128, dt=f32),
                                        s_down=meta(E, H // 128, I // 128, dt=f32))
            tm.fused_moe(meta(T, H, dt=dt), meta(T, k, dt=dt), meta(T, k, dt=torch.int64),
                         meta(E, 2 * I, H, dt=wdt), meta(E, H, I, dt=wdt), **scales)
    for fn, spec in specs.values():
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n, t in spec["signature"].items() if t.startswith("*")}
        src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
        md = k.metadata
        assert md.shared <= 232448, (fn.__name__, md.shared)  # sm_90: 227 KB per block
        assert not getattr(md, "global_scratch_size", 0), fn.__name__
        if "gemm" in fn.__name__:
            assert "mma" in k.asm["ptx"], "no tensor-core instructions"
        print(fn.__name__, spec["constexprs"].get("BLOCK_M"), "smem", md.shared, "ok")
    print("compiled", len(specs))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    """Every kernel, at the default configs of decode and prefill buckets, fp32/fp16/bf16 and fp8
    experts, compiles for Hopper (sm_90) within shared memory, the GEMMs on tensor cores."""
    out = run_compile_script(_COMPILE_SCRIPT)
    n = int(out.split("compiled")[-1])
    assert n >= 20 and out.count(" ok") == n, out
