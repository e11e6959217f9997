"""What a forward call knows besides its tensors: sequences and the KV cache.

The IR's tokens are all sequences flattened into one ``[T]`` batch.
``ForwardContext`` says how they split and where their keys and values live:

- host lists (read by the torch reference): ``seq_lens[b]`` new tokens of
  sequence b, ``past_lens[b]`` tokens already cached, ``slots[b]`` its cache row;
- the same on the device (read by GPU kernels, fixed addresses under CUDA
  graphs): ``cache_loc [T] int64`` = slot * max_len + position of each token,
  ``kv_lens [B] int32`` = past + new, ``slots_t [B] int32``, ``q_start [B+1]
  int32`` (prefix sums of seq_lens), ``max_q_len`` and ``decode`` (every
  sequence has exactly one new token);
- ``k_cache[layer]``/``v_cache[layer]``: ``[slots, max_len, kv_heads, head_dim]``;
- ``rope_tables``: RoPE cos/sin tables prepared at load, by spec;
- ``memo``: values shared by every layer of one call (``counters``: the zeroed
  counts of kernels whose last program finishes the work, and leaves them at 0);
- ``rank``, ``world_size``, ``group``: the tensor-parallel process group;
  ``peer_allreduce``: the runtime's all-reduce over peer memory (one-shot or push), or None.

Kernels read it; the runtime builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    seq_lens: list[int]
    past_lens: list[int]
    slots: list[int]
    k_cache: list[torch.Tensor] | None = None
    v_cache: list[torch.Tensor] | None = None
    cache_loc: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    slots_t: torch.Tensor | None = None
    q_start: torch.Tensor | None = None
    max_q_len: int = 0
    decode: bool = False
    rope_tables: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    rank: int = 0  # tensor parallelism: this process's rank, the world size, the process group
    world_size: int = 1
    group: object = None
    peer_allreduce: object = None  # ``peer_allreduce.OneShotAllReduce`` or ``PushAllReduce``, as the artifact asks

    def counters(self, name: str, n: int, device) -> torch.Tensor:
        """int32 zeros [>= n] on ``device`` for kernels that count their finished programs and leave the
        counts at 0 again (the last program does the rest of the work): one tensor per name, made on the
        context's first use (for a CUDA graph, its warm-up call, outside the capture) and shared by every
        layer and later call, which rely on the kernels leaving it at 0."""
        key = ("counters", name, str(device))
        t = self.memo.get(key)
        if t is None or t.numel() < n:
            t = self.memo[key] = torch.zeros(n, dtype=torch.int32, device=device)
        return t

    @classmethod
    def build(cls, seq_lens: list[int], past_lens: list[int], slots: list[int], k_cache, v_cache,
              device, **extra) -> "ForwardContext":
        """A context with both the host lists and their device tensors."""
        max_len = k_cache[0].shape[1] if k_cache else 0
        loc = [s * max_len + p + j for s, p, n in zip(slots, past_lens, seq_lens) for j in range(n)]
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(list(seq_lens), list(past_lens), list(slots), k_cache, v_cache,
                   cache_loc=torch.tensor(loc, dtype=torch.int64, device=device),
                   kv_lens=torch.tensor([p + n for p, n in zip(past_lens, seq_lens)], **i32),
                   slots_t=torch.tensor(slots, **i32), q_start=torch.tensor(starts, **i32),
                   max_q_len=max(seq_lens), decode=all(n == 1 for n in seq_lens), **extra)
