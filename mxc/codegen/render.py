"""Rendering the lowered IR into the artifact's forward program (Python source).

Every node becomes one call of the kernel its ``kernel`` attribute names,
``outs = module.function(inputs..., [ctx,] attrs...)``, preceded by a comment
with the IR statement and its model-file line. Repeats become a ``for`` loop
over the layer index with loop-carried values reassigned at the end.
Dict-valued attributes (RoPE specs) are hoisted to module constants. Codegen
decides nothing about fusion or kernel choice: that is already in the IR.
"""

from __future__ import annotations

import keyword
from pathlib import Path

import jinja2

import mxc
from mxc.ir import Graph, Node, Repeat, Sym
from mxc.ir.ops import OPS
from mxc.ir.statements import format_statement, format_value

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                          undefined=jinja2.StrictUndefined)
_RESERVED = {"w", "layers", "ctx", "L", "forward"}


class _Renderer:
    def __init__(self, graph: Graph):
        self.graph = graph
        # every kernel module the program imports, known before any value is named: a value or input named like one
        # (``torch_ref``) is renamed even where it is defined ahead of the module's first call
        self.modules = {k.partition(".")[0] for n, _ in graph.nodes() for k in _kernels(n.attrs["kernel"])}
        self.constants: dict[str, str] = {}  # source text -> constant name
        self.names = {v: self._safe(v) for v in graph.inputs}

    def _safe(self, name: str) -> str:
        if keyword.iskeyword(name) or name in _RESERVED or name in self.modules:
            return f"{name}_"
        return name

    def value(self, name: str) -> str:
        return self.names.setdefault(name, self._safe(name))

    def attr(self, v) -> str:
        if isinstance(v, Sym):
            return v.name
        text = format_value(v)
        if isinstance(v, dict):
            if text not in self.constants:
                self.constants[text] = f"CONST_{len(self.constants)}"
            return self.constants[text]
        return text

    def call(self, kernel: str, args: list[str]) -> str:
        module, _, fn = kernel.partition(".")
        return f"{module}.{fn}({', '.join(args)})"

    def node(self, n: Node, local_weights: dict) -> dict:
        args = []
        n_inputs = len(OPS[n.op].inputs)
        for v in list(n.ins) + [None] * (n_inputs - len(n.ins)):
            if v is None:
                args.append("None")
            elif v in local_weights:
                args.append(f'L["{v}"]')
            elif v in self.graph.weights:
                args.append(f'w["{v}"]')
            else:
                args.append(self.value(v))
        if OPS[n.op].uses_context:
            args.append("ctx")
        args += [f"{k}={self.attr(v)}" for k, v in n.attrs.items() if k not in ("kernel", "kernel_reason")]
        kernel = n.attrs["kernel"]
        if isinstance(kernel, str):
            expr = self.call(kernel, args)
        else:  # per token-count bucket: dispatch on the first input's rows
            rows = f"{args[0]}.shape[0]"
            *bounded, (_, last) = kernel
            expr = self.call(last, args)
            for hi, name in reversed(bounded):
                expr = f"{self.call(name, args)} if {rows} <= {hi} else {expr}"
        outs = ", ".join(self.value(o) for o in n.outs)
        ir_attrs = {k: v for k, v in n.attrs.items() if k not in ("kernel_reason",) and not isinstance(v, dict)}
        return {"kind": "node", "loc": n.loc, "ir": format_statement(n.outs, n.op, n.ins, ir_attrs),
                "code": f"{outs} = {expr}"}

    def render(self, ir_hash: str) -> str:
        body = []
        for item in self.graph.body:
            if isinstance(item, Repeat):
                nodes = [self.node(n, item.weights) for n in item.body]
                body.append({"kind": "repeat", "index": item.index, "count": item.count, "loc": item.loc,
                             "body": nodes, "carry": [(self.value(o), self.value(i)) for o, i in item.carry.items()]})
            else:
                body.append(self.node(item, {}))
        return _ENV.get_template("forward.py.j2").render(
            family=self.graph.family, version=mxc.__version__, ir_hash=ir_hash,
            modules=sorted(self.modules), constants=[(n, t) for t, n in self.constants.items()],
            inputs=[self.value(v) for v in self.graph.inputs], body=body,
            outputs=[self.value(o) for o in self.graph.outputs])


def _kernels(kernel) -> list[str]:
    """The kernels a node's ``kernel`` attribute names: one, or one per token-count bucket [(bound, kernel), ...]."""
    return [kernel] if isinstance(kernel, str) else [name for _, name in kernel]


def render_forward(graph: Graph, ir_hash: str) -> str:
    """The forward program's source for ``graph`` (which must have kernels selected)."""
    return _Renderer(graph).render(ir_hash)
