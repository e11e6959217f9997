"""``ForwardContext.build``: the device tensors a forward reads, against their definitions written out token by token."""

import numpy as np
import pytest
import torch

from mxc.kernels.context import ForwardContext, StaticInputs, to_device

CASES = [  # seq_lens, past_lens, slots, max_len
    ([5], [0], [0], 8),  # one prompt
    ([3, 1, 4], [0, 6, 2], [2, 0, 1], 16),  # ragged, cached prefixes, slots out of order
    ([1, 1, 1], [7, 0, 3], [1, 2, 0], 9),  # a decode step
    ([2, 0, 3], [1, 4, 0], [0, 1, 2], 5),  # a sequence with no new token
    ([1, 0, 1], [2, 3, 0], [2, 0, 1], 6),  # at most one new token each, but not one each: not a decode step
]


def _reference(seq_lens, past_lens, slots, max_len):
    loc = [s * max_len + p + j for s, p, n in zip(slots, past_lens, seq_lens) for j in range(n)]
    positions = [p + j for p, n in zip(past_lens, seq_lens) for j in range(n)]
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return dict(cache_loc=(loc, torch.int64), positions=(positions, torch.int64),
                last_rows=([e - 1 for e in starts[1:]], torch.int64),
                kv_lens=([p + n for p, n in zip(past_lens, seq_lens)], torch.int32), slots_t=(slots, torch.int32),
                q_start=(starts, torch.int32))


def _check(ctx, case):
    seq_lens, past_lens, slots, _ = case
    for name, (want, dtype) in _reference(*case).items():
        got = getattr(ctx, name)
        assert got.dtype == dtype and got.is_contiguous(), name
        assert got.cpu().tolist() == want, name
    assert (ctx.seq_lens, ctx.past_lens, ctx.slots) == (seq_lens, past_lens, slots)
    assert ctx.max_q_len == max(seq_lens) and ctx.decode == all(n == 1 for n in seq_lens)


@pytest.mark.parametrize("case", CASES)
def test_build_matches_the_token_by_token_definitions(case):
    seq_lens, past_lens, slots, max_len = case
    cache = [torch.zeros(len(slots), max_len, 1, 2)]
    _check(ForwardContext.build(seq_lens, past_lens, slots, cache, cache, torch.device("cpu")), case)


def _arrays():
    return [np.arange(5, dtype=np.int64), np.array([[1, 2], [3, 4]], dtype=np.int32), np.array([], dtype=np.int32),
            np.array([0.5, -1.0], dtype=np.float32), np.arange(7, dtype=np.int64)[::2]]


def test_to_device_keeps_values_shapes_and_dtypes():
    for a, got in zip(_arrays(), to_device("cpu", *_arrays())):
        assert got.shape == a.shape and got.is_contiguous() and torch.equal(got, torch.from_numpy(a.copy()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, packed copy runs on CUDA")
def test_to_device_on_cuda_packs_one_aligned_copy():
    got = to_device("cuda", *_arrays())
    for a, t in zip(_arrays(), got):
        assert t.device.type == "cuda" and t.data_ptr() % 16 == 0 and t.shape == a.shape
        assert torch.equal(t.cpu(), torch.from_numpy(a.copy()))


def test_static_inputs_refill_in_place():
    """A CUDA graph's inputs: each refill writes new values into the same tensors (same addresses, 16-byte
    aligned), and inputs shaped unlike the layout are refused."""
    first = dict(a=np.arange(5, dtype=np.int64), b=np.array([3, 4], dtype=np.int32), c=np.zeros(3, dtype=np.int32))
    inputs = StaticInputs("cpu", **first)
    ptrs = {k: t.data_ptr() for k, t in inputs.tensors.items()}
    assert all(p % 16 == 0 for p in ptrs.values())
    for k, a in first.items():
        assert torch.equal(inputs.tensors[k], torch.from_numpy(a))
    second = dict(a=np.arange(5, 10, dtype=np.int64), b=np.array([7, 8], dtype=np.int32), c=np.ones(3, dtype=np.int32))
    inputs.fill(**second)
    assert {k: t.data_ptr() for k, t in inputs.tensors.items()} == ptrs
    for k, a in second.items():
        assert torch.equal(inputs.tensors[k], torch.from_numpy(a)) and inputs.tensors[k].dtype == torch.from_numpy(a).dtype
    with pytest.raises(AssertionError, match="differ from the layout"):
        inputs.fill(a=np.arange(6, dtype=np.int64), b=second["b"], c=second["c"])


def test_counters_are_one_tensor_per_name_kept_for_later_calls():
    """``counters``: int32 zeros of at least n, one tensor per name shared by every later call that fits in it (the
    kernels leave it at 0); a larger n makes a larger one."""
    ctx = ForwardContext([1], [0], [0])
    a = ctx.counters("route", 4, "cpu")
    assert a.dtype == torch.int32 and a.numel() >= 4 and not a.any()
    assert ctx.counters("route", 4, "cpu") is a and ctx.counters("route", 2, "cpu") is a
    other = ctx.counters("moe", 4, "cpu")
    assert other is not a and other.data_ptr() != a.data_ptr()
    big = ctx.counters("route", 9, "cpu")
    assert big.numel() >= 9 and not big.any() and ctx.counters("route", 9, "cpu") is big


def test_counters_on_cuda_are_the_current_devices(monkeypatch):
    """Kernels ask with their tensors' device (``cuda:0``); ``cuda`` names the same device, so the same tensor (the
    memo seeded here: this machine may have no GPU to allocate on)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    ctx = ForwardContext([1], [0], [0])
    seeded = ctx.memo[("counters", "route", "cuda:1")] = torch.zeros(4, dtype=torch.int32)
    assert ctx.counters("route", 4, "cuda") is seeded and ctx.counters("route", 2, torch.device("cuda:1")) is seeded


def test_build_without_a_kv_cache():
    """A model without attention layers has an empty cache list (or none): ``build`` still gives every sequence
    tensor, with no cache rows to offset by (max_len 0)."""
    case = ([3, 1], [2, 0], [1, 0], 0)
    for caches in ([], None):
        _check(ForwardContext.build(*case[:3], caches, caches, torch.device("cpu")), case)


def test_build_passes_the_process_group_through():
    """``build``'s extra keywords (the tensor-parallel rank, world size, group, peer all-reduce) reach the context."""
    cache = [torch.zeros(2, 4, 1, 2)]
    peer, group = object(), object()
    ctx = ForwardContext.build([1, 1], [0, 2], [0, 1], cache, cache, torch.device("cpu"), rank=1, world_size=2,
                               group=group, peer_allreduce=peer)
    assert (ctx.rank, ctx.world_size, ctx.group, ctx.peer_allreduce) == (1, 2, group, peer)


def test_to_device_on_a_device_other_than_cuda_copies_plainly():
    """Only CUDA takes the pinned, packed copy: elsewhere (``meta``, as at build time) each array is its own
    tensor of that shape and dtype on the device."""
    for a, got in zip(_arrays(), to_device("meta", *_arrays())):
        assert got.device.type == "meta" and got.shape == a.shape and got.dtype == torch.from_numpy(a.copy()).dtype


def test_static_inputs_take_float32_and_refuse_another_dtype():
    """Every dtype of the staging table round-trips through a refill (float32 included), and a refill whose array has
    the layout's shape but another dtype is refused."""
    first = dict(x=np.array([0.5, -2.0, 3.25], dtype=np.float32), n=np.array([7, 8, 9], dtype=np.int32))
    inputs = StaticInputs("cpu", **first)
    for k, a in first.items():
        assert torch.equal(inputs.tensors[k], torch.from_numpy(a))
    second = dict(x=np.array([1.5, 0.0, -4.0], dtype=np.float32), n=np.array([1, 2, 3], dtype=np.int32))
    inputs.fill(**second)
    for k, a in second.items():
        assert torch.equal(inputs.tensors[k], torch.from_numpy(a))
    with pytest.raises(AssertionError, match="differ from the layout"):
        inputs.fill(x=second["x"], n=second["n"].astype(np.int64))


def test_counters_are_made_on_the_device_asked_for():
    """``counters`` of one name on two devices (``meta`` while recording a build, the real one when run) are two
    tensors, each on its own device."""
    ctx = ForwardContext([1], [0], [0])
    cpu = ctx.counters("route", 4, "cpu")
    meta = ctx.counters("route", 4, "meta")
    assert cpu.device.type == "cpu" and meta.device.type == "meta" and meta.dtype == torch.int32
    assert ctx.counters("route", 4, "cpu") is cpu and ctx.counters("route", 4, "meta") is meta


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_static_inputs_live_on_their_device(device):
    """``StaticInputs``' tensors are views of one buffer on the device asked for, not on the host."""
    inputs = StaticInputs(device, a=np.arange(5, dtype=np.int64), b=np.array([3.0, 4.0], dtype=np.float32))
    for k, (shape, dtype) in {"a": ((5,), torch.int64), "b": ((2,), torch.float32)}.items():
        t = inputs.tensors[k]
        assert t.device.type == device and tuple(t.shape) == shape and t.dtype == dtype
