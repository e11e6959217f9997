"""fuse_moe: the per-expert MLPs become one fused MoE op over a merged gate/up stack.

Matches::

    y = experts(h, w, ids, we_gate, we_up, we_down)      # stacks [E, I, H], [E, I, H], [E, H, I]

Rewrites to::

    y = fused_moe(h, w, ids, we_gate_up, we_down)        # we_gate_up [E, 2I, H]: per expert, gate rows then up

The merged stack declares its parts (``hf``: gate and up, per expert ``{e}``)
and their row ``segments``, so the loader builds it expert by expert and
tensor parallelism splits gate and up separately inside each expert. A fused
kernel sorts the tokens by expert and runs grouped GEMMs (``kernels/triton_moe.py``).
Requires: unquantized local stacks of one dtype and shard kind. Preserves:
the output name; the math (the reference runs the same per-expert loop).
"""

from __future__ import annotations

from dataclasses import replace

from mxc.compiler.passes.merge_linears import merged_name
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node, ShardSpec


def _match(node: Node, ctx):
    x, w, ids, g_name, u_name, d_name = node.ins
    g, u = ctx.weights.get(g_name), ctx.weights.get(u_name)
    if g is None or u is None or g.quant or u.quant or g.segments or g.shape != u.shape or g.dtype != u.dtype:
        return None
    if (g.shard and g.shard.kind) != (u.shard and u.shard.kind):
        return None
    local = merged_name([g_name, u_name])
    rows = (g.shape[1], u.shape[1])
    full_rows = tuple(sum(p.shard.segments) if p.shard and p.shard.segments else p.shape[1] for p in (g, u))
    shard = None
    if g.shard:
        exprs = tuple(e for p in (g, u) for e in (p.shard.exprs or ("",)))
        shard = ShardSpec(g.shard.kind, full_rows, g.shard.unit, exprs)
    ctx.weights[local] = replace(g, name=g.name[: len(g.name) - len(g_name)] + local,
                                 shape=(g.shape[0], sum(rows)) + g.shape[2:], hf=g.hf + u.hf,
                                 segments=full_rows, shard=shard)
    attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel", "kernel_reason")}
    return {ctx.index(node): [Node("fused_moe", node.outs, (x, w, ids, local, d_name), attrs, node.loc)]}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("experts", _match)])[0]
