"""What a forward call knows besides its tensors: sequences and the KV cache.

The IR's tokens are all sequences flattened into one ``[T]`` batch.
``ForwardContext`` says how they split (``seq_lens``), how many tokens each
sequence already has in the cache (``past_lens``), and holds the per-layer
cache tensors ``k_cache[layer]``/``v_cache[layer]`` of shape
``[slots, max_len, kv_heads, head_dim]`` (``slots[b]`` = the row of sequence b).
With no cache, attention is over the call's own tokens only. Kernels read it;
the runtime builds it. ``memo`` holds values shared by every layer of one call
(the RoPE cos/sin tables).
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
    memo: dict = field(default_factory=dict)

    @classmethod
    def no_cache(cls, seq_lens: list[int]) -> "ForwardContext":
        return cls(list(seq_lens), [0] * len(seq_lens), list(range(len(seq_lens))))
