"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

Applied in Hugging Face's order (temperature, then top-k, then top-p) so a
seeded run is comparable; everything stays on the logits' device.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
