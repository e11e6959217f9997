"""The verifier: every value defined once before use, every op's rule holds.

``verify(graph)`` walks the graph in program order, applies each op's rule
(``ir/ops.py``) to the types of its inputs, checks repeat carries keep their
type and weight names are unique, and returns the type of every value. It
raises ``VerifyError`` naming the node, its source location and the rule that
failed. Tests run it after every pass.
"""

from __future__ import annotations

from mxc.ir.graph import Graph, Node, TensorType
from mxc.ir.ops import OPS, RuleError, infer


class VerifyError(ValueError):
    pass


def _wtype(w) -> TensorType:
    return TensorType(w.shape, w.dtype)


def verify(graph: Graph) -> dict[str, TensorType]:
    types: dict[str, TensorType] = dict(graph.inputs)
    top_w = {k: _wtype(w) for k, w in graph.weights.items()}
    _check_weight_names(graph)
    for item in graph.body:
        if isinstance(item, Node):
            _node(item, types, top_w)
            continue
        local = {**top_w, **{k: _wtype(w) for k, w in item.weights.items()}}
        clash = set(item.weights) & set(top_w)
        if clash:
            raise VerifyError(f"{item.loc}: repeat weight(s) {sorted(clash)} shadow top-level weights")
        for n in item.body:
            _node(n, types, local)
        for outer, inner in item.carry.items():
            if outer not in types or inner not in types:
                raise VerifyError(f"{item.loc}: carry {outer} <- {inner} names an undefined value")
            if types[outer] != types[inner]:
                raise VerifyError(f"{item.loc}: carry {outer} {types[outer]} <- {inner} {types[inner]} changes type")
    for o in graph.outputs:
        if o not in types:
            raise VerifyError(f"output {o!r} is not defined")
    return types


def _node(n: Node, types: dict, weights: dict) -> None:
    where = f"{n.loc or '?'}: {n.op} -> {', '.join(n.outs)}"
    if n.op not in OPS:
        raise VerifyError(f"{where}: unknown op {n.op!r}")
    in_types = []
    for name in n.ins:
        if name is None:
            in_types.append(None)
        elif name in types:
            in_types.append(types[name])
        elif name in weights:
            in_types.append(weights[name])
        else:
            raise VerifyError(f"{where}: input {name!r} is not defined")
    try:
        outs = infer(n.op, in_types, n.attrs)
    except (RuleError, TypeError, KeyError) as e:
        raise VerifyError(f"{where}: {e}") from None
    except (ValueError, IndexError, AttributeError, ArithmeticError) as e:  # a rule reading inputs of another form
        got = ", ".join("none" if t is None else str(t) for t in in_types)
        raise VerifyError(f"{where}: inputs ({got}) do not have the form the op takes "
                          f"({type(e).__name__}: {e})") from None
    if len(outs) != len(n.outs):
        raise VerifyError(f"{where}: op gives {len(outs)} outputs, node names {len(n.outs)}")
    for name, t in zip(n.outs, outs):
        if name in types or name in weights:
            raise VerifyError(f"{where}: {name!r} is defined twice")
        types[name] = t


def _check_weight_names(graph: Graph) -> None:
    seen: dict[str, str] = {}
    for w in graph.all_weights():
        if w.name in seen:
            raise VerifyError(f"two weights are stored as {w.name!r}")
        seen[w.name] = w.name
        dim = 1 if w.stack else 0  # checkpoint parts concatenate along it (per expert for a stack)
        rows = w.shape[dim]
        if w.shard and w.shard.segments and w.shard_dim == dim:
            rows = sum(w.shard.segments)
        if w.segments and sum(w.segments) != rows and not w.scale_of:  # a scale's parts follow its weight's rows
            raise VerifyError(f"weight {w.name}: segments {list(w.segments)} do not add up to {rows} rows")
        if len(w.hf) > 1 and len(w.segments) != len(w.hf):
            raise VerifyError(f"weight {w.name}: {len(w.hf)} sources but {len(w.segments)} segments")
        if w.interleave and (w.stack or w.interleave < 0 or w.shape[0] % (2 * w.interleave)):
            raise VerifyError(f"weight {w.name}: interleave {w.interleave} needs a (not stacked) [gate; up] weight "
                              f"of whole blocks, {2 * w.interleave} rows each, got {w.shape[0]} rows a rank")
