"""A small rewrite engine for local passes: rules as data.

A rule is ``(op, fn)``: for every node with that op, ``fn(node, ctx)`` returns
``None`` to decline, or a ``{node_index: [replacement nodes]}`` mapping (an
empty list deletes). ``ctx`` gives the body's nodes, the producer and users of
each value within the body, the values read beyond it (``live``: graph outputs,
loop carries, values another body or a later top-level stretch reads), and the
weights table the rule may add merged weights to. A rule that folds a value
away asks ``sole_user``: it answers only for values nothing else reads. Rules
run over the top level and every repeat body until nothing changes. Producers
left unused by a rewrite are not deleted here: ``eliminate_dead_code`` does that.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from mxc.ir import Graph, Node, Repeat, map_bodies
from mxc.ir.graph import fresh_name

Rule = tuple[str, Callable]


@dataclass
class Context:
    nodes: list[Node]
    weights: dict  # local name -> Weight (mutable: rules add merged weights)
    producer: dict[str, int]  # value -> index of the node defining it
    users: dict[str, list[int]]  # value -> indices of nodes reading it (in this body)
    taken: set[str]  # every name in the graph, for fresh names
    live: frozenset = frozenset()  # values read beyond this body: never folded away

    def sole_user(self, value: str | None) -> Node | None:
        """The one node of this body that reads ``value``, if nothing else does (here or beyond)."""
        users = self.users.get(value, []) if value is not None else []
        return self.nodes[users[0]] if len(users) == 1 and value not in self.live else None

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def producing(self, value: str | None) -> Node | None:
        i = self.producer.get(value) if value is not None else None
        return None if i is None else self.nodes[i]

    def plain_linear(self, value: str | None, reader: Node) -> Node | None:
        """The ``linear(x, w)`` making ``value`` -- ``w`` a weight; no bias, residual or prologue -- when
        ``reader`` is its only reader (so a rule may fold the linear into ``reader``), else None."""
        lin = self.producing(value)
        if lin is None or lin.op != "linear" or self.sole_user(value) is not reader:
            return None
        if len(lin.ins) > 2 or lin.attrs.get("prologue") or lin.ins[1] not in self.weights:
            return None
        return lin

    def index(self, node: Node) -> int:
        return self.nodes.index(node)


def _names(graph: Graph) -> set[str]:
    names = set(graph.inputs) | set(graph.weights)
    for n, rep in graph.nodes():
        names.update(n.outs)
        if rep is not None:
            names.update(rep.weights)
    return names


def _context(nodes, weights, taken, live=frozenset()) -> Context:
    producer, users = {}, defaultdict(list)
    for i, n in enumerate(nodes):
        for o in n.outs:
            producer[o] = i
        for v in n.ins:
            if v is not None:
                users[v].append(i)
    return Context(list(nodes), weights, producer, users, taken, live)


def _live(graph: Graph) -> frozenset:
    """Values read beyond the stretch of nodes that defines them (``map_bodies``'s stretches: each
    repeat body, and each run of top-level nodes between them): graph outputs, loop carries (both
    names), and values one stretch defines and another reads."""
    live = set(graph.outputs)
    defined_in, reads = {}, []
    stretch, after_repeat = 0, False
    for item in graph.body:
        is_repeat = isinstance(item, Repeat)
        stretch += is_repeat or after_repeat
        after_repeat = is_repeat
        if is_repeat:
            for outer, inner in item.carry.items():
                live.update((outer, inner))
        for n in item.body if is_repeat else (item,):
            defined_in.update((o, stretch) for o in n.outs)
            reads.extend((v, stretch) for v in n.ins if v is not None)
    live.update(v for v, at in reads if defined_in.get(v, at) != at)
    return frozenset(live)


def apply_rules(graph: Graph, rules: list[Rule], *, max_rounds: int = 100) -> tuple[Graph, int]:
    """Apply ``rules`` to a fixpoint. Returns the new graph and the number of rewrites."""
    count = 0
    taken = _names(graph)
    live = _live(graph)

    def run(nodes, weights):
        nonlocal count
        nodes = list(nodes)
        for _ in range(max_rounds):
            changed = False
            for op, fn in rules:
                ctx = _context(nodes, weights, taken, live)
                for node in ctx.nodes:
                    if node.op != op:
                        continue
                    edits = fn(node, ctx)
                    if edits:
                        new = []
                        for i, n in enumerate(ctx.nodes):
                            new.extend(edits.get(i, [n]))
                        nodes, changed = new, True
                        count += 1
                        break
                if changed:
                    break
            if not changed:
                return tuple(nodes), weights
        raise RuntimeError(f"rewrite rules did not converge after {max_rounds} rounds")

    return map_bodies(graph, run), count
