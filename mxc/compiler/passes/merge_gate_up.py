"""merge_gate_up: the gated MLP's gate and up projections become one linear + silu_mul.

Matches::

    g = linear(h, w_gate, b_gate)
    s = silu(g)
    u = linear(h, w_up, b_up)
    m = mul(s, u)

Rewrites to (at the place of the ``mul``)::

    gu = linear(h, w_gate_up, b_gate_up)    # hf [gate, up], segments [I, I]
    m = silu_mul(gu)                         # silu(gu[:, :I]) * gu[:, I:]

The now-unused ``g``, ``s`` and ``u`` are left for ``eliminate_dead_code``.
Requires: ``g`` and ``s`` used only here, one input, mergeable weights (see
``merge_linears``). Preserves: the name ``m``; the math exactly.
"""

from __future__ import annotations

from mxc.compiler.passes.merge_linears import can_merge, merge
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(mul: Node, ctx):
    silu = ctx.producing(mul.ins[0])
    up = ctx.producing(mul.ins[1])
    if silu is None or silu.op != "silu" or up is None or up.op != "linear":
        return None
    gate = ctx.producing(silu.ins[0])
    if gate is None or gate.op != "linear" or gate is up:
        return None
    if ctx.sole_user(gate.outs[0]) is not silu or ctx.sole_user(silu.outs[0]) is not mul:
        return None
    if not can_merge([gate, up], ctx.weights):
        return None
    gu = ctx.fresh("gate_up")
    merged = merge([gate, up], ctx.weights, gu)
    return {ctx.index(mul): [merged, Node("silu_mul", mul.outs, (gu,), {}, mul.loc)]}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("mul", _match)])[0]
