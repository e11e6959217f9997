"""The IR's serialized form: Graph <-> YAML text (``graph.yaml``, ``--dump-ir``).

The dump is the model-file syntax with everything resolved: literal shapes,
literal attributes (including each node's chosen kernel), SSA names, explicit
carries, and a comment with each value's type and the model-file line it came
from. ``load_graph(dump_graph(g)) == g`` (tested).
"""

from __future__ import annotations

import ast
import json

import yaml

from mxc.ir.graph import Graph, Node, QuantSpec, Repeat, ShardSpec, Sym, TensorType, Weight
from mxc.ir.statements import format_statement, parse_statement
from mxc.ir.verify import verify


def _weight_dict(w: Weight) -> dict:
    d = {"name": w.name, "shape": list(w.shape), "dtype": w.dtype, "hf": list(w.hf)}
    if w.segments:
        d["segments"] = list(w.segments)
    if w.init != "normal":
        d["init"] = w.init
    if w.stack:
        d["stack"] = w.stack
    if w.shard:
        d["shard"] = {"kind": w.shard.kind, **({"segments": list(w.shard.segments)} if w.shard.segments else {}),
                      **({"unit": w.shard.unit} if w.shard.unit != 1 else {}),
                      **({"exprs": list(w.shard.exprs)} if w.shard.exprs else {})}
    if w.quant:
        d["quant"] = {"scheme": w.quant.scheme, "granularity": w.quant.granularity,
                      **({"prequantized": True} if w.quant.prequantized else {})}
    if w.scale_of:
        d["scale_of"] = w.scale_of
    if not w.quantize:
        d["quantize"] = False
    if w.interleave:
        d["interleave"] = w.interleave
    return d


def _scalar(text: str) -> str:
    """``text`` as a YAML scalar: plain when it reads back unchanged, else double-quoted."""
    try:
        plain_ok = "#" not in text and yaml.safe_load(text) == text
    except yaml.YAMLError:
        plain_ok = False
    return text if plain_ok else json.dumps(text)


def _flow(obj) -> str:
    return yaml.safe_dump(obj, default_flow_style=True, sort_keys=False, width=10_000).strip()


def dump_graph(graph: Graph, *, comments: bool = True) -> str:
    try:
        types = verify(graph) if comments else {}
    except ValueError:
        types = {}
    lines = [f"family: {graph.family}", f"source: {graph.source}", f"dtype: {graph.dtype}",
             f"config: {_flow(graph.config)}", "inputs:"]
    lines += [f"  {k}: {_flow({'shape': list(t.shape), 'dtype': t.dtype})}" for k, t in graph.inputs.items()]
    lines += ["weights:"] + [f"  {k}: {_flow(_weight_dict(w))}" for k, w in graph.weights.items()]
    lines += [f"ignore: {_flow(list(graph.ignore))}"]
    if graph.tied:  # absent from untied graphs' dumps
        lines += [f"tied: {_flow([list(t) for t in graph.tied])}"]
    lines += ["graph:"]

    def stmt(n: Node, indent: str) -> str:
        text = format_statement(n.outs, n.op, n.ins, n.attrs)
        note = ", ".join(str(types[o]) for o in n.outs if o in types)
        comment = f"  # {note}  <- {n.loc}" if comments and (note or n.loc) else ""
        return f"{indent}- {_scalar(text)}{comment}"

    for item in graph.body:
        if isinstance(item, Node):
            lines.append(stmt(item, "  "))
            continue
        head = {"count": item.count, "index": item.index, "carry": item.carry, "loc": item.loc}
        lines += [f"  - repeat: {_flow(head)}", "    weights:"]
        lines += [f"      {k}: {_flow(_weight_dict(w))}" for k, w in item.weights.items()]
        lines += ["    body:"] + [stmt(n, "      ") for n in item.body]
    lines.append(f"outputs: {_flow(list(graph.outputs))}")
    return "\n".join(lines) + "\n"


def _weight(d: dict) -> Weight:
    shard = d.get("shard")
    quant = d.get("quant")
    return Weight(name=d["name"], shape=tuple(d["shape"]), dtype=d["dtype"], hf=tuple(d["hf"]),
                  segments=tuple(d.get("segments", ())), init=d.get("init", "normal"), stack=d.get("stack"),
                  shard=ShardSpec(shard["kind"], tuple(shard.get("segments", ())), shard.get("unit", 1),
                                  tuple(shard.get("exprs", ()))) if shard else None,
                  quant=QuantSpec(quant["scheme"], quant["granularity"], quant.get("prequantized", False))
                  if quant else None, scale_of=d.get("scale_of"), quantize=d.get("quantize", True),
                  interleave=d.get("interleave", 0))


def _node(text: str, loc: str, index: str | None) -> Node:
    outs, call = parse_statement(text)
    attrs = {}
    for k, v in call.kwargs.items():
        if isinstance(v, ast.Name) and v.id == index:
            attrs[k] = Sym(index)
        else:
            attrs[k] = ast.literal_eval(v)
    return Node(call.op, tuple(outs), tuple(call.args), attrs, loc)


def _loc_of(raw_line: str) -> str:
    return raw_line.rsplit("<- ", 1)[1].strip() if "<- " in raw_line else ""


def load_graph(text: str) -> Graph:
    data = yaml.safe_load(text)
    # Source locations live in comments; recover them line by line.
    stmt_lines = [ln for ln in text.splitlines() if ln.lstrip().startswith("- ") and " = " in ln]
    locs = iter(_loc_of(ln) for ln in stmt_lines)
    body = []
    for item in data["graph"]:
        if isinstance(item, str):
            body.append(_node(item, next(locs), None))
            continue
        head = item["repeat"]
        nodes = tuple(_node(s, next(locs), head["index"]) for s in item["body"])
        body.append(Repeat(count=head["count"], index=head["index"],
                           weights={k: _weight(w) for k, w in (item.get("weights") or {}).items()},
                           body=nodes, carry=dict(head["carry"]), loc=head.get("loc", "")))
    return Graph(family=data["family"], dtype=data["dtype"], config=data["config"],
                 inputs={k: TensorType(tuple(v["shape"]), v["dtype"]) for k, v in data["inputs"].items()},
                 weights={k: _weight(w) for k, w in (data.get("weights") or {}).items()},
                 body=tuple(body), outputs=tuple(data["outputs"]), ignore=tuple(data.get("ignore") or ()),
                 source=data.get("source", ""), tied=tuple(tuple(t) for t in data.get("tied") or ()))
