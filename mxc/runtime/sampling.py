"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

Applied in Hugging Face's order (temperature, then top-k, then top-p) so a
seeded run is comparable; everything stays on the logits' device.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from mxc.errors import MxcError


def check_generate_args(max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=None, flags=False) -> tuple:
    """``generate``'s arguments, checked before any work (and, for a tensor-parallel command, before its ranks
    start): an MxcError naming the first bad one. Sampling arguments with greedy decoding (no temperature) are
    refused, as it would ignore them, by their command-line names with ``flags``. Returns them as Python's own
    numbers, what torch takes (a numpy integer or float, a Fraction, pass the checks as their values do):
    (max_new_tokens, temperature, top_k, top_p, seed), the integers as int and the others as float."""
    def whole(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    def name(arg: str) -> str:
        return f"--{arg.replace('_', '-')}" if flags else arg

    if not whole(max_new_tokens) or max_new_tokens < 1:
        raise MxcError(f"{name('max_new_tokens')} must be an integer >= 1, got {max_new_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not 0 <= _float(temperature) < math.inf):
        raise MxcError(f"{name('temperature')} must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not whole(top_k) or top_k < 1):
        raise MxcError(f"{name('top_k')} must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise MxcError(f"{name('top_p')} must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (not whole(seed) or not -2**63 <= seed < 2**64):
        raise MxcError(f"{name('seed')} must be an integer in [-2**63, 2**64), got {seed!r}")
    unused = next((n for n, v in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if v is not None), None)
    if not temperature and unused:
        raise MxcError(f"{name(unused)} needs {name('temperature')} > 0 (greedy decoding does not sample)")

    def as_int(v):
        return None if v is None else operator.index(v)  # numbers.Integral's __index__ is int(v)

    return (as_int(max_new_tokens), _float(temperature), as_int(top_k), None if top_p is None else float(top_p),
            as_int(seed))


def _float(v: numbers.Real) -> float:
    """``v`` as a float; inf past the largest (a Fraction or an int too large for one)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if not temperature:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # from the row's largest logit down: a tiny temperature (1e-39) sends the others to -inf, not the top one to inf;
    # one under float32's smallest normal (1e-46 would divide by a float32 0: 0 / 0 at the top) divides as that one,
    # which sends every logit not tied with the top to -inf as well
    temperature = max(float(temperature), torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
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
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    except RuntimeError:  # on the CPU; a GPU's multinomial checks nothing (a check would wait for it each step)
        if not bool(logits.isnan().any()):
            raise
        raise MxcError("the model's logits hold NaN or infinite values (its activations overflowed the build's "
                       "dtype): nothing to sample from; rebuild with a wider --dtype (bfloat16 or float32)") from None
