"""The statement syntax: ``outs = op(inputs..., attr=expr)`` parsed with ``ast`` and written back."""

from __future__ import annotations

import ast

import pytest

from mxc.ir.statements import Call, StatementError, format_statement, format_value, parse_statement


def test_parse_outputs_inputs_nested_calls_and_attributes():
    outs, call = parse_statement("  q, k = split(add(x, None), w, dim=-1, sizes=[4, 2])  ")
    assert outs == ["q", "k"]
    assert call.op == "split" and call.args[1:] == ["w"]
    assert call.args[0] == Call("add", ["x", None], {})
    assert {k: ast.literal_eval(v) for k, v in call.kwargs.items()} == {"dim": -1, "sizes": [4, 2]}


@pytest.mark.parametrize("text, needle", [
    ("a = f(x)\nb = g(y)", "expected 'name = op(args...)'"),
    ("a = f(x); b = f(y)", "expected 'name = op(args...)'"),
    ("a = b = f(x)", "expected 'name = op(args...)'"),
    ("f(x)", "expected 'name = op(args...)'"),
    ("a.b = f(x)", "the left side must be names"),
    ("a[0] = f(x)", "the left side must be names"),
    ("a = m.f(x)", "expected an op call, got 'm.f(x)'"),
    ("a = x", "expected an op call, got 'x'"),
    ("a = f(x, 3)", "inputs must be names or op calls, got '3'"),
    ("a = f(x, 'w')", "inputs must be names or op calls"),
    ("a = f(*x)", "inputs must be names or op calls"),
    ("a = f(x, **k)", "**kwargs are not allowed"),
    ("a = f(x", "cannot parse statement"),
])
def test_malformed_statements_are_refused(text, needle):
    with pytest.raises(StatementError) as exc:
        parse_statement(text)
    assert needle in str(exc.value)


def test_format_writes_what_parse_reads():
    attrs = {"eps": 1e-05, "dims": (1, (2, 3)), "rope": {"type": "yarn", "factor": 4.0}, "flag": True, "name": "x"}
    text = format_statement(["y", "z"], "op", ["a", None, "b"], attrs)
    outs, call = parse_statement(text)
    assert outs == ["y", "z"] and call.op == "op" and call.args == ["a", None, "b"]
    got = {k: ast.literal_eval(v) for k, v in call.kwargs.items()}
    assert got == {**attrs, "dims": [1, [2, 3]]}  # tuples are written as lists, at every depth
    assert list(got) == list(attrs)


def test_floats_keep_every_digit():
    for v in (0.1 + 0.2, 1e-06, 123456.789012345, -2.5e-300):
        assert float(format_value(v)) == v
