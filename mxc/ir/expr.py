"""Safe evaluation of the small expressions model files use.

Shapes (``num_attention_heads*head_dim``), conditions (``qkv_bias and not x``)
and attribute values (``head_dim**-0.5``) are Python expression syntax,
parsed with ``ast`` and evaluated by walking the tree: names come only from the
environment given, and only arithmetic, comparisons, boolean logic,
conditional expressions and literals are allowed. Nothing is ``eval``-ed.
Results stay small: an integer past ``MAX_INT_BITS``, a string or list past
``MAX_LENGTH`` items, or running out of memory or float range is an ``ExprError``.
"""

from __future__ import annotations

import ast
import operator

_BIN = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_CMP = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
    ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}


MAX_EXPONENT = 64  # x ** y with a larger |y|: no shape or scale needs one, and 10 ** 10 ** 10 would not end
MAX_INT_BITS = 256  # an integer result wider than this: ((10 ** 60) ** 60) ** 60 ... would not end either
MAX_LENGTH = 4096  # a string or list result longer than this: 'a' * 10 ** 12 would exhaust memory


class ExprError(ValueError):
    """An expression that is malformed or names something unknown."""


def parse_expr(text: str) -> ast.expr:
    try:
        return ast.parse(str(text).strip(), mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"cannot parse expression {text!r}: {e.msg}") from None
    except (MemoryError, RecursionError):  # -------1, 1+1+1+... thousands deep
        raise ExprError(f"cannot parse expression {_short(text)}: nested too deeply") from None


def names_read(expr) -> list[str]:
    """The names an expression reads, in the order they first appear (a literal reads none)."""
    if not isinstance(expr, str):
        return []
    names = sorted((n for n in ast.walk(parse_expr(expr)) if isinstance(n, ast.Name)),
                   key=lambda n: (n.lineno, n.col_offset))
    return list(dict.fromkeys(n.id for n in names))


def _short(text) -> str:
    text = repr(str(text))
    return text if len(text) <= 80 else text[:77] + "..."


def evaluate(node: ast.expr | str | int | float | bool | None, env: dict):
    """Evaluate an expression tree (or text, or a plain literal) over ``env``."""
    if node is None or isinstance(node, (bool, int, float)):
        return node
    text = node if isinstance(node, str) else None
    if isinstance(node, str):
        node = parse_expr(node)
    if not isinstance(node, ast.expr):  # a YAML mapping or list where an expression belongs
        kind = "a mapping" if isinstance(node, dict) else "a list" if isinstance(node, list) else type(node).__name__
        raise ExprError(f"expected an expression, got {kind} {node!r}")
    try:
        return _eval(node, env)
    except OverflowError:  # 1e300 ** 2
        raise ExprError(f"{_short(text or ast.unparse(node))}: the result is too large for a float") from None
    except (MemoryError, RecursionError):  # past what the limits below catch
        shown = _short(text) if text is not None else "the expression"
        raise ExprError(f"{shown}: too large or nested too deeply to evaluate") from None


def _bounded(value, n: ast.expr):
    """``value``, the result of ``n``, unless it is an integer, string or list past the limits."""
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ExprError(f"the result of {_short(ast.unparse(n))} is past {MAX_INT_BITS} bits")
    if isinstance(value, (str, list)) and len(value) > MAX_LENGTH:
        raise ExprError(f"the result of {_short(ast.unparse(n))} is past {MAX_LENGTH} items")
    return value


def _repeat(left, right, n: ast.BinOp) -> None:
    """Refuse ``seq * count`` past MAX_LENGTH items before making it."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list)) and isinstance(count, int) and len(seq) * count > MAX_LENGTH:
            raise ExprError(f"{_short(ast.unparse(n))} repeats a sequence past {MAX_LENGTH} items")


def _eval(n: ast.expr, env: dict):
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Name):
        if n.id in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[n.id]
        if n.id not in env:
            raise ExprError(f"unknown name {n.id!r}")
        return env[n.id]
    if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
        left, right = _eval(n.left, env), _eval(n.right, env)
        if isinstance(n.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise ExprError(f"exponent {right!r} in {ast.unparse(n)!r} is past {MAX_EXPONENT}")
        if isinstance(n.op, ast.Mod) and isinstance(left, str):  # '%099999999d' % 1: formatting, not arithmetic
            raise ExprError(f"string formatting {_short(ast.unparse(n))} is not allowed")
        if isinstance(n.op, ast.Mult):
            _repeat(left, right, n)
        return _bounded(_BIN[type(n.op)](left, right), n)
    if isinstance(n, ast.UnaryOp):
        v = _eval(n.operand, env)
        if isinstance(n.op, ast.USub):
            return -v
        if isinstance(n.op, ast.UAdd):
            return +v
        if isinstance(n.op, ast.Not):
            return not v
    if isinstance(n, ast.BoolOp):  # Python semantics: the deciding operand, short-circuited
        value = None
        for v in n.values:
            value = _eval(v, env)
            if bool(value) != isinstance(n.op, ast.And):
                return value
        return value
    if isinstance(n, ast.Compare) and all(type(o) in _CMP for o in n.ops):
        left = _eval(n.left, env)
        for op, right_node in zip(n.ops, n.comparators):
            right = _eval(right_node, env)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(n, ast.IfExp):
        return _eval(n.body, env) if _eval(n.test, env) else _eval(n.orelse, env)
    if isinstance(n, (ast.List, ast.Tuple)):
        return [_eval(e, env) for e in n.elts]
    if isinstance(n, ast.Dict):
        if any(k is None for k in n.keys):
            raise ExprError("dict unpacking is not allowed")
        return {_eval(k, env): _eval(v, env) for k, v in zip(n.keys, n.values)}
    raise ExprError(f"unsupported expression {ast.unparse(n)!r}")
