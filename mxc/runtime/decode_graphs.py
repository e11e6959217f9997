"""GPU decoding: a static KV cache and one CUDA graph per batch-size bucket.

``CudaDecoder`` owns the preallocated cache (``max_batch + 1`` slots of
``max_seq_len`` rows per layer; the last slot absorbs padding rows) and, per
bucket, static input buffers and a captured decode step. A step copies the
new tokens, positions and cache locations into the bucket's buffers with
device-side ops and replays the graph: no host synchronisation inside the
decode loop; tokens are gathered on the device and copied out once at the end.
Greedy decoding goes further (``GREEDY_IN_GRAPH``): the bucket's greedy graph
ends with the argmax and the step's bookkeeping (the token into the input
buffer and the output column, positions, cache rows and lengths advanced), so
the loop is back-to-back replays with nothing launched between them.
A short batch-1 prompt's prefill replays a graph too (``prefill_graphs``).
With stop tokens, the loop looks at the tokens so far every ``STOP_CHECK_EVERY`` steps (one host
synchronisation) and ends once every row has produced one.
"""

from __future__ import annotations

import numpy as np
import torch

from mxc.errors import MxcError, size_text
from mxc.kernels import launch
from mxc.kernels.context import ForwardContext, to_device
from mxc.runtime_buckets import batch_bucket, batch_buckets, prefill_graph_bucket, prefill_graph_buckets
from mxc.runtime.graph_capture import capture
from mxc.runtime.prefill_graphs import PrefillGraph
from mxc.runtime.sampling import sample

# Buckets above this many rows are captured with plain launches even from a PDL artifact: on the
# H200 (Llama-3-8B shape, 2026-11-30) PDL took batch 1 from 4.51 to 4.33 ms and batch 8 from 5.14
# to 4.94, but batch 32 from 5.24 to 5.64 (the 32-row GEMVs' own cp.async pipelines compete with
# the weight prefetch of the kernel behind them).
PDL_MAX_BUCKET = 8

# Greedy decoding replays a graph that also picks the next token and advances the step on the device (the
# sampling path launches that bookkeeping from the host between replays: eight small kernels a step). On one
# H200 (2026-12-02, bench/decode_ab.py, medians of three interleaved rounds) batch 1 took 2.502 against 2.508 ms
# (Llama-3-8B fp8), 4.049 against 4.060 (bf16) and 2.542 against 2.548 (Qwen3-30B-A3B). False: the host loop (A/B).
GREEDY_IN_GRAPH = True

# With stop tokens (``generate(stop_ids=...)``), steps between looks at the tokens so far: each look is one host
# synchronisation, and a generation runs at most this many steps past the step where its last row stopped.
STOP_CHECK_EVERY = 32


def all_stopped(out: torch.Tensor, stop: torch.Tensor | None) -> bool:
    """Whether every row of ``out`` [b, n] (tokens so far) holds one of ``stop`` (None: no stop tokens)."""
    return stop is not None and bool(torch.isin(out, stop).any(1).all())


def _lengths(ids: torch.Tensor, lens: list[int] | None) -> list[int]:
    """Each prompt's length: ``lens``, whose prompts lie one after another in ``ids`` [sum(lens)], else every row
    of ``ids`` [B, S]."""
    if lens is None:
        return [ids.shape[1]] * ids.shape[0]
    assert ids.dim() == 1 and ids.numel() == sum(lens) and min(lens) >= 1, (ids.shape, lens)
    return list(lens)


class _Bucket:
    def __init__(self, dec: "CudaDecoder", size: int):
        dev = dec.device
        self.size = size
        scratch = dec.scratch_slot
        self.tokens = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.rows = torch.arange(size, device=dev)
        self.cache_loc = torch.full((size,), scratch * dec.max_len, dtype=torch.int64, device=dev)
        self.kv_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.slots = torch.full((size,), scratch, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(size + 1, dtype=torch.int32, device=dev)
        self.ctx = ForwardContext([1] * size, [0] * size, [scratch] * size, dec.k_cache, dec.v_cache,
                                  cache_loc=self.cache_loc, kv_lens=self.kv_lens, slots_t=self.slots,
                                  q_start=self.q_start, max_q_len=1, decode=True, rope_tables=dec.rope_tables,
                                  **dec.dist)
        self.graph = None
        self.logits = None
        # the greedy graph's state: rows that advance (0 for padding), each row's first cache row, the output
        # column the next token goes to, and the tokens so far [size, max_len]
        self.live = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slot_base = torch.full((size,), scratch * dec.max_len, dtype=torch.int64, device=dev)
        self.column = torch.zeros((size, 1), dtype=torch.int64, device=dev)
        self.out = None
        self.greedy_graph = None

    def step(self, dec: "CudaDecoder") -> torch.Tensor:
        if self.graph is None:
            self._capture(dec)
        self.graph.replay()
        return self.logits

    def _capture(self, dec: "CudaDecoder") -> None:
        run = lambda: dec.forward(self.ctx, self.tokens, self.positions, self.rows)  # noqa: E731
        self.graph, self.logits = capture(run, dec.launcher, dec.pool, plain=self.size > PDL_MAX_BUCKET)

    def ensure_greedy(self, dec: "CudaDecoder") -> None:
        """Capture the greedy graph if it is not yet. Its warm-up runs advance the state, so the state is put
        on the scratch slot first (every row padding: the warm-ups write only the scratch slot's cache rows)
        and set by ``begin_greedy`` after."""
        if self.greedy_graph is not None:
            return
        self.out = torch.zeros((self.size, dec.max_len), dtype=torch.int64, device=dec.device)
        self._set_rows(0, dec, 0)
        self.greedy_graph, _ = capture(self._greedy_step(dec), dec.launcher, dec.pool,
                                       plain=self.size > PDL_MAX_BUCKET)

    def _greedy_step(self, dec: "CudaDecoder"):
        def run():
            logits = dec.forward(self.ctx, self.tokens, self.positions, self.rows)
            torch.argmax(logits, dim=-1, out=self.tokens)  # sampling.sample's greedy choice
            self.out.scatter_(1, self.column, self.tokens[:, None])
            self.column.add_(1)
            self.positions.add_(self.live)
            torch.add(self.slot_base, self.positions, out=self.cache_loc)
            torch.add(self.positions, 1, out=self.kv_lens)
            return logits
        return run

    def _set_rows(self, b: int, dec: "CudaDecoder", s) -> None:
        """Rows < b decode slots 0..b-1 from positions s (a number, or one a row: [b] on the device); the rest
        are padding on the scratch slot."""
        scratch = dec.scratch_slot
        self.slots[:b].copy_(torch.arange(b, dtype=torch.int32, device=dec.device))
        self.slots[b:].fill_(scratch)  # padding rows write only to the scratch slot
        self.live.fill_(0)
        self.live[:b].fill_(1)
        self.slot_base.copy_(self.slots.to(torch.int64) * dec.max_len)
        self.positions.fill_(0)
        self.positions[:b] = s
        torch.add(self.slot_base, self.positions, out=self.cache_loc)
        torch.add(self.positions, 1, out=self.kv_lens)

    def begin_greedy(self, dec: "CudaDecoder", first: torch.Tensor, s) -> None:
        """The state before the first greedy replay: ``first`` [b] (the prefill's tokens) at positions s (a number,
        or [b] on the device)."""
        b = first.shape[0]
        self._set_rows(b, dec, s)
        self.tokens.zero_()
        self.tokens[:b].copy_(first)
        self.out[:b, 0].copy_(first)
        self.column.fill_(1)


def _check_cache_fits(shape, layers: int, dtype, device, max_batch: int, max_len: int) -> None:
    """The KV cache (keys and values of every layer, the batch's slots and the scratch slot) fits the GPU's free
    memory, or a one-line error names the build options that size it."""
    need = 2 * layers * torch.Size(shape).numel() * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise MxcError(f"the KV cache of --max-batch {max_batch} x --max-seq-len {max_len} takes {size_text(need)}, "
                       f"more than the {size_text(free)} free on {device} after the weights; rebuild with a "
                       f"smaller --max-batch or --max-seq-len")


class CudaDecoder:
    def __init__(self, forward_fn, launcher, kv: dict, dtype, device, max_batch: int, max_len: int,
                 dist: dict | None = None, prefill_graph_tokens: int = 0):
        self.dist = dist or {}
        self.forward_fn, self.launcher, self.device = forward_fn, launcher, device
        self.max_batch, self.max_len = max_batch, max_len
        self.scratch_slot = max_batch
        shape = (max_batch + 1, max_len, kv["kv_heads"], kv["head_dim"])
        _check_cache_fits(shape, kv["layers"], dtype, device, max_batch, max_len)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv["layers"])]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv["layers"])]
        self.rope_tables: dict = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets = {b: _Bucket(self, b) for b in batch_buckets(max_batch)}
        self.prefill_graph_tokens = prefill_graph_tokens
        self.prefill_graphs = {t: PrefillGraph(self, t) for t in prefill_graph_buckets(prefill_graph_tokens, max_len)}

    def drop_graphs(self) -> None:
        """Forget every captured decode step and prefill; the next run of each bucket captures again.

        The new captures take a fresh memory pool: capturing into the pool of graphs that were
        all freed trips PyTorch's allocator (``use_count > 0`` assert, torch 2.11).
        """
        for bucket in (*self.buckets.values(), *self.prefill_graphs.values()):
            bucket.graph = bucket.logits = None
        for bucket in self.buckets.values():
            bucket.greedy_graph = bucket.out = None
        self.pool = torch.cuda.graph_pool_handle()

    def forward(self, ctx, tokens, positions, rows):
        return self.forward_fn(ctx, tokens, positions, rows)

    def prefill(self, ids: torch.Tensor, graphs: bool = True, lens: list[int] | None = None) -> torch.Tensor:
        """Run the prompts [B, S] (or, given ``lens``, B prompts of those lengths one after another [sum(lens)])
        into slots 0..B-1; returns each prompt's last position's logits [B, V]. One prompt of at most
        ``prefill_graph_tokens`` replays its bucket's CUDA graph (``graphs=False``: eager)."""
        lens = _lengths(ids, lens)
        b, s = len(lens), max(lens)
        if b > self.max_batch or s > self.max_len:  # the cache has no rows for more: the kernels would write past it
            raise ValueError(f"prefill of {b} x {s} tokens: the cache holds {self.max_batch} x {self.max_len}")
        size = prefill_graph_bucket(s, self.prefill_graph_tokens, self.max_len) if graphs and b == 1 else None
        if size is not None:
            return self.prefill_graphs[size].run(self, ids.reshape(-1))
        ctx = ForwardContext.build(lens, [0] * b, list(range(b)), self.k_cache, self.v_cache, self.device,
                                   **self.dist)
        ctx.rope_tables = self.rope_tables
        with launch.using(self.launcher):
            return self.forward(ctx, ids.reshape(-1), ctx.positions, ctx.last_rows)

    def generate(self, ids: torch.Tensor, max_new_tokens: int, sampling: dict, generator,
                 agree=lambda tokens, temperature: tokens, stop_ids=(), lens: list[int] | None = None) -> torch.Tensor:
        """The new tokens [b, n] of the prompts ``ids`` (as ``prefill`` takes them): n = ``max_new_tokens``, or
        fewer once every row has produced one of ``stop_ids`` (looked at every ``STOP_CHECK_EVERY`` steps; what
        follows a row's stop token is left to the caller). ``agree`` makes tensor-parallel ranks continue with
        the same sampled tokens (so they stop together)."""
        lens, ids = _lengths(ids, lens), ids.reshape(-1)
        b = len(lens)
        bucket = self.buckets[batch_bucket(b, self.max_batch)]
        stop = torch.tensor(list(stop_ids), dtype=torch.int64, device=self.device) if len(stop_ids) else None
        if GREEDY_IN_GRAPH and not sampling["temperature"]:
            return self._generate_greedy(ids, lens, max_new_tokens, bucket, stop)
        out = torch.empty((b, max_new_tokens), dtype=torch.int64, device=self.device)
        nxt = agree(sample(self.prefill(ids, lens=lens), generator=generator, **sampling), sampling["temperature"])
        out[:, 0] = nxt
        slots = torch.arange(b, dtype=torch.int32, device=self.device)
        bucket.slots[:b].copy_(slots)
        bucket.slots[b:].fill_(self.scratch_slot)  # padding rows write only to the scratch slot
        bucket.cache_loc[b:].fill_(self.scratch_slot * self.max_len)
        bucket.kv_lens[b:].fill_(1)
        pos = self._on_device(lens)  # each row's next position
        slot_base = slots.to(torch.int64) * self.max_len  # row of each sequence's slot in the flat cache
        for step in range(1, max_new_tokens):
            if step % STOP_CHECK_EVERY == 0 and all_stopped(out[:, :step], stop):
                return out[:, :step]
            bucket.tokens[:b].copy_(nxt)
            bucket.positions[:b].copy_(pos)
            torch.add(slot_base, pos, out=bucket.cache_loc[:b])
            bucket.kv_lens[:b].copy_(pos + 1)
            logits = bucket.step(self)[:b]
            nxt = agree(sample(logits, generator=generator, **sampling), sampling["temperature"])
            out[:, step] = nxt
            pos += 1
        return out

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return to_device(self.device, np.asarray(values, dtype=np.int64))[0]

    def _generate_greedy(self, ids: torch.Tensor, lens: list[int], max_new_tokens: int, bucket: _Bucket,
                         stop: torch.Tensor | None = None) -> torch.Tensor:
        """``generate`` at temperature 0: the prefill's argmax, then up to ``max_new_tokens - 1`` replays of the
        bucket's greedy graph, each of which writes its token into the output on the device."""
        b = len(lens)
        if max_new_tokens == 1:
            return sample(self.prefill(ids, lens=lens))[:, None]
        bucket.ensure_greedy(self)  # before the prefill: its warm-ups must not write the prompts' cache rows
        first = sample(self.prefill(ids, lens=lens))
        bucket.begin_greedy(self, first, self._on_device(lens))
        for step in range(1, max_new_tokens):  # tokens so far: step
            if step % STOP_CHECK_EVERY == 0 and all_stopped(bucket.out[:b, :step], stop):
                return bucket.out[:b, :step].clone()
            bucket.greedy_graph.replay()
        return bucket.out[:b, :max_new_tokens].clone()
