"""early_launch_o_proj: at one token, the decode attention lets the o projection's GEMV launch early.

Matches (CUDA target with PDL)::

    a = cached_attention(q, ...)
    t = flatten_heads(a)
    y = qlinear(t, w, s, ..., granularity=G)    # w [N, K] e4m3, a weight whose one-token GEMV preloads

where ``triton_fp8_gemv.preloads(N, K, dtype, G)``: that GEMV loads its whole weight tiles before its
PDL wait. Rewrites to the same attention node with ``early_dependents=True``: at one sequence its last
kernel (the split-KV merge, or the split kernel when one split writes the output) lets the GEMV launch
before it waits, so the GEMV's weights stream while the attention runs (``pdl.pdl_enter_early``; measured
in ``triton_fp8_gemv``'s ``PRELOAD_MAX_BYTES`` comment). A GEMV that does not preload gains nothing from an early launch, so
other attentions keep their plain launch order.
Preserves: the graph's structure and math; only adds an attribute (a launch order, not a result).
"""

from __future__ import annotations

import torch

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(attn: Node, ctx, dtype: torch.dtype):
    if attn.attrs.get("early_dependents"):
        return None
    flat = ctx.sole_user(attn.outs[0])
    lin = ctx.sole_user(flat.outs[0]) if flat is not None and flat.op == "flatten_heads" else None
    if lin is None or lin.op != "qlinear" or lin.ins[0] != flat.outs[0] or lin.ins[1] not in ctx.weights:
        return None
    from mxc.kernels.triton_fp8_gemv import preloads

    n, k = ctx.weights[lin.ins[1]].shape
    if not preloads(n, k, dtype, lin.attrs["granularity"]):
        return None
    return {ctx.index(attn): [attn.replace(attrs={**attn.attrs, "early_dependents": True})]}


def run(graph: Graph, options) -> Graph:
    if options.target != "cuda" or not options.pdl:
        return graph
    dtype = getattr(torch, options.dtype)
    return apply_rules(graph, [("cached_attention", lambda n, ctx: _match(n, ctx, dtype))])[0]
