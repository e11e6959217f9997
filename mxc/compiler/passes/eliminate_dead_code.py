"""eliminate_dead_code: drop nodes whose outputs nobody reads, and unused weights.

Matches: a node none of whose outputs reaches a graph output, a repeat carry
or a live node; a weight no remaining node reads. Rewrites to: nothing (the
node or weight is removed). Preserves: everything observable: the outputs and
loop-carried values. Ops have no side effects in the IR (the KV cache write of
``attention`` only matters through its output), so liveness is the whole rule.
"""

from __future__ import annotations

from mxc.ir import Graph, Node


def _sweep(nodes, live: set) -> list[Node]:
    kept = []
    for n in reversed(nodes):
        if any(o in live for o in n.outs):
            kept.append(n)
            live.update(v for v in n.ins if v is not None)
    return kept[::-1]


def run(graph: Graph, options) -> Graph:
    live = set(graph.outputs)
    items = []
    for item in reversed(graph.body):
        if isinstance(item, Node):
            items.extend(_sweep([item], live))
            continue
        live.update(item.carry.values())
        live.update(item.carry)  # the loop reads its carried values on the first iteration
        inner = set(live)  # the carried values included: one backward sweep sees every read of the body
        body = _sweep(item.body, inner)
        live |= inner
        used = {v for n in body for v in n.ins}
        items.append(item.replace(body=tuple(body), weights={k: w for k, w in item.weights.items() if k in used}))
    items.reverse()
    used = {v for it in items for n in ([it] if isinstance(it, Node) else it.body) for v in n.ins}
    return graph.replace(body=tuple(items), weights={k: w for k, w in graph.weights.items() if k in used})
