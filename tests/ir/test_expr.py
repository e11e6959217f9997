"""The model-file expression language: arithmetic, logic, comparisons, conditionals; nothing else."""

from __future__ import annotations

import ast
import operator
import re

import pytest

from mxc.ir.expr import MAX_EXPONENT, MAX_INT_BITS, MAX_LENGTH, ExprError, evaluate, parse_expr

ENV = {"hidden_size": 64, "heads": 4, "head_dim": 16, "bias": True, "window": None, "eps": 1e-5}


@pytest.mark.parametrize("text, want", [
    ("heads*head_dim", 64),
    ("hidden_size // heads", 16),
    ("hidden_size // 3", 21),
    ("hidden_size / 128", 0.5),
    ("hidden_size % 7", 1),
    ("head_dim**-0.5", 0.25),
    ("2**10", 1024),
    ("-heads + 1", -3),
    ("+heads", 4),
    ("(hidden_size - 4) * 2", 120),
    ("heads == 4", True),
    ("heads != 4", False),
    ("1 < heads <= 4", True),
    ("1 < heads < 4", False),
    ("head_dim >= 16 > heads", True),
    ("window is None", True),
    ("window is not None", False),
    ("bias and heads > 2", True),
    ("not bias", False),
    ("window or false", False),
    ("true and not false", True),
    ("null", None),
    ("hidden_size if bias else 0", 64),
    ("hidden_size if window else head_dim", 16),
    ("[heads, head_dim * 2]", [4, 32]),
    ("{'a': heads, 'b': [1, 2]}", {"a": 4, "b": [1, 2]}),
    ("'column'", "column"),
    ("1e-6", 1e-6),
])
def test_evaluates(text, want):
    got = evaluate(text, ENV)
    assert got == want and type(got) is type(want)


def test_literals_and_trees_pass_through():
    assert evaluate(None, {}) is None
    assert evaluate(3, {}) == 3 and evaluate(True, {}) is True and evaluate(0.5, {}) == 0.5
    assert evaluate(parse_expr("heads*2"), ENV) == 8


def test_short_circuit():
    """The right side of `and`/`or` and the unused branch of `if` are not evaluated."""
    assert evaluate("window is not None and window > 4", ENV) is False
    assert evaluate("window is None or window > 4", ENV) is True
    assert evaluate("hidden_size if bias else undefined_name", ENV) == 64


@pytest.mark.parametrize("text, want", [("window or 4096", 4096), ("bias and head_dim", 16), ("0 or heads", 4)])
def test_boolean_operators_return_operands(text, want):
    assert evaluate(text, ENV) == want


@pytest.mark.parametrize("text", [
    "__import__('os')",
    "open('/etc/passwd')",
    "len([1])",
    "hidden_size.bit_length",
    "a.b",
    "().__class__",
    "[1, 2][0]",
    "lambda: 1",
    "[x for x in [1]]",
    "1 in [1]",
    "~heads",
    "heads if (y := 1) else 0",
    "f'{heads}'",
    "[*[1]]",
])
def test_refuses(text):
    with pytest.raises(ExprError):
        evaluate(text, {**ENV, "a": object()})


def test_refuses_dict_unpacking():
    with pytest.raises(ExprError):
        evaluate("{**a}", {"a": {}})


def test_unknown_name_and_syntax_error():
    with pytest.raises(ExprError, match="unknown name 'num_heads'"):
        evaluate("num_heads * 2", ENV)
    with pytest.raises(ExprError, match="cannot parse expression"):
        evaluate("heads *", ENV)
    with pytest.raises(ExprError, match="cannot parse expression"):
        evaluate("x = 1", ENV)


def test_never_calls_eval(monkeypatch):
    import builtins

    def boom(*a, **k):
        raise AssertionError("eval/exec used")

    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    assert evaluate("heads * head_dim if bias else 0", ENV) == 64


def test_parse_expr_returns_a_tree():
    assert isinstance(parse_expr(" hidden_size // heads "), ast.BinOp)


def test_exponent_limit_is_inclusive():
    """The documented limit: an exponent *larger* than MAX_EXPONENT is refused; MAX_EXPONENT itself is not."""
    assert evaluate(f"2 ** {MAX_EXPONENT}", {}) == 2 ** MAX_EXPONENT
    assert evaluate(f"2 ** -{MAX_EXPONENT}", {}) == 2 ** -MAX_EXPONENT
    with pytest.raises(ExprError, match="past"):
        evaluate(f"2 ** {MAX_EXPONENT + 1}", {})


@pytest.mark.parametrize("a,b", [(1, True), (0, False), (1.0, 1), (None, None), (True, True)])
def test_is_compares_identity_as_python_does(a, b):
    env = {"a": a, "b": b}
    assert evaluate("a is b", env) is operator.is_(a, b)
    assert evaluate("a is not b", env) is operator.is_not(a, b)


@pytest.mark.parametrize("text, needle", [
    ("((((10**60)**60)**60)**60)**60", "the result of '(10 ** 60) ** 60' is past 256 bits"),
    ("2**64 * 2**64 * 2**64 * 2**64 * 2", "is past 256 bits"),
    ("2**64 * 2**64 * 2**64 * 2**64", "is past 256 bits"),  # 257 bits: one past the limit
    ("[1] * 4097", "repeats a sequence past 4096 items"),  # refused before it is made, at one past the limit
    ("'a' * 4096 + 'a'", "is past 4096 items"),  # a string, as a list
    ("'a' * 10**12 == 'b'", "repeats a sequence past 4096 items"),
    ("10**11 * [1] == []", "repeats a sequence past 4096 items"),
    ("[1] * 4096 + [1]", "is past 4096 items"),
    ("'%0999999999d' % 1", "string formatting"),
    ("1e300 ** 2", "'1e300 ** 2': the result is too large for a float"),
    ("-" * 5000 + "1", "nested too deeply"),
    ("-" * 1500 + "1", "nested too deeply"),
])
def test_results_are_bounded(text, needle):
    """No expression takes all memory or runs for hours: an integer past MAX_INT_BITS, a string or list past
    MAX_LENGTH items, a float overflow or nesting past the interpreter's stack is an ExprError, quickly."""
    with pytest.raises(ExprError, match=re.escape(needle)):
        evaluate(text, {})


@pytest.mark.parametrize("text, message", [
    # refused by the parser (Python 3.11), or parsed, then refused (3.12's parser nests deeper)
    ("-" * 5000 + "1", ("cannot parse expression '" + "-" * 76 + "...: nested too deeply",
                        "'" + "-" * 76 + "...: too large or nested too deeply to evaluate")),
    ("-" * 1500 + "1", "'" + "-" * 76 + "...: too large or nested too deeply to evaluate"),  # parsed, then refused
    ("'" + "a" * 100 + "' % 1", "string formatting \"'" + "a" * 75 + "... is not allowed"),  # 110 characters
])
def test_a_long_expression_is_named_shortened(text, message):
    """The error names the expression itself, cut to 80 characters: one line, not hundreds or thousands."""
    with pytest.raises(ExprError) as e:
        evaluate(text, {})
    assert str(e.value) in ((message,) if isinstance(message, str) else message)


def test_result_limits_are_inclusive():
    assert evaluate("2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 63", {}).bit_length() == MAX_INT_BITS
    assert evaluate(f"[0] * {MAX_LENGTH}", {}) == [0] * MAX_LENGTH
    assert evaluate(f"'ab' * {MAX_LENGTH // 2}", {}) == "ab" * (MAX_LENGTH // 2)
    assert evaluate("hidden_size % 7", ENV) == 1


def test_names_read_in_source_order():
    from mxc.ir.expr import names_read

    assert names_read("b + a * (c if a else b)") == ["b", "a", "c"]
    assert names_read("1 <= k <= n") == ["k", "n"]
    assert names_read("3") == [] and names_read(3) == [] and names_read(None) == []
