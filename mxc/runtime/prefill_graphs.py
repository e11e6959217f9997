"""Short prompts' prefills replayed as CUDA graphs, one per prompt-length bucket.

Enqueueing a forward costs the host 8-20 ms whatever the prompt's length (hundreds of launches), more
than the GPU needs for a few hundred tokens: eager, a short prompt's time to first token is the host's.
A ``PrefillGraph`` holds one bucket of ``T`` tokens: a batch-1 prompt of ``s <= T`` tokens goes into slot 0
and a padding sequence of ``T - s`` tokens into the KV cache's scratch slot, so the captured forward
always sees ``T`` tokens in two sequences, whatever ``s``. Every host decision the forward makes depends
on ``T`` alone (kernel choices by token count, the attention's grid from ``max_q_len = T``); what depends
on ``s`` lives in device buffers refilled before each replay by one copy (``context.StaticInputs``). The
padding attends only to itself, writes only the scratch slot and its logits row is never read.
"""

from __future__ import annotations

import numpy as np
import torch

from mxc.kernels.context import ForwardContext, StaticInputs, host_arrays
from mxc.runtime.graph_capture import capture
from mxc.runtime_buckets import padded_prefill


class PrefillGraph:
    def __init__(self, dec, size: int):
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.int64, device=dec.device)  # stays valid ids between prompts
        self.inputs = StaticInputs(dec.device, **self._arrays(dec, size))
        t = self.inputs.tensors
        seq_lens, past_lens, slots = padded_prefill(size, size, dec.scratch_slot)  # what the kernels' hosts see
        self.ctx = ForwardContext(seq_lens, past_lens, slots, dec.k_cache, dec.v_cache, cache_loc=t["cache_loc"],
                                  kv_lens=t["kv_lens"], slots_t=t["slots"], q_start=t["q_start"], max_q_len=size,
                                  rope_tables=dec.rope_tables, positions=t["positions"], last_rows=t["last_rows"],
                                  **dec.dist)
        self.graph = self.logits = None

    def _arrays(self, dec, s: int) -> dict[str, np.ndarray]:
        arrays = host_arrays(*padded_prefill(s, self.size, dec.scratch_slot), dec.max_len)
        arrays["last_rows"] = arrays["last_rows"][:1]  # the prompt's last row: the padding's logits are not made
        return arrays

    def run(self, dec, ids: torch.Tensor) -> torch.Tensor:
        """The prompt ``ids`` [s] (on the device, ``s <= size``) into slot 0: its last position's logits [1, V],
        valid until this bucket's next run."""
        s = ids.numel()
        assert 1 <= s <= self.size, f"a prompt of {s} tokens in a bucket of {self.size}"
        self.inputs.fill(**self._arrays(dec, s))
        self.tokens[:s].copy_(ids)
        if self.graph is None:
            run = lambda: dec.forward(self.ctx, self.tokens, self.ctx.positions, self.ctx.last_rows)  # noqa: E731
            self.graph, self.logits = capture(run, dec.launcher, dec.pool)
        self.graph.replay()
        return self.logits
