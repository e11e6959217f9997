"""fuse_all_reduce: a row-parallel all-reduce and the residual add (and RMSNorm) after it become one op.

Matches (tp > 1; ``shard_tp`` made the all-reduce, ``fuse_add_rms_norm`` the norm)::

    t = all_reduce(p, b)                  # t read only by the next op
    s, h = add_rms_norm(r, t, w, eps=e)   # (or add_rms_norm(t, r, ...))
    z = add(r, t)                         # (or add(t, r))

Rewrites to::

    s, h = all_reduce_add_rms_norm(p, r, w, b, eps=e, world=N)
    z = all_reduce_add(p, r, b, world=N)

With ``--tp-allreduce push`` one kernel then sums the ranks' partials as they
arrive and adds and normalises in the same pass (``peer_allreduce``); the other
choices run the all-reduce and the Triton add/RMSNorm one after the other, as
before. Requires: the all-reduce's result has no other user. Preserves: the
names of the add's (and norm's) outputs; the math, including the model-dtype
rounding of the sum, the bias and the residual add.
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _reduced(node: Node, ctx):
    """(the all_reduce node, the other input's index) when one of node's first two inputs is an
    all-reduce used only here."""
    for j in (1, 0):
        src = ctx.producing(node.ins[j])
        if src is not None and src.op == "all_reduce" and ctx.sole_user(node.ins[j]) is node \
                and node.ins[1 - j] != node.ins[j]:
            return src, 1 - j
    return None, None


def _fuse(node: Node, ctx):
    ar, other = _reduced(node, ctx)
    if ar is None:
        return None
    bias = ar.ins[1:2]
    attrs = {"world": ar.attrs["world"]} if "world" in ar.attrs else {}
    if node.op == "add":
        fused = Node("all_reduce_add", node.outs, (ar.ins[0], node.ins[other], *bias), attrs, node.loc)
    else:
        fused = Node("all_reduce_add_rms_norm", node.outs, (ar.ins[0], node.ins[other], node.ins[2], *bias),
                     {"eps": node.attrs["eps"], **attrs}, node.loc)
    return {ctx.index(ar): [], ctx.index(node): [fused]}


def run(graph: Graph, options) -> Graph:
    if getattr(options, "tp", 1) <= 1:
        return graph
    return apply_rules(graph, [("add", _fuse), ("add_rms_norm", _fuse)])[0]
