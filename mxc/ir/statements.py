"""The statement syntax shared by model files and IR dumps.

A statement is ``outs = op(inputs..., attr=expr, ...)``: Python syntax, parsed
with ``ast`` (never executed). Positional arguments are value or weight names,
``None`` for an absent optional input, or nested calls (``add(x, linear(a, wo))``);
keyword arguments are attributes, kept as expression trees for the caller to
evaluate. ``format_statement`` writes one back.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any


@dataclass
class Call:
    op: str
    args: list  # str (name) | None | Call
    kwargs: dict[str, ast.expr]


class StatementError(ValueError):
    pass


def parse_statement(text: str) -> tuple[list[str], Call]:
    try:
        tree = ast.parse(str(text).strip())
    except SyntaxError as e:
        raise StatementError(f"cannot parse statement: {e.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        raise StatementError("expected 'name = op(args...)' or 'a, b = op(args...)'")
    stmt = tree.body[0]
    target = stmt.targets[0]
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    if not all(isinstance(e, ast.Name) for e in elts):
        raise StatementError("the left side must be names")
    return [e.id for e in elts], _call(stmt.value)


def _call(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise StatementError(f"expected an op call, got {ast.unparse(node)!r}")
    args = []
    for a in node.args:
        if isinstance(a, ast.Name):
            args.append(a.id)
        elif isinstance(a, ast.Constant) and a.value is None:
            args.append(None)
        elif isinstance(a, ast.Call):
            args.append(_call(a))
        else:
            raise StatementError(f"inputs must be names or op calls, got {ast.unparse(a)!r}; attributes go as key=value")
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise StatementError("**kwargs are not allowed")
        kwargs[kw.arg] = kw.value
    return Call(node.func.id, args, kwargs)


def format_value(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    return repr(v)


def format_statement(outs, op: str, ins, attrs: dict) -> str:
    args = [("None" if i is None else i) for i in ins]
    args += [f"{k}={format_value(v)}" for k, v in attrs.items()]
    return f"{', '.join(outs)} = {op}({', '.join(args)})"
