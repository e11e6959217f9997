"""Mixture-of-experts reference: routing and the expert MLPs, as Hugging Face computes them.

``route`` scores the router logits (softmax or sigmoid, in float32), keeps the
top k experts per token and optionally renormalises their weights to sum to
one; the weights come back in the logits' dtype (Qwen2-MoE, Qwen3-MoE, OLMoE),
or with ``fp32_weights`` in float32 (transformers' Mixtral router does not cast
them back). ``experts`` runs, for every expert, its gated MLP on the tokens
routed to it and adds the result, scaled by the routing weight, into the
output (the loop HF's eager path runs). Float32 weights with 16-bit x (Mixtral's)
make each product float32 (torch's promotion); those are summed over the token's
k in float32 and rounded once, as transformers' default experts path
(``grouped_mm``; ``batched_mm`` alike) sums them. (Its eager loop rounds each
product to x's dtype before ``index_add_``: one ulp apart on about a third of a
bf16 Mixtral's outputs. With weights in x's dtype the two paths agree for k <= 2.)
``fused_moe`` is the same computation over a merged gate/up stack
([E, 2I, H]): the semantics every fused kernel must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits, k, scoring="softmax", renormalize=False, fp32_weights=False):
    scores = logits.float().softmax(dim=-1) if scoring == "softmax" else logits.float().sigmoid()
    weights, ids = torch.topk(scores, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), ids


def _experts(x, weights, ids, expert_mlp) -> torch.Tensor:
    if weights.dtype != x.dtype:  # float32 weights: the float32 products, summed in order of j, rounded once
        terms = x.new_zeros((*ids.shape, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype))
        for e in torch.unique(ids).tolist():
            tok, pos = torch.where(ids == e)
            terms[tok, pos] = expert_mlp(e, x[tok]) * weights[tok, pos, None]
        return terms.sum(dim=1).to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, pos = torch.where(ids == e)
        y = expert_mlp(e, x[tok]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts(x, weights, ids, w_gate, w_up, w_down):
    """x [T, H]; weights/ids [T, k]; w_gate/w_up [E, I, H]; w_down [E, H, I] -> [T, H]."""
    return _experts(x, weights, ids,
                    lambda e, h: F.linear(F.silu(F.linear(h, w_gate[e])) * F.linear(h, w_up[e]), w_down[e]))


def fused_moe(x, weights, ids, w_gate_up, w_down):
    """The same over a merged stack: w_gate_up [E, 2I, H] (gate rows, then up rows)."""
    def mlp(e, h):
        gate, up = F.linear(h, w_gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w_down[e])

    return _experts(x, weights, ids, mlp)
