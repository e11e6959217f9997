"""``CudaDecoder``'s host logic on the CPU: bucket choice, the padding of a batch to its bucket and of a prompt to
its prefill bucket, the greedy graph's on-device bookkeeping and the stop checks. CUDA graphs are replaced by a
stand-in that replays the captured Python function into the captured output (what a replay computes); the forward
is a toy model that reads only what a captured forward may read (the context's device tensors, never its host
lists), so the tokens it produces are those of a reference loop over each sequence's history alone."""

from __future__ import annotations

import pytest
import torch

from mxc.errors import MxcError
from mxc.runtime import decode_graphs, prefill_graphs
from mxc.runtime.decode_graphs import CudaDecoder

V = 97  # vocabulary of the toy model


def _next(history: list[int]) -> int:
    """The toy model's next token after ``history`` (a sequence's tokens, from position 0)."""
    return (sum((i + 1) * t for i, t in enumerate(history)) + len(history) - 1) % V


def _toy_forward(ctx, tokens, positions, rows):
    """Checks the context's device tensors against their definitions (``mxc.kernels.context``: cache_loc = slot *
    max_len + position, kv_len = past + new, max_q_len at least every sequence's new tokens; padding, in the scratch
    slot, writes only there and reads at least one row; the host lists count the tokens and sequences), writes
    each token into its cache row, then for each logit row reads its sequence's cached history and
    puts a clear maximum at ``_next(history)``."""
    k = ctx.k_cache[0]  # [slots, max_len, 1, 1]
    max_len, scratch = k.shape[1], k.shape[0] - 1
    q_start, slots = ctx.q_start.long(), ctx.slots_t.long()
    assert int(q_start[0]) == 0 and int(q_start[-1]) == tokens.numel() == positions.numel()
    assert ctx.max_q_len >= int((q_start[1:] - q_start[:-1]).max())  # the attention's grid covers every query row
    assert sum(ctx.seq_lens) == tokens.numel() and len(ctx.seq_lens) == len(ctx.slots) == slots.numel()
    of_token = torch.searchsorted(q_start[1:], torch.arange(tokens.numel()), right=True)
    assert ((0 <= positions) & (positions < max_len)).all()
    assert torch.equal(torch.div(ctx.cache_loc, max_len, rounding_mode="floor"), slots[of_token])
    live = slots[of_token] != scratch
    assert torch.equal(ctx.cache_loc[live], slots[of_token][live] * max_len + positions[live])
    filled = q_start[1:] > q_start[:-1]  # sequences with a token this call (a prefill bucket's padding may have none)
    assert (ctx.kv_lens[filled] >= 1).all()
    filled &= slots != scratch
    assert torch.equal(ctx.kv_lens.long()[filled], positions[q_start[1:][filled] - 1] + 1)
    k.view(-1).index_copy_(0, ctx.cache_loc, tokens.to(k.dtype))
    seq = torch.searchsorted(ctx.q_start[1:].long(), rows, right=True)
    slot, n = ctx.slots_t.long()[seq], ctx.kv_lens.long()[seq]
    idx = torch.arange(k.shape[1])
    weights = (idx + 1) * (idx[None] < n[:, None])
    nxt = ((k[slot, :, 0, 0] * weights).sum(1).long() + positions[rows]) % V
    return torch.nn.functional.one_hot(nxt, V).float() * 50


class _Graph:
    """A captured run: each replay runs it again and leaves its result in the captured output tensor."""

    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        self.out.copy_(self.run())


def _capture(run, launcher, pool, plain=False):
    for _ in range(2):  # the warm-ups, which run for real
        run()
    out = run()
    return _Graph(run, out), out


@pytest.fixture
def decoder(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(decode_graphs, "capture", _capture)
    monkeypatch.setattr(prefill_graphs, "capture", _capture)

    def make(max_batch=3, max_len=40, prefill_graph_tokens=32):
        kv = dict(layers=1, kv_heads=1, head_dim=1)
        return CudaDecoder(_toy_forward, None, kv, torch.float32, torch.device("cpu"), max_batch, max_len,
                           prefill_graph_tokens=prefill_graph_tokens)
    return make


def _reference(prompts, n: int) -> list[list[int]]:
    """Each prompt's n tokens after its own history alone (``prompts``: [B, S], or a list of prompts)."""
    out = []
    for row in (prompts.tolist() if isinstance(prompts, torch.Tensor) else prompts):
        history = list(row)
        for _ in range(n):
            history.append(_next(history))
        out.append(history[len(row):])
    return out


GREEDY = dict(temperature=0.0, top_k=None, top_p=None)
SAMPLED = dict(temperature=1.0, top_k=1, top_p=None)  # top_k=1: the sampling path, deterministic


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_batch_and_prompt_bucket_gives_the_reference_tokens(decoder, sampling):
    """Batches of 1..max_batch (padded to their power-of-two bucket, padding rows on the scratch slot) and prompts
    replayed in a prefill bucket (padded) or run eagerly (longer than every bucket) give each sequence the
    tokens of its history alone, in one decoder used again and again (stale cache rows must not leak)."""
    dec = decoder(max_batch=6)
    assert sorted(dec.buckets) == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(0)
    cases = [(3, 5, 7), (1, 20, 6), (2, 33, 5), (6, 16, 4), (5, 1, 9), (2, 17, 3), (1, 33, 7), (3, 2, 1), (4, 9, 5)]
    for b, s, n in cases:
        prompts = torch.randint(0, V, (b, s), generator=gen)
        got = dec.generate(prompts, n, sampling, None)
        assert got.tolist() == _reference(prompts, n), (b, s, n)
    # one graph per bucket used (each batch in the smallest bucket holding it); greedy decoding replays its own
    captured = {size for size, bucket in dec.buckets.items() if bucket.graph or bucket.greedy_graph}
    assert captured == {1 << (b - 1).bit_length() for b, _, n in cases if n > 1}  # one token: the prefill's only
    greedy = not sampling["temperature"]
    assert all((bucket.greedy_graph is not None) == greedy and (bucket.graph is not None) != greedy
               for size, bucket in dec.buckets.items() if size in captured)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prompts_of_different_lengths_each_continue_their_own_history(decoder, sampling):
    """Prompts of different lengths one after another (``lens``): one prefill of them all, then each row decodes
    from its own position (the greedy graph's positions advance from each row's own start), in padded buckets,
    with stale cache rows of longer earlier prompts around; one prompt given this way replays its prefill graph."""
    dec = decoder(max_batch=6)
    gen = torch.Generator().manual_seed(3)
    for lens, n in [([3, 17, 1], 6), ([40 - 5, 2], 5), ([1, 2, 3, 4, 5], 4), ([9, 1], 1), ([12], 7), ([33], 3)]:
        prompts = [torch.randint(0, V, (k,), generator=gen).tolist() for k in lens]
        got = dec.generate(torch.tensor(sum(prompts, [])), n, sampling, None, lens=lens)
        assert got.tolist() == _reference(prompts, n), (lens, n)
    assert dec.prefill_graphs[16].graph is not None and dec.prefill_graphs[32].graph is None  # [12]: bucket 16


def test_prefill_pads_to_the_smallest_bucket_holding_the_prompt(decoder):
    """A batch-1 prompt runs in the smallest prefill bucket holding it (its padding only in the scratch slot), a
    longer one, or a batch of more, eagerly; the logits are the prompt's own either way."""
    dec = decoder(prefill_graph_tokens=32)
    assert sorted(dec.prefill_graphs) == [16, 32]
    used = []
    for size, graph in dec.prefill_graphs.items():
        run = graph.run
        graph.run = lambda d, ids, _run=run, _size=size: used.append(_size) or _run(d, ids)
    gen = torch.Generator().manual_seed(1)
    for s, bucket in [(1, 16), (16, 16), (17, 32), (32, 32), (33, None)]:
        used.clear()
        ids = torch.randint(0, V, (1, s), generator=gen)
        assert dec.prefill(ids).argmax(-1).tolist() == [_next(ids[0].tolist())], s
        assert used == ([bucket] if bucket else []), s
        used.clear()
        assert dec.prefill(ids, graphs=False).argmax(-1).tolist() == [_next(ids[0].tolist())] and not used
    ids = torch.randint(0, V, (2, 5), generator=gen)
    assert dec.prefill(ids).argmax(-1).tolist() == [_next(r) for r in ids.tolist()] and not used


def test_prefill_refuses_what_the_cache_cannot_hold(decoder):
    dec = decoder(max_batch=2, max_len=40)
    with pytest.raises(ValueError, match="cache holds 2 x 40"):
        dec.prefill(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache holds 2 x 40"):
        dec.prefill(torch.zeros(1, 41, dtype=torch.int64))
    dec.prefill(torch.zeros(2, 40, dtype=torch.int64))  # a full slot fits


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stop_ids_end_generation_at_the_first_check_after_every_row_stopped(decoder, monkeypatch, sampling):
    """With stop ids, the tokens so far are looked at every STOP_CHECK_EVERY steps; generation ends at the first
    look where every row holds one (the rows after a row's stop token are left to the caller)."""
    monkeypatch.setattr(decode_graphs, "STOP_CHECK_EVERY", 3)
    dec = decoder()
    prompts = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(2))
    ref = _reference(prompts, 20)
    assert dec.generate(prompts, 20, sampling, None).tolist() == ref  # a run before: what it left must not count
    lasts = []
    for stop in ([ref[0][1], ref[1][4], ref[2][7]], [ref[0][1], ref[1][6]], [ref[0][1], ref[1][2], ref[2][6]],
                 [ref[0][0], ref[1][0], ref[2][0]]):
        stopped = [next((i for i, t in enumerate(row) if t in stop), None) for row in ref]
        want = 20 if None in stopped else next((k for k in range(3, 20, 3) if k > max(stopped)), 20)
        lasts.append(None if None in stopped else max(stopped))
        got = dec.generate(prompts, 20, sampling, None, stop_ids=stop)
        assert got.tolist() == [row[:want] for row in ref], stop
    assert None in lasts and any(last is not None and last % 3 == 0 for last in lasts)  # a row stopping at a look


def test_all_stopped():
    out = torch.tensor([[1, 5, 2], [3, 3, 7]])
    assert decode_graphs.all_stopped(out, torch.tensor([5, 7]))
    assert not decode_graphs.all_stopped(out, torch.tensor([5]))  # row 1 has not stopped
    assert not decode_graphs.all_stopped(out, None)


def test_cache_that_does_not_fit_names_the_options(monkeypatch):
    """The KV cache needs keys and values (2) x layers x (max_batch + 1) x max_len x kv_heads x head_dim elements."""
    need = 2 * 3 * (4 + 1) * 64 * 2 * 8 * 2  # bf16
    for free, fits in [(need, True), (need - 1, False)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, _free=free: (_free, 1 << 40))
        check = lambda: decode_graphs._check_cache_fits((5, 64, 2, 8), 3, torch.bfloat16, "cuda:0", 4, 64)  # noqa: E731
        if fits:
            check()
        else:
            with pytest.raises(MxcError, match="--max-batch 4 x --max-seq-len 64"):
                check()


def test_buckets_above_pdl_max_bucket_capture_plain_launches(decoder, monkeypatch):
    """A PDL artifact's decode buckets of more than PDL_MAX_BUCKET rows (sampling and greedy graphs alike) are captured
    with plain launches; smaller ones, and the prompt buckets, with the artifact's."""
    asked = []

    def capture(run, launcher, pool, plain=False):
        asked.append(plain)
        return _capture(run, launcher, pool, plain)

    monkeypatch.setattr(decode_graphs, "capture", capture)
    monkeypatch.setattr(prefill_graphs, "capture", capture)
    dec = decoder(max_batch=2 * decode_graphs.PDL_MAX_BUCKET, prefill_graph_tokens=16)
    for size, bucket in dec.buckets.items():
        asked.clear()
        bucket.step(dec)
        bucket.ensure_greedy(dec)
        assert asked == [size > decode_graphs.PDL_MAX_BUCKET] * 2, size
    asked.clear()
    dec.prefill(torch.ones(1, 5, dtype=torch.int64))
    assert asked == [False]


def test_drop_graphs_forgets_every_capture(decoder, monkeypatch):
    """After ``drop_graphs`` every decode bucket (sampling and greedy graphs) and prompt bucket captures again on its
    next run, into a fresh memory pool, and decodes as before."""
    captures, pools = [], iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))

    def capture(run, launcher, pool, plain=False):
        captures.append(pool)
        return _capture(run, launcher, pool, plain)

    monkeypatch.setattr(decode_graphs, "capture", capture)
    monkeypatch.setattr(prefill_graphs, "capture", capture)
    dec = decoder()
    prompts = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    for sampling in (GREEDY, SAMPLED):
        assert dec.generate(prompts[:1], 4, sampling, None).tolist() == _reference(prompts[:1], 4)
        assert dec.generate(prompts, 4, sampling, None).tolist() == _reference(prompts, 4)
    first = list(captures)
    assert len(first) == 5 and len(set(first)) == 1  # 2 buckets x 2 graphs, 1 prompt bucket: one pool
    dec.drop_graphs()
    assert all(b.graph is None and b.greedy_graph is None for b in dec.buckets.values())
    assert all(g.graph is None for g in dec.prefill_graphs.values())
    for sampling in (GREEDY, SAMPLED):
        assert dec.generate(prompts[:1], 4, sampling, None).tolist() == _reference(prompts[:1], 4)
        assert dec.generate(prompts, 4, sampling, None).tolist() == _reference(prompts, 4)
    again = captures[len(first):]
    assert len(again) == 5 and len(set(again)) == 1 and again[0] != first[0]
