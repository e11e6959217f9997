"""Shared mechanics for passes that merge sibling linears into one.

``merged_weight`` concatenates weights along dim 0 (declared, not done: the
loader reads the ``hf`` parts and ``segments``), names the result from the
parts (``wq``, ``wk``, ``wv`` -> ``wqkv``; ``w_gate``, ``w_up`` -> ``w_gate_up``)
and keeps each part's row count as a shard segment, so tensor parallelism can
split q, k and v separately. ``can_merge`` says whether linears (one input, weights that concatenate) can
merge; ``merge`` builds the merged linear and adds its weight.
"""

from __future__ import annotations

import os
from dataclasses import replace

from mxc.ir import Node, ShardSpec, Weight


def merged_name(parts: list[str]) -> str:
    prefix = os.path.commonprefix(parts)
    rest = [p[len(prefix):] for p in parts]
    return prefix + ("_".join(rest) if prefix.endswith("_") else "".join(rest))


def merged_weight(local_names: list[str], weights: dict[str, Weight]) -> tuple[str, Weight]:
    parts = [weights[n] for n in local_names]
    local = merged_name(local_names)
    first = parts[0]
    name = first.name[: len(first.name) - len(local_names[0])] + local
    rows = tuple(p.shape[0] for p in parts)
    shard = None
    if first.shard:
        exprs = tuple(e for p in parts for e in (p.shard.exprs or ("",)))
        shard = ShardSpec(first.shard.kind, rows, first.shard.unit, exprs)
    return local, replace(first, name=name, shape=(sum(rows),) + first.shape[1:],
                          hf=tuple(h for p in parts for h in p.hf), segments=rows, shard=shard)


def can_merge(linears: list[Node], weights: dict[str, Weight]) -> bool:
    """True when the linears read one input and their weights can be concatenated."""
    if len({n.ins[0] for n in linears}) != 1:
        return False
    ws = [weights.get(n.ins[1]) for n in linears]
    if any(w is None or w.quant or w.segments for w in ws):
        return False  # not a local weight, quantized, or already merged
    if len({(w.dtype, w.shape[1:], (w.shard.kind, w.shard.unit) if w.shard else None, w.quantize) for w in ws}) != 1:
        return False
    has_bias = [len(n.ins) > 2 and n.ins[2] is not None for n in linears]
    if any(has_bias) and not all(has_bias):
        return False
    return all(n.ins[2] in weights for n in linears) if all(has_bias) else True


def merge(linears: list[Node], weights: dict[str, Weight], out: str) -> Node:
    """One linear over the concatenated weight (and bias); adds them to ``weights``."""
    w_local, w = merged_weight([n.ins[1] for n in linears], weights)
    weights[w_local] = w
    ins = [linears[0].ins[0], w_local]
    if len(linears[0].ins) > 2 and linears[0].ins[2] is not None:
        b_local, b = merged_weight([n.ins[2] for n in linears], weights)
        weights[b_local] = b
        ins.append(b_local)
    return Node("linear", (out,), tuple(ins), {}, linears[0].loc)
