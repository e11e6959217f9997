"""merge_qkv: the q, k and v projections of one input become one linear.

Matches (from each ``attention`` node, following q, k and v back through
``heads``, ``rms_norm`` and ``rope``)::

    q0 = linear(h, wq, bq)      k0 = linear(h, wk, bk)      v0 = linear(h, wv, bv)

Rewrites to (at the place of the first projection)::

    qkv = linear(h, wqkv, bqkv)                     # wqkv: hf [q, k, v], segments [nq*d, nk*d, nk*d]
    q0, k0, v0 = split(qkv, sizes=[nq*d, nk*d, nk*d])

The merged weight declares its parts (``hf``) and row ``segments``; the loader
concatenates, and the shard spec keeps the segments so q, k and v shard
separately. Requires: one input, unquantized unmerged local weights of one
dtype, biases on all three or none. Preserves: every value name after the
split, so the rest of the graph is untouched; the math exactly.
"""

from __future__ import annotations

from mxc.compiler.passes.merge_linears import can_merge, merge
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node

# Ops that carry a projection's output towards attention, and which input holds it.
_THROUGH = {"heads": lambda n, out: 0, "rms_norm": lambda n, out: 0, "rope": lambda n, out: n.outs.index(out)}


def _trace(value, ctx) -> Node | None:
    node = ctx.producing(value)
    while node is not None and node.op in _THROUGH:
        value = node.ins[_THROUGH[node.op](node, value)]
        node = ctx.producing(value)
    return node if node is not None and node.op == "linear" else None


def _match(attn: Node, ctx):
    linears = [_trace(v, ctx) for v in attn.ins[:3]]
    if any(n is None for n in linears) or len({id(n) for n in linears}) != 3:
        return None
    if not can_merge(linears, ctx.weights):
        return None
    qkv = ctx.fresh("qkv")
    merged = merge(linears, ctx.weights, qkv)
    sizes = [ctx.weights[n.ins[1]].shape[0] for n in linears]
    split = Node("split", tuple(n.outs[0] for n in linears), (qkv,), {"sizes": sizes}, merged.loc)
    first, *rest = sorted(ctx.index(n) for n in linears)
    return {first: [merged, split], **{i: [] for i in rest}}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("attention", _match)])[0]
