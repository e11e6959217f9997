"""Binding a model file to a configuration: YAML template -> concrete Graph.

A model file declares ``params`` (read from the checkpoint's config, with
defaults as expressions over earlier params), ``checks`` (conditions over the
params that the config must meet: a failed one names the config file, its
fields and their values), ``inputs``, ``weights`` (shape
expressions, HF names, optional ``when`` conditions, ``tied_to``), a ``graph``
of statements with ``repeat`` and ``when`` blocks, and ``outputs``. Binding
evaluates every expression, drops disabled weights and blocks, unrolls nested
calls into named values and renames to SSA (a rebound name gets a fresh
value; rebinding an outer name inside a repeat makes it loop-carried).
Every error names the file, the line and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from mxc.errors import ConfigError, MxcError
from mxc.ir.expr import ExprError, evaluate, names_read
from mxc.ir.graph import Graph, Node, Repeat, ShardSpec, Sym, TensorType, Weight, fresh_name
from mxc.ir.ops import COMPILER_OPS, OPS, n_outputs
from mxc.ir.statements import Call, StatementError, parse_statement
from mxc.ir.yaml_source import LDict, SourceError, load_yaml

TOP_KEYS = {"family", "doc", "params", "checks", "inputs", "weights", "ignore", "graph", "outputs", "tiny_config"}
CHECK_KEYS = {"require", "says", "when"}  # when: optional
WEIGHT_KEYS = {"shape", "hf", "shard", "when", "tied_to", "tied_if", "init", "stack", "quantize"}
PARAM_KEYS = {"default", "resolve", "doc", "one_of", "type", "min"}
PARAM_TYPES = {"int": "an integer", "number": "a number", "bool": "true or false"}
DTYPES = ("float32", "bfloat16", "float16")

Resolver = Callable[[dict, dict], Any]  # (hf config, params so far) -> value


def read_model_file(path: Path | str) -> LDict:
    data = load_yaml(path)
    err = SourceError(path)
    if not isinstance(data, dict):
        raise err(1, "top level", "expected a mapping with family, params, inputs, weights, graph, outputs")
    for key in data:
        if key not in TOP_KEYS:
            raise err(data.key_line(key), key, f"unknown section; expected one of {', '.join(sorted(TOP_KEYS))}")
    for key in ("family", "params", "inputs", "weights", "graph", "outputs"):
        if key not in data:
            raise err(data.line, key, "missing required section")
    return data


def bind(path: Path | str, config: dict, *, dtype: str, overrides: dict | None = None,
         resolvers: dict[str, Resolver] | None = None, config_path: str = "config.json",
         read_as: dict[str, str] | None = None) -> Graph:
    """Bind the model file at ``path`` to ``config`` (an HF config dict, read from ``config_path``: errors name it).
    ``read_as``: override -> the config field it copies (the registry's ``attention_window: sliding_window``), so
    that errors about its value name that field."""
    data = read_model_file(path)
    return _Binder(Path(path), data, config, dtype, overrides or {}, resolvers or {}, config_path, read_as).run()


def _default_kind(default) -> str | None:
    """The type a config value must have when the model file's default is a literal (``_check_declared``'s kinds):
    ``"no"`` for a boolean would otherwise read as true (a tied LM head dropped, silently). A default written as
    ``1e-6`` is a string to YAML: a numeric literal counts as a number."""
    if isinstance(default, str):
        try:
            default = float(default)
        except ValueError:
            return None
    if isinstance(default, bool):
        return "bool"
    return "number" if isinstance(default, (int, float)) else None


def _check_declared(where: str, name: str, value, kind: str | None, low) -> None:
    """A param's ``type:`` (int, number, bool) and ``min:``, whatever set its value; the error names the field."""
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": lambda v: isinstance(v, bool), None: lambda v: True}[kind]
    if not ok(value) or (low is not None and value < low):
        want = PARAM_TYPES.get(kind, "a value") + (f" >= {low}" if low is not None else "")
        raise MxcError(f"{where}: field {name} = {value!r}: expected {want}")


class _MissingParam(Exception):
    """A resolver read a param the model file does not declare before it."""


class _ParamsSoFar(dict):
    """The params a resolver sees: reading one not declared yet raises ``_MissingParam``, not a KeyError from
    somewhere inside the resolver."""

    def __missing__(self, key):
        raise _MissingParam(key)


class _Binder:
    def __init__(self, path, data, config, dtype, overrides, resolvers, config_path="config.json", read_as=None):
        self.path, self.data, self.config, self.config_path = path, data, config, config_path
        self.err = SourceError(path.name)
        self.dtype, self.overrides, self.resolvers = dtype, overrides, resolvers
        self.used_names: set[str] = set()
        self.aliases: dict[str, str] = {}  # tied weight -> the weight it reuses
        self.ties: list[tuple[str, str, str]] = []  # Graph.tied
        self.disabled: set[str] = set()  # weights whose `when` is false
        # param -> the config field it took its value from, by a bare-name default or override
        self.read_as: dict[str, str] = dict(read_as or {})

    # --- helpers --------------------------------------------------------------
    def eval(self, expr, env, line, field):
        try:
            return evaluate(expr, env)
        except (ExprError, TypeError, ZeroDivisionError) as e:
            raise self.err(line, field, str(e)) from None

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.used_names)

    # --- sections -------------------------------------------------------------
    def run(self) -> Graph:
        d = self.data
        if self.dtype not in DTYPES:
            raise self.err(0, "dtype", f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.params = self.resolve_params(d["params"])
        self.check_config(d.get("checks", []))
        inputs = self.read_inputs(d["inputs"], d.key_line("inputs"))
        self.used_names.update(inputs)
        weights = self.read_weights(d["weights"], self.params, prefix="", hf_prefix="", where="weights")
        self.top_weights = weights
        scope = {name: name for name in inputs}
        body = self.block(d["graph"], scope, self.params, weights, "graph")
        outs = d["outputs"]
        if not isinstance(outs, list) or not outs:
            raise self.err(d.key_line("outputs"), "outputs", "expected a non-empty list of value names")
        outputs = []
        for o in outs:
            if o not in scope:
                raise self.err(getattr(o, "line", 0), "outputs", f"{o!r} is not a value defined in the graph")
            outputs.append(scope[o])
        if not isinstance(d.get("ignore", []), list):
            raise self.err(d.key_line("ignore"), "ignore", "expected a list of checkpoint names ({i}: any layer)")
        ignore = [str(x) for x in d.get("ignore", [])]
        ignore += [self.tied_hf[w] for w in self.aliases]
        graph = Graph(family=str(d["family"]), dtype=self.dtype, config=self.params, inputs=inputs,
                      weights=weights, body=tuple(body), outputs=tuple(outputs), ignore=tuple(ignore),
                      source=self.path.name, tied=tuple(self.ties))
        self.check_used(graph)
        return graph

    def check_used(self, graph: Graph) -> None:
        """Every statement's result is read by a later statement, carried to the next layer or an output: one
        that is not is a mistake (a misspelt name below it), which the compiler would otherwise drop silently,
        and with it, say, the attention and its KV cache."""
        used = set(graph.outputs).union(*(r.carry.values() for r in graph.repeats()))
        used.update(i for n, _ in graph.nodes() for i in n.ins if i is not None)
        for n, _ in graph.nodes():
            if not used.intersection(n.outs):
                raise self.err(int(n.loc.rpartition(":")[2] or 0), "graph",
                               f"{n.op} computes {', '.join(n.outs)}, which nothing below reads (not an input of a "
                               f"later statement, a value carried to the next layer or an output)")

    def resolve_params(self, spec) -> dict:
        if not isinstance(spec, dict):
            raise self.err(self.data.key_line("params"), "params", "expected a mapping name -> {default: expr}")
        params: dict[str, Any] = {}
        for name, p in spec.items():
            line = spec.key_line(name)
            p = p or {}
            if not isinstance(p, dict) or set(p) - PARAM_KEYS:
                raise self.err(line, f"params.{name}", f"expected a mapping with keys among {sorted(PARAM_KEYS)}")
            if name in self.overrides:
                params[name] = self.overrides[name]
            elif "resolve" in p:
                fn = self.resolvers.get(p["resolve"]) if isinstance(p["resolve"], str) else None
                if fn is None:
                    raise self.err(line, f"params.{name}.resolve", f"unknown resolver {p['resolve']!r}; known: "
                                   f"{', '.join(sorted(self.resolvers)) or 'none'}")
                try:
                    params[name] = fn(self.config, _ParamsSoFar(params))
                except ConfigError as e:  # about a config field: name the file it was read from
                    raise e.at(self.config_path) from None
                except _MissingParam as e:
                    raise self.err(line, f"params.{name}.resolve", f"resolver {p['resolve']!r} needs the param "
                                   f"{e.args[0]!r}, declared above this one") from None
            elif self.config.get(name) is not None:
                params[name] = self.config[name]
                _check_declared(self.config_path, name, params[name], _default_kind(p.get("default")), None)
            elif "default" in p:
                params[name] = self.eval(p["default"], params, line, f"params.{name}.default")
                source = str(p["default"]).strip()
                if source in params and (source in self.read_as or self.config.get(source) is not None):
                    self.read_as[name] = self.read_as.get(source, source)  # e.g. Mixtral's intermediate_size
            elif name in self.config:  # `"intermediate_size": null`: present, but no value
                want = PARAM_TYPES.get(p.get("type"), "a value") + (f" >= {p['min']}" if "min" in p else "")
                raise MxcError(f"{self.config_path}: field {name} is null: expected {want} ({self.path.name} gives "
                               f"no default)")
            else:
                raise self.err(line, f"params.{name}",
                               f"{self.config_path} has no field {name!r} and the model file gives no default")
            if p.get("type") not in (None, *PARAM_TYPES):
                raise self.err(line, f"params.{name}.type", f"expected one of {sorted(PARAM_TYPES)}")
            if "min" in p and (isinstance(p["min"], bool) or not isinstance(p["min"], (int, float))):
                raise self.err(line, f"params.{name}.min", f"expected a number, got {p['min']!r}")
            nullable = "default" in p and p["default"] is None  # `default: null`: absent is a value too
            if ("type" in p or "min" in p) and not (nullable and params[name] is None):
                copied = name in self.overrides and name in self.read_as  # a config field under another name
                from_config = copied or (name not in self.overrides and "resolve" not in p
                                         and self.config.get(name) is not None)
                where = self.config_path if from_config else f"{self.path.name} (params.{name}, from {self.config_path})"
                _check_declared(where, self.read_as[name] if copied else name, params[name], p.get("type"),
                                p.get("min"))
            if "one_of" in p and not isinstance(p["one_of"], list):
                raise self.err(line, f"params.{name}.one_of", "expected a list of the values the graph computes")
            if "one_of" in p and params[name] not in p["one_of"]:  # values the graph does not compute are refused
                raise MxcError(f"{self.config_path}: field {name} = {params[name]!r}: {self.path.name} supports "
                               f"{' or '.join(map(repr, p['one_of']))} only")
        return params

    def check_config(self, spec) -> None:
        """The model file's ``checks``: each ``require`` condition over the params must hold (where its ``when``
        does), else the error names the config file, the params the condition reads with their values (under the
        config field's name where a param copies one), ``says`` and the check's line. They
        catch what the bound graph would refuse later in its own terms (``attention -> a: 5 query heads ...``)."""
        if not isinstance(spec, list):
            raise self.err(self.data.key_line("checks"), "checks",
                           "expected a list of {require: condition over params, says: what it requires}")
        for i, check in enumerate(spec):
            line, field = getattr(check, "line", 0) or getattr(spec, "line", 0), f"checks[{i}]"
            if (not isinstance(check, dict) or not {"require", "says"} <= set(check) <= CHECK_KEYS
                    or not isinstance(check["says"], str)):
                raise self.err(line, field, "expected {require: condition over params, says: what it requires} "
                                            "and optionally when: condition")
            if "when" in check and not self.eval(check["when"], self.params, line, f"{field}.when"):
                continue
            if self.eval(check["require"], self.params, line, f"{field}.require"):
                continue
            shown = ", ".join(f"{self.read_as.get(n, n)} = {self.params[n]!r}"
                              for n in names_read(check["require"]) if n in self.params)
            raise MxcError(f"{self.config_path}: {shown + ': ' if shown else ''}{check['says']} "
                           f"({self.path.name}:{line}, checks)")

    def read_inputs(self, spec, line: int) -> dict[str, TensorType]:
        if not isinstance(spec, dict):
            raise self.err(line, "inputs", "expected a mapping name -> {shape: [...], dtype: ...}")
        out = {}
        for name, t in spec.items():
            if not isinstance(t, dict) or not isinstance(t.get("shape"), list):
                raise self.err(spec.key_line(name), f"inputs.{name}", "expected {shape: [...], dtype: ...}")
            out[str(name)] = TensorType(tuple(str(s) if isinstance(s, str) else s for s in t["shape"]), str(t.get("dtype", self.dtype)))
        return out

    def read_weights(self, spec, env, prefix, hf_prefix, where) -> dict[str, Weight]:
        if not isinstance(spec, dict):
            raise self.err(getattr(spec, "line", 0), where, "expected a mapping name -> {shape, hf, ...}")
        self.tied_hf = getattr(self, "tied_hf", {})
        out = {}
        for name, w in spec.items():
            line, field = spec.key_line(name), f"{where}.{name}"
            if not isinstance(w, dict):
                raise self.err(line, field, "expected a mapping with shape and hf")
            unknown = set(w) - WEIGHT_KEYS
            if unknown:
                raise self.err(line, field, f"unknown key(s) {sorted(unknown)}; expected among {sorted(WEIGHT_KEYS)}")
            for key in ("shape", "hf"):
                if key not in w:
                    raise self.err(line, field, f"missing {key!r}")
            if "when" in w and not self.eval(w["when"], env, line, f"{field}.when"):
                self.disabled.add(name)
                continue
            shape = self.eval_shape(w["shape"], env, line, f"{field}.shape")
            shard = self.shard_spec(w.get("shard"), w["shape"][1:] if "stack" in w else w["shape"], env, line,
                                    f"{field}.shard", shape[1:] if "stack" in w else shape)
            init = str(w.get("init", "normal"))
            if init not in ("normal", "ones"):
                raise self.err(line, f"{field}.init", f"expected 'normal' or 'ones', got {init!r}")
            hf = self.hf_name(f"{hf_prefix}{w['hf']}", env, line, f"{field}.hf")
            if "tied_to" in w and self.eval(w.get("tied_if", "true"), env, line, f"{field}.tied_if"):
                target = w["tied_to"]
                if target not in out:
                    raise self.err(line, f"{field}.tied_to", f"{target!r} is not a weight declared above it")
                if out[target].shape != shape:
                    raise self.err(line, f"{field}.tied_to", f"shape {list(shape)} differs from {target} {list(out[target].shape)}")
                self.aliases[name] = target
                self.tied_hf[name] = hf
                self.ties.append((hf, out[target].hf[0], str(w.get("tied_if", "true"))))
                continue
            stack = str(w["stack"]) if "stack" in w else None
            quantize = w.get("quantize", True)
            if not isinstance(quantize, bool):
                raise self.err(line, f"{field}.quantize", f"expected true or false, got {quantize!r}")
            out[str(name)] = Weight(name=f"{prefix}{name}", shape=shape, dtype=self.dtype, hf=(hf,), init=init,
                                    shard=shard, stack=stack, quantize=quantize)
        return out

    def hf_name(self, template: str, env, line, field) -> str:
        """Fill ``{param}`` fields of a checkpoint name from string params; index fields ({i}, {e}) stay."""
        def sub(m):
            key = m.group(1)
            value = env.get(key)
            if isinstance(value, str):
                return value
            if key in env and not isinstance(value, Sym):
                raise self.err(line, field, f"{{{key}}} names a param that is not a string ({value!r})")
            return m.group(0)

        return re.sub(r"\{(\w+)\}", sub, template)

    def shard_spec(self, spec, shape_exprs, env, line, field, shape=()) -> ShardSpec | None:
        """``column``, ``{kind: column, unit: head_dim}`` or, for a checkpoint tensor that holds several
        projections one after another (Phi-3's qkv_proj, gate_up_proj), ``{kind: column, parts: [exprs]}``, each
        part split on its own as the merge passes' segments -> ShardSpec (None when absent)."""
        if spec is None:
            return None
        if not isinstance(spec, (str, dict)) or isinstance(spec, dict) and set(spec) - {"kind", "unit", "parts"}:
            raise self.err(line, field, f"expected a kind, or {{kind: ..., unit: expr, parts: [exprs]}}; got {spec!r}")
        kind, unit = (spec, 1) if isinstance(spec, str) else (spec.get("kind"), spec.get("unit", 1))
        if kind not in ShardSpec.KINDS:
            raise self.err(line, field, f"expected one of {', '.join(ShardSpec.KINDS)}, got {kind!r}")
        unit = self.eval(unit, env, line, f"{field}.unit")
        if not isinstance(unit, int) or unit < 1:
            raise self.err(line, f"{field}.unit", f"expected a positive integer, got {unit!r}")
        dim = 1 if kind == "row" else 0
        parts = spec.get("parts") if isinstance(spec, dict) else None
        if parts is not None:
            return self.shard_parts(str(kind), unit, parts, dim, shape, env, line, f"{field}.parts")
        expr = str(shape_exprs[dim]) if kind != "replicated" and dim < len(shape_exprs) else ""
        expr = self.read_as.get(expr, expr)  # errors about the split name the field the config sets
        return ShardSpec(str(kind), unit=unit, exprs=(expr,) if expr else ())

    def shard_parts(self, kind, unit, parts, dim, shape, env, line, field) -> ShardSpec:
        if kind != "column":
            raise self.err(line, field, f"parts are for a column-parallel weight (rows of several projections), "
                                        f"not {kind}")
        if not isinstance(parts, list) or len(parts) < 2:
            raise self.err(line, field, f"expected a list of two or more part sizes, got {parts!r}")
        sizes = tuple(self.eval(p, env, line, field) for p in parts)
        for p, s in zip(parts, sizes):
            if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
                raise self.err(line, field, f"{p!r} evaluates to {s!r}; expected a positive integer")
        if dim < len(shape) and sum(sizes) != shape[dim]:
            raise self.err(line, field, f"parts {list(sizes)} add up to {sum(sizes)}, not the {shape[dim]} rows "
                                        f"of the weight")
        exprs = tuple(self.read_as.get(str(p), str(p)) for p in parts)
        return ShardSpec(kind, segments=sizes, unit=unit, exprs=exprs)

    def eval_shape(self, spec, env, line, field) -> tuple[int, ...]:
        if not isinstance(spec, list):
            raise self.err(line, field, "expected a list of dimension expressions")
        dims = tuple(self.eval(s, env, line, field) for s in spec)
        for s, d in zip(spec, dims):
            if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
                raise self.err(line, field, f"{s!r} evaluates to {d!r}; expected a positive integer")
        return dims

    # --- graph body -----------------------------------------------------------
    def block(self, items, scope, env, weights, where) -> list:
        if not isinstance(items, list):
            raise self.err(getattr(items, "line", 0), where, "expected a list of statements")
        out: list = []
        for item in items:
            if isinstance(item, str):
                out.extend(self.statement(item, scope, env, weights))
            elif isinstance(item, dict) and "repeat" in item:
                out.append(self.repeat(item, scope, env, weights))
            elif isinstance(item, dict) and "when" in item:
                if set(item) != {"when", "body"}:
                    raise self.err(item.line, f"{where}.when", "a when block has exactly the keys when and body")
                if self.eval(item["when"], env, item.line, f"{where}.when"):
                    out.extend(self.block(item["body"], scope, env, weights, f"{where}.when"))
            else:
                raise self.err(getattr(item, "line", 0), where, "expected a statement 'x = op(...)', a repeat block or a when block")
        return out

    def repeat(self, item, scope, env, weights) -> Repeat:
        spec, line = item["repeat"], item.line
        if set(item) - {"repeat", "weights", "body"} or not isinstance(spec, dict):
            raise self.err(line, "repeat", "expected {repeat: {count, index, name, hf_prefix}, weights: {...}, body: [...]}")
        count = self.eval(spec.get("count"), env, line, "repeat.count")
        index = str(spec.get("index", "i"))
        if not isinstance(count, int) or count <= 0:
            raise self.err(line, "repeat.count", f"expected a positive integer, got {count!r}")
        inner_env = dict(env, **{index: Sym(index)})
        local = self.read_weights(item.get("weights") or LDict(), env, str(spec.get("name", "")),
                                  str(spec.get("hf_prefix", "")), "repeat.weights")
        inner_scope = dict(scope)
        body = self.block(item.get("body"), inner_scope, inner_env, {**weights, **local}, "repeat.body")
        carry = {scope[k]: v for k, v in inner_scope.items() if k in scope and v != scope[k]}
        return Repeat(count=count, index=index, weights=local, body=tuple(body), carry=carry, loc=f"{self.path.name}:{line}")

    def statement(self, text, scope, env, weights) -> list[Node]:
        line = getattr(text, "line", 0)
        try:
            targets, call = parse_statement(text)
        except StatementError as e:
            raise self.err(line, "graph", f"{e} in {str(text)!r}") from None
        nodes: list[Node] = []
        outs = self.emit(call, targets, scope, env, weights, nodes, line)
        for t, o in zip(targets, outs):
            scope[t] = o
        return nodes

    def emit(self, call: Call, targets, scope, env, weights, nodes, line) -> list[str]:
        loc = f"{self.path.name}:{line}"
        if call.op not in OPS:
            written = sorted(set(OPS) - COMPILER_OPS)
            raise self.err(line, "graph", f"unknown op {call.op!r}; ops a model file writes: {', '.join(written)} "
                                          f"(the passes make {len(COMPILER_OPS)} more; mxc/ir/ops.py lists them all)")
        ins = []
        for a in call.args:
            if isinstance(a, Call):
                ins.append(self.emit(a, None, scope, env, weights, nodes, line)[0])
            elif a is None or a in self.disabled:
                ins.append(None)
            elif a in scope:
                ins.append(scope[a])
            elif a in weights or a in self.aliases:
                ins.append(self.aliases.get(a, a))
            else:
                raise self.err(line, "graph", f"{call.op}: unknown name {a!r} (not a value defined above, an input or a weight)")
        attrs = {k: self.eval(v, env, line, f"{call.op}.{k}") for k, v in call.kwargs.items()}
        n = n_outputs(call.op, attrs)
        if targets is not None and len(targets) != n:
            raise self.err(line, "graph", f"{call.op} has {n} output(s), but {len(targets)} name(s) are assigned")
        while ins and ins[-1] is None:
            ins.pop()
        outs = [self.fresh(t) for t in targets] if targets else [self.fresh(f"t_{call.op}")]
        nodes.append(Node(call.op, tuple(outs), tuple(ins), attrs, loc))
        return outs
