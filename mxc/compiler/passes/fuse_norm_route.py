"""fuse_norm_route: the MoE block's residual add + RMSNorm, router linear and router become one op.

Matches (``fuse_add_rms_norm`` made the first node)::

    s, h = add_rms_norm(a, b, g, eps=e)             # h may have other readers (the experts)
    l = linear(h, w_r)                               # w_r a weight; no bias, residual or prologue;
    wt, ids = route(l, k=K, scoring=S, renormalize=R, fp32_weights=F)  # l read only by the router

Rewrites to::

    s, h, wt, ids = add_rms_norm_route(a, b, g, w_r, eps=e, k=K, scoring=S, renormalize=R, fp32_weights=F)

At decode one kernel does all of it (``triton_route.add_rms_norm_route``: 3 launches fewer a MoE
layer); larger token counts run the three kernels as before. Under ``--quant fp8`` too: the router
stays in the model dtype (``quantize: false`` in the model file), which the fused kernel reads. Not
at ``--tp`` > 1: there the add + RMSNorm joins the all-reduce before it (``fuse_all_reduce``, the
push kernel), measured on its own; this fusion was measured at tp = 1.
Preserves: every output's name and the math (the router logits rounded to the model dtype, as by the
linear).
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(route: Node, ctx):
    lin = ctx.plain_linear(route.ins[0], route)
    norm = ctx.producing(lin.ins[0]) if lin is not None else None
    if norm is None or norm.op != "add_rms_norm" or norm.outs[1] != lin.ins[0]:
        return None
    attrs = {"eps": norm.attrs["eps"], "k": route.attrs["k"]}
    attrs.update({a: route.attrs[a] for a in ("scoring", "renormalize", "fp32_weights") if a in route.attrs})
    fused = Node("add_rms_norm_route", norm.outs + route.outs, (*norm.ins[:3], lin.ins[1]), attrs, route.loc)
    return {ctx.index(norm): [fused], ctx.index(lin): [], ctx.index(route): []}


def run(graph: Graph, options) -> Graph:
    if getattr(options, "tp", 1) > 1:
        return graph
    return apply_rules(graph, [("route", _match)])[0]
