"""shard_tp: split the graph across ``options.tp`` tensor-parallel ranks (identity at tp=1).

Every weight with a shard spec gets its per-rank shape (``ir/sharding.py``:
merged parts split separately, whole heads, KV heads replicated when there
are fewer than ranks, a vocabulary padded to a multiple of the ranks); the
spec keeps the global segment sizes for the loader.
Then the communication becomes explicit nodes.

Matches / rewrites to::

    y = linear(x, w_row, b)          ->  y_part = linear(x, w_row)          # row-parallel: partial sums
                                         y = all_reduce(y_part, b)
    y = linear(x, w_vocab)           ->  y_part = linear(x, w_vocab)        # vocab-parallel logits
                                         y = all_gather(y_part, world=tp)   # (size=vocab: padded)
    y = embedding(ids, t_vocab)      ->  y_part = vocab_embedding(ids, t_vocab)
                                         y = all_reduce(y_part)
    a, b, c = split(qkv, sizes=S)    ->  a, b, c = split(qkv, sizes=S/tp)   # after a column-parallel merged linear
    y = rms_norm(q, w_full)          ->  q_all = all_gather(q, world=tp)    # a norm over every head (OLMoE's q/k):
                                         y_all = rms_norm(q_all, w_full)    # the whole row on every rank, then
                                         y = rank_slice(y_all, world=tp)    # this rank's heads again
    y = fused_moe(x, ..., we_down)   ->  y_part = fused_moe(x, ..., we_down)  # (or experts) down rows split:
                                         y = all_reduce(y_part)             # partial sums per rank

Column-parallel linears need no communication: their outputs feed per-head
ops (attention) or elementwise ops (silu_mul) that stay local, but for a norm
over the whole projection (gathered, as vLLM's OLMoE does). Requires: runs
after the merge passes (segments exist) and before fuse_rope_cache (which
reads head counts from split sizes). Preserves: every value name, so the
outputs are the same; the math up to the order of the all-reduce sums.
A split that cannot work fails naming the weight, the model-file size
expression and the numbers; so does a ``split`` or ``silu_mul`` of a
column-parallel weight sharded as one part (a checkpoint's fused qkv or
gate/up declared without ``parts``: each rank would hold the wrong rows).
"""

from __future__ import annotations

from dataclasses import replace

from mxc.compiler.rewrite import apply_rules
from mxc.errors import MxcError
from mxc.ir import Graph, Node, Repeat, ShardSpec, VerifyError, Weight, verify
from mxc.ir.sharding import ShardError, local_size, replicated_parts


def _shard_weight(w: Weight, tp: int) -> Weight:
    spec = w.shard
    if spec is None or spec.kind == "replicated":
        return w
    size = w.shape[w.shard_dim]
    try:
        local, parts = local_size(spec, size, tp)
    except ShardError as e:
        raise MxcError(f"cannot shard weight {w.name} ({spec.kind}) across --tp {tp}: {e}") from None
    copied = replicated_parts(spec, size, tp) if spec.kind == "row" and not w.scale_of else []
    if copied:  # partial sums of copies would be added tp / units times by the all-reduce
        raise MxcError(f"cannot shard weight {w.name} ({spec.kind}) across --tp {tp}: {copied[0]}, fewer than the "
                       f"ranks; use a --tp that the parts divide into")
    shape = list(w.shape)
    shape[w.shard_dim] = local
    return replace(w, shape=tuple(shape), shard=replace(spec, segments=spec.segments or (size,)))


def _local_parts(w: Weight, tp: int) -> list[int]:
    return list(local_size(ShardSpec(w.shard.kind, w.shard.segments, w.shard.unit), sum(w.shard.segments), tp)[1])


def _rules(tp: int, target: str):
    def kind(ctx, name):
        w = ctx.weights.get(name)
        return w.shard.kind if w is not None and w.shard else None

    def linear(node: Node, ctx):
        users = [ctx.nodes[i].op for i in ctx.users[node.outs[0]]]
        if users in (["all_reduce"], ["all_gather"]):
            return None  # already rewritten
        k = kind(ctx, node.ins[1])
        if k == "row":
            part = ctx.fresh(f"{node.outs[0]}_part")
            bias = node.ins[2:3]
            return {ctx.index(node): [node.replace(outs=(part,), ins=node.ins[:2]),
                                      Node("all_reduce", node.outs, (part, *bias), {"world": tp}, node.loc)]}
        if k == "vocab":
            part = ctx.fresh(f"{node.outs[0]}_part")
            w = ctx.weights[node.ins[1]]
            vocab = sum(w.shard.segments)
            attrs = {"world": tp} if w.shape[0] * tp == vocab else {"world": tp, "size": vocab}  # padded: drop the pad
            return {ctx.index(node): [node.replace(outs=(part,)),
                                      Node("all_gather", node.outs, (part,), attrs, node.loc)]}
        return None

    def moe(node: Node, ctx):  # experts' down projections are row-parallel: partial sums per rank
        users = [ctx.nodes[i].op for i in ctx.users[node.outs[0]]]
        w_down = node.ins[5 if node.op == "experts" else 4]  # not ins[-1]: fused_moe may carry scales, a residual
        if users == ["all_reduce"] or kind(ctx, w_down) != "row":
            return None
        part = ctx.fresh(f"{node.outs[0]}_part")
        return {ctx.index(node): [node.replace(outs=(part,)), Node("all_reduce", node.outs, (part,), {"world": tp}, node.loc)]}

    def embedding(node: Node, ctx):
        if kind(ctx, node.ins[1]) != "vocab":
            return None
        part = ctx.fresh(f"{node.outs[0]}_part")
        return {ctx.index(node): [Node("vocab_embedding", (part,), node.ins, {}, node.loc),
                                  Node("all_reduce", node.outs, (part,), {"world": tp}, node.loc)]}

    def one_part(node: Node, ctx, parts: str):
        """A split or silu_mul of a column-parallel linear whose weight is one part: each rank would hold a
        contiguous slice of the rows (all of the gate, none of the up), so the parts it takes apart would mix."""
        src = ctx.producing(node.ins[0])
        if src is None or src.op != "linear" or kind(ctx, src.ins[1]) != "column":
            return None
        w = ctx.weights[src.ins[1]]
        if len(w.shard.segments) > 1:
            return None
        raise MxcError(f"--tp {tp}: the {node.op} at {node.loc} takes apart {w.name}'s rows ({parts}), but its "
                       f"shard spec splits them as one part, so each rank's rows would mix the parts; declare them: "
                       f"shard: {{kind: column, parts: [...]}} (or leave the weight and its consumers unsharded)")

    def split(node: Node, ctx):
        src = ctx.producing(node.ins[0])
        if src is None or src.op != "linear" or kind(ctx, src.ins[1]) != "column":
            return None
        w = ctx.weights[src.ins[1]]
        if list(node.attrs["sizes"]) != list(w.shard.segments):
            if sum(node.attrs["sizes"]) == sum(w.shard.segments):
                one_part(node, ctx, f"sizes {list(node.attrs['sizes'])}")
            return None  # already local (segments are global sizes)
        return {ctx.index(node): [node.replace(attrs={**node.attrs, "sizes": _local_parts(w, tp)})]}

    def silu_mul(node: Node, ctx):
        return one_part(node, ctx, "gate, then up")

    def rms_norm(node: Node, ctx):  # a norm over a whole column-parallel projection needs every rank's columns
        w = ctx.weights.get(node.ins[1])
        if w is None or kind(ctx, node.ins[1]) not in (None, "replicated"):
            return None
        src, part = ctx.producing(node.ins[0]), 0
        if src is not None and src.op == "split":  # q or k of a merged qkv
            part, src = src.outs.index(node.ins[0]), ctx.producing(src.ins[0])
        if src is None or src.op != "linear" or kind(ctx, src.ins[1]) != "column":
            return None
        local = _local_parts(ctx.weights[src.ins[1]], tp)[part]
        where = f"--tp {tp}: the rms_norm at {node.loc} normalizes {node.ins[0]} over all {w.shape[-1]} columns"
        if local * tp != w.shape[-1]:  # replicated heads (fewer than ranks): the gathered copies would repeat
            raise MxcError(f"{where}, and its heads are fewer than the ranks (each rank holds {local} columns, "
                           f"copied on others); build with a --tp that divides its heads")
        if target != "cpu":  # the CUDA attention takes q and k from the qkv projection, normed inside
            raise MxcError(f"{where}: gathered across ranks, which the {target} attention kernels do not take yet; "
                           f"build with --tp 1, or --target cpu")
        full, normed = ctx.fresh(f"{node.ins[0]}_all"), ctx.fresh(f"{node.outs[0]}_all")
        return {ctx.index(node): [Node("all_gather", (full,), node.ins[:1], {"world": tp}, node.loc),
                                  node.replace(ins=(full, *node.ins[1:]), outs=(normed,)),
                                  Node("rank_slice", node.outs, (normed,), {"world": tp}, node.loc)]}

    return [("linear", linear), ("embedding", embedding), ("split", split), ("silu_mul", silu_mul),
            ("experts", moe), ("fused_moe", moe), ("rms_norm", rms_norm)]


def run(graph: Graph, options) -> Graph:
    tp = options.tp
    if tp == 1:
        return graph
    weights = {k: _shard_weight(w, tp) for k, w in graph.weights.items()}
    body = tuple(item.replace(weights={k: _shard_weight(w, tp) for k, w in item.weights.items()})
                 if isinstance(item, Repeat) else item for item in graph.body)
    graph = apply_rules(graph.replace(weights=weights, body=body), _rules(tp, options.target))[0]
    try:
        verify(graph)
    except VerifyError as e:  # a model-file op over a whole dimension that the ranks now split
        raise MxcError(f"--tp {tp}: this model cannot be split as its definition stands: {e}") from None
    return graph
