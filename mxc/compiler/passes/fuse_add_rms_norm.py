"""fuse_add_rms_norm: a residual add followed by an RMSNorm of its result becomes one op.

Matches::

    s = add(x, y)
    h = rms_norm(s, w, eps=e)          # anywhere later in the same body

Rewrites to (at the place of the ``add``)::

    s, h = add_rms_norm(x, y, w, eps=e)

``s`` keeps its other users (the next residual add). Requires: the norm's
weight is a weight (not a computed value), so it exists at the add. Preserves:
both names and the math: the sum is rounded to the model dtype before it is
normalised, as in the unfused graph.
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(add: Node, ctx):
    norms = [ctx.nodes[i] for i in ctx.users[add.outs[0]] if ctx.nodes[i].op == "rms_norm"
             and ctx.nodes[i].ins[0] == add.outs[0]]
    if not norms:
        return None
    norm = norms[0]
    if norm.ins[1] not in ctx.weights:
        return None
    fused = Node("add_rms_norm", (add.outs[0], norm.outs[0]), (add.ins[0], add.ins[1], norm.ins[1]),
                 {"eps": norm.attrs["eps"]}, add.loc)
    return {ctx.index(add): [fused], ctx.index(norm): []}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("add", _match)])[0]
