"""Triton decode/prefill attention against ``torch_ref.attention`` (under TRITON_INTERPRET=1 on the CPU).

Each case builds a ForwardContext (python lists + caches) for the reference, lets
the reference write this call's keys/values into the cache, then runs the kernel
on that cache with the tensor arguments. Cache rows no sequence may read are NaN,
so a kernel that reads past kv_lens or into another slot fails. Shapes are tiny
and ragged (the interpreter costs ~0.4 ms per Triton op per program).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import triton

from mxc.kernels import kernel_templates
from mxc.kernels import launch as launch_mod
from mxc.kernels import torch_ref
from mxc.kernels import triton_attention as ta
from mxc.kernels.context import ForwardContext
from tests.triton_interpreter import bf16_ok

# bf16 needs the interpreter's float conversions fixed (tests/triton_interpreter.py) off the GPU
_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

GQA, MQA, MHA = (4, 2), (4, 1), (2, 2)


def _run_reference(seq_lens, past_lens, slots, HQ, HKV, D, L, dtype, window, seed):
    """q [T, HQ, D], the caches after the reference wrote this call's k/v, and its output."""
    g = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), max(slots) + 2  # one slot no sequence uses
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q, k, v = randn(T, HQ, D), randn(T, HKV, D), randn(T, HKV, D)
    k_cache = torch.full((S, L, HKV, D), float("nan"), dtype=dtype)
    v_cache = torch.full((S, L, HKV, D), float("nan"), dtype=dtype)
    for slot, past in zip(slots, past_lens):  # the cached prefix; rows past it stay NaN
        k_cache[slot, :past], v_cache[slot, :past] = randn(past, HKV, D), randn(past, HKV, D)
    ctx = ForwardContext(list(seq_lens), list(past_lens), list(slots), [k_cache], [v_cache])
    scale = D ** -0.5
    ref = torch_ref.attention(q, k, v, ctx, scale, layer=0, sliding_window=window)
    assert not ref.isnan().any()
    kv_lens = torch.tensor([p + n for p, n in zip(past_lens, seq_lens)], dtype=torch.int32)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    return dev(q), dev(k_cache), dev(v_cache), dev(torch.tensor(slots, dtype=torch.int32)), dev(kv_lens), scale, ref


def _check(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------------------------------------
# decode: kv lens [1, 13, 29] in a cache of 29 rows, slots permuted; splits that are empty,
# partial, and (D=64, L=130) splits that each hold a part of a long sequence.

def _sweep(*last):
    """Every (heads, window, last) at D=16; four of them, still covering each value, at D=32 and 64; two at head
    sizes that are not a power of two (48, 80, 96: the kernels' head block is wider, its extra lanes masked)."""
    full = list(itertools.product((GQA, MQA, MHA), (None, 4), last))
    some = [(GQA, None, last[0]), (MQA, 4, last[1]), (MHA, 4, last[0]), (GQA, 4, last[1])]
    for dtype in DTYPES:
        for D, variants in ((16, full), (32, some), (64, some), (48, some[:2]), (80, some[2:]), (96, some[1:3])):
            for heads, window, x in variants:
                yield dtype, D, heads, window, x


def _decode_cases():
    for dtype, D, heads, window, splits in _sweep(1, 3):
        yield pytest.param(dtype, D, heads, window, splits, 29, [1, 13, 29],
                           id=f"{str(dtype)[6:]}-D{D}-h{heads[0]}/{heads[1]}-w{window}-s{splits}")
    for window, splits in ((None, 2), (80, 2), (None, 3)):
        yield pytest.param(torch.float16, 64, GQA, window, splits, 130, [1, 70, 130],
                           id=f"long-w{window}-s{splits}")


@pytest.mark.parametrize("dtype, D, heads, window, splits, L, kv_lens", list(_decode_cases()))
def test_decode_attention(dtype, D, heads, window, splits, L, kv_lens):
    HQ, HKV = heads
    slots = [2, 0, 3]
    q, kc, vc, slots_t, kv_lens_t, scale, ref = _run_reference(
        [1] * len(kv_lens), [n - 1 for n in kv_lens], slots, HQ, HKV, D, L, dtype, window, seed=D + splits)
    out = ta.decode_attention(q, kc, vc, slots_t, kv_lens_t, scale, window, num_splits=splits)
    _check(out, ref, dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_empty_sequence_gives_zeros(splits):
    """A padding row of a CUDA-graph batch (kv_len 0) yields 0, not NaN, and leaves the others alone."""
    q, kc, vc, slots_t, kv_lens_t, scale, ref = _run_reference(
        [1], [4], [1], 4, 2, 16, 29, torch.float32, None, seed=0)
    q2 = torch.cat([torch.randn_like(q), q])  # sequence 0 is padding: kv_len 0, a NaN-only slot
    out = ta.decode_attention(q2, kc, vc, torch.tensor([2, 1], dtype=torch.int32, device=DEVICE),
                              torch.tensor([0, 5], dtype=torch.int32, device=DEVICE), scale, None, splits)
    assert (out[0] == 0).all()
    _check(out[1:], ref, torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("D", [48, 16])
def test_decode_writes_only_inside_out(D, splits):
    """Every launch under ``guarded`` (tests/kernels/guarded.py): the split kernel's padded group rows and head lanes
    (BLOCK_D = 64 for D = 48) and the merge's head lanes store nothing past the last head of the last sequence, where
    a neighbour inside the output would be overwritten in the interpreter's program order; the scratch of the
    splits stays inside its tensors."""
    from tests.kernels.guarded import guarded

    q, kc, vc, slots_t, kv_lens_t, scale, ref = _run_reference(
        [1, 1], [12, 28], [1, 0], 4, 2, D, 29, torch.float32, None, seed=D)
    with guarded():
        out = ta.decode_attention(q, kc, vc, slots_t, kv_lens_t, scale, None, num_splits=splits)
    _check(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# prefill: ragged query counts, with no cache prefix and with one (chunked prefill)

PREFILL_SHAPES = {  # name: (seq_lens, past_lens, max_q_len)
    "fresh": ([1, 5, 9], [0, 0, 0], 9),
    "chunked": ([4, 1, 7], [9, 12, 0], 7),
    "bigger-grid": ([3, 0, 6], [5, 2, 0], 24),  # an empty sequence; max_q_len above every length
    "multi-m-block": ([2, 18], [0, 6], 18),  # two M blocks for sequence 1 (BLOCK_M = 16 at D=16)
    "long-prefix": ([16, 3], [40, 50], 16),  # unmasked key blocks between the window edge and the diagonal
    # the first query of each sequence two keys before a key block's end (BLOCK_N = 16 at D=16): that block
    # holds keys later queries see and the first does not, so it must go through the causal mask
    "block-edge-prefix": ([5, 3], [14, 30], 5),
    # D = 256 runs 64-query blocks over 32-key blocks: with a window of 4 the last queries of a block see nothing in
    # its first window-edge key block (and no block before it), so their running max is still -inf there
    "wide-query-block": ([40, 7], [0, 30], 40),
}


def _prefill_cases():
    for dtype, D, heads, window, shape in _sweep("fresh", "chunked"):
        yield pytest.param(dtype, D, heads, window, shape,
                           id=f"{str(dtype)[6:]}-D{D}-h{heads[0]}/{heads[1]}-w{window}-{shape}")
    for window in (None, 4):
        yield pytest.param(torch.float32, 16, GQA, window, "bigger-grid", id=f"bigger-grid-w{window}")
        yield pytest.param(torch.float16, 16, MQA, window, "multi-m-block", id=f"multi-m-block-w{window}")
    for window in (None, 4, 40):
        yield pytest.param(torch.float32, 16, GQA, window, "long-prefix", id=f"long-prefix-w{window}")
    yield pytest.param(torch.float32, 16, GQA, None, "block-edge-prefix", id="block-edge-prefix")
    for window in (None, 4):
        yield pytest.param(torch.float32, 256, MQA, window, "wide-query-block", id=f"wide-query-block-w{window}")


@pytest.mark.parametrize("dtype, D, heads, window, shape", list(_prefill_cases()))
def test_prefill_attention(dtype, D, heads, window, shape):
    _prefill_against_reference(dtype, D, heads, window, shape)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("shape", ["bigger-grid", "multi-m-block", "long-prefix"])
def test_prefill_attention_query_blocks_first(monkeypatch, shape, window):
    """The grid's other order (query blocks fastest, from the first): the same blocks, in another order."""
    monkeypatch.setattr(ta, "PREFILL_LONGEST_FIRST", False)
    _prefill_against_reference(torch.float32, 16, GQA, window, shape)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("shape", ["chunked", "bigger-grid", "long-prefix"])
def test_prefill_attention_pointer_loads(monkeypatch, shape, window):
    """With ``PREFILL_TMA`` off, a power-of-two head dimension loads q, K and V through pointers (as 48, 80 and
    96 always do): the same results."""
    monkeypatch.setattr(ta, "PREFILL_TMA", False)
    _prefill_against_reference(torch.float16, 32, GQA, window, shape)


@pytest.mark.parametrize("D", [48, 32])
def test_prefill_writes_only_inside_out(D):
    """Under ``guarded`` (tests/kernels/guarded.py): query rows past a sequence's end (its last query block is partial)
    and head lanes past D (BLOCK_D = 64 for D = 48) store nothing, so nothing lands past the last token's row, where
    a neighbour inside the output would be overwritten by its own program in the interpreter's order. D = 32 loads
    through tensor descriptors, which pass unguarded."""
    from tests.kernels.guarded import guarded

    with guarded():
        _prefill_against_reference(torch.float32, D, GQA, None, "chunked")


def _prefill_against_reference(dtype, D, heads, window, shape):
    HQ, HKV = heads
    seq_lens, past_lens, max_q_len = PREFILL_SHAPES[shape]
    slots = [3, 1, 0][:len(seq_lens)]
    L = max(p + n for p, n in zip(past_lens, seq_lens)) + 3
    q, kc, vc, slots_t, kv_lens_t, scale, ref = _run_reference(
        seq_lens, past_lens, slots, HQ, HKV, D, L, dtype, window, seed=D)
    q_start = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    out = ta.prefill_attention(q, kc, vc, slots_t, kv_lens_t, q_start, max_q_len, scale, window)
    _check(out, ref, dtype)


# ---------------------------------------------------------------------------------------------
# build time: wrappers run on the meta device, and launches depend on shapes only

def _record(fn):
    calls = []
    rec = lambda kernel, grid, args, constexprs, nw, ns: calls.append(  # noqa: E731
        (kernel.fn.__name__, grid, constexprs, nw, ns, [getattr(a, "dtype", type(a)) for a in args],
         kernel.fn.__module__))
    with launch_mod.using(rec):
        fn()
    return calls


def _decode_args(device, kv_lens, B=3, HQ=8, HKV=2, D=128, L=1000, S=5, dtype=torch.bfloat16):
    q = torch.empty(B, HQ, D, dtype=dtype, device=device)
    cache = torch.empty(S, L, HKV, D, dtype=dtype, device=device)
    slots = torch.zeros(B, dtype=torch.int32, device=device)
    return q, cache, cache, slots, torch.tensor(kv_lens, dtype=torch.int32, device=device)


def test_decode_launches_are_static():
    meta = _record(lambda: ta.decode_attention(*_decode_args("meta", [1, 1, 1]), 0.1, None))
    assert [(c[0], c[1]) for c in meta] == [("decode_split_kernel", (3, 2, 4)), ("decode_reduce_kernel", (3, 8))]
    assert meta[0][2]["NUM_SPLITS"] == ta.default_splits(1000, 3 * 2) == 4
    # the rendered kernel carries the layout as literals: 8 q heads over 2 kv heads, padded to 16 rows
    source = kernel_templates.source(meta[0][-1])
    assert "BLOCK_G: tl.constexpr = 16" in source and "\n    L: tl.constexpr = 1000" in source
    assert "\n    L: tl.constexpr" not in kernel_templates.source(meta[1][-1])  # the merge: heads only
    # with real tensors, different lengths give the same launches (CUDA graphs replay them)
    short = _record(lambda: ta.decode_attention(*_decode_args("cpu", [1, 2, 3]), 0.1, 64))
    long = _record(lambda: ta.decode_attention(*_decode_args("cpu", [900, 1000, 7]), 0.1, 64))
    assert short == long and [c[1] for c in short] == [c[1] for c in meta]
    one = _record(lambda: ta.decode_attention(*_decode_args("meta", [1, 1, 1]), 0.1, None, num_splits=1))
    assert [(c[0], c[1]) for c in one] == [("decode_split_kernel", (3, 2, 1))]


def test_decode_early_dependents_go_to_the_last_kernel():
    """``early_dependents`` (the compiler's ``early_launch_o_proj``) makes the attention's last kernel let the next
    one launch before it waits: the merge, or the split kernel when one split writes the output. One sequence only."""
    def early(B, splits, flag=True):
        args = _decode_args("meta", [1] * B, B=B)
        calls = _record(lambda: ta.decode_attention(*args, 0.1, None, num_splits=splits, early_dependents=flag))
        return [c[0] for c in calls if c[2].get("EARLY_DEPENDENTS")]

    assert early(1, 4) == ["decode_reduce_kernel"]
    assert early(1, 1) == ["decode_split_kernel"]
    assert early(1, 4, flag=False) == early(1, 1, flag=False) == []
    assert early(3, 4) == early(3, 1) == []


def _prefill_launches(device, seq_lens, past_lens):
    q = torch.empty(sum(seq_lens), 8, 128, dtype=torch.float16, device=device)
    cache = torch.empty(4, 512, 2, 128, dtype=torch.float16, device=device)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    kv_lens = i32([p + n for p, n in zip(past_lens, seq_lens)])
    q_start = i32([0] + list(torch.tensor(seq_lens).cumsum(0)))
    return _record(lambda: ta.prefill_attention(q, cache, cache, i32([1, 0]), kv_lens, q_start, 300, 0.1, None))


def test_prefill_launches_are_static():
    meta = _prefill_launches("meta", [100, 200], [0, 0])
    assert [(c[0], c[1]) for c in meta] == [("prefill_kernel", (8, 2, 5))]  # heads, sequences, query blocks
    assert meta[0][2]["BLOCK_M"] == meta[0][2]["BLOCK_N"] == 64 and meta[0][2]["LONGEST_FIRST"]
    assert _prefill_launches("cpu", [100, 200], [0, 0]) == _prefill_launches("cpu", [300, 0], [10, 50]) == meta


def test_prefill_descriptors_where_the_head_dimension_is_a_power_of_two():
    """The launch gives TMA descriptors of q [T, HQ * D] and of the caches as [S * L, HKV * D] (blocks of the
    launch's BLOCK_M / BLOCK_N rows by D), or three Nones (pointer loads: a padded head dimension, or TMA off);
    the recorded spec types them as Triton does."""
    def launched(D, dtype=torch.float16):
        q = torch.empty(300, 8, D, dtype=dtype, device="meta")
        cache = torch.empty(4, 512, 2, D, dtype=dtype, device="meta")
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="meta")  # noqa: E731
        calls = []
        with launch_mod.using(lambda kernel, grid, args, constexprs, nw, ns: calls.append((kernel, args, constexprs))):
            ta.prefill_attention(q, cache, cache, i32([1, 0]), i32([100, 200]), i32([0, 100, 300]), 300, 0.1, None)
        return calls[0]

    kernel, args, constexprs = launched(128)
    qd, kd, vd = args[8:]
    assert (list(qd.shape), qd.block_shape) == ([300, 8 * 128], [constexprs["BLOCK_M"], 128])
    assert (list(kd.shape), kd.block_shape) == ([4 * 512, 2 * 128], [constexprs["BLOCK_N"], 128])
    assert (list(vd.shape), vd.block_shape) == ([4 * 512, 2 * 128], [constexprs["BLOCK_N"], 128])
    spec = launch_mod.spec_of(kernel, args, constexprs, 4, 3)
    assert [spec["signature"][n] for n in ("q_desc", "k_desc", "v_desc")] == [
        "tensordesc<fp16[64, 128]>", "tensordesc<fp16[64, 128]>", "tensordesc<fp16[64, 128]>"]
    assert launched(96)[1][8:] == [None, None, None]
    ta.PREFILL_TMA = False
    try:
        assert launched(128)[1][8:] == [None, None, None]
    finally:
        ta.PREFILL_TMA = True


def test_prefill_descriptors_are_copies_with_their_own_base():
    """The descriptors are copies of one validated descriptor a (dtype, shape, block): each launch's hold its own
    tensors (as views of the 2-D shape), and a misaligned tensor falls back to pointer loads."""
    q = torch.randn(10, 4, 32, dtype=torch.float16)
    caches = [torch.randn(2, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
    a = ta._prefill_descriptors(q, caches[0], caches[0], 16, 16)
    b = ta._prefill_descriptors(q, caches[1], caches[1], 16, 16)
    assert [d.base.data_ptr() for d in a] == [q.data_ptr(), caches[0].data_ptr(), caches[0].data_ptr()]
    assert [d.base.data_ptr() for d in b][1:] == [caches[1].data_ptr()] * 2
    assert [list(d.base.shape) for d in b] == [[10, 128], [32, 64], [32, 64]]
    assert a[1] is not b[1] and a[1].block_shape == b[1].block_shape == [16, 32]
    assert torch.equal(b[1].base, caches[1].view(32, 64))
    shifted = torch.empty(10 * 4 * 32 + 1, dtype=torch.float16)[1:].view(10, 4, 32)  # 2 bytes off alignment
    assert ta._prefill_descriptors(shifted, caches[0], caches[0], 16, 16) == [None, None, None]


def test_prefill_launch_of_a_kernel_without_descriptors(monkeypatch):
    """An artifact built before the TMA loads pins a kernel without the descriptor arguments: the launch
    gives it the eight arguments it takes."""
    render = ta.kernel_templates.kernel

    def pinned_old(*args, **kw):
        new = render(*args, **kw)
        return types.SimpleNamespace(fn=new.fn, arg_names=[n for n in new.arg_names if not n.endswith("_desc")])

    monkeypatch.setattr(ta.kernel_templates, "kernel", pinned_old)
    calls = _prefill_launches("meta", [100, 200], [0, 0])
    assert len(calls) == 1 and len(calls[0][5]) == 8


def test_prefill_config_is_constant_over_each_recorded_bucket():
    """The AOT build records one prefill a power-of-two bucket of tokens a sequence (its smallest length,
    2^(k-1) + 1: ``aot.scenarios``), so every length of the bucket must pick that length's tiles."""
    for D in (16, 64, 128, 256):
        for n in list(range(1, 300)) + [2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8193, 20000]:
            smallest = 1 if n == 1 else triton.next_power_of_2(n) // 2 + 1
            assert ta._prefill_config(D, n) == ta._prefill_config(D, smallest), (D, n)


def test_prefill_launch_of_a_kernel_without_the_order(monkeypatch):
    """An artifact built before LONGEST_FIRST pins its stored kernel, which lacks the constexpr: the
    launch keeps that kernel's grid (query blocks fastest) and constexprs, so its binary is found."""
    render = ta.kernel_templates.kernel

    def pinned_old(*args, **kw):
        new = render(*args, **kw)
        return types.SimpleNamespace(fn=new.fn, arg_names=[n for n in new.arg_names if n != "LONGEST_FIRST"])

    monkeypatch.setattr(ta.kernel_templates, "kernel", pinned_old)
    calls = _prefill_launches("meta", [100, 200], [0, 0])
    assert [(c[0], c[1]) for c in calls] == [("prefill_kernel", (5, 2, 8))]
    assert calls[0][2] == {"BLOCK_M": 64, "BLOCK_N": 64}


def test_default_splits():
    assert [ta.default_splits(L) for L in (32, 255, 256, 1000, 2048, 4096, 131072)] == [1, 1, 2, 4, 16, 32, 32]
    assert [ta.default_splits(4096, B * 8) for B in (1, 4, 8, 32, 128)] == [32, 8, 4, 1, 1]
