"""The rewrite engine the local passes run on (``mxc.compiler.rewrite``): rules applied to a fixpoint over the top
level and every repeat body, the rewrites counted, fresh names, and what ``sole_user`` / ``plain_linear`` let a rule
fold. Toy graphs, built here: the engine does not verify them."""

from __future__ import annotations

import pytest

from mxc.compiler.rewrite import _live, apply_rules
from mxc.ir import Graph, Node, Repeat, TensorType, Weight


def _w(name: str) -> Weight:
    return Weight(name, (4, 4), "float32", (f"hf.{name}",))


def _graph(top_before=(), body=(), top_after=(), *, outputs=("y",), carry=None, weights=("w_top",),
           layer_weights=("w",)) -> Graph:
    rep = Repeat(2, "i", {k: _w(f"layers.{{i}}.{k}") for k in layer_weights}, tuple(body), dict(carry or {}))
    return Graph(family="toy", dtype="float32", config={}, inputs={"x": TensorType(("T", 4), "float32")},
                 weights={k: _w(k) for k in weights}, body=(*top_before, rep, *top_after), outputs=outputs)


def _n(op: str, outs, ins, **attrs) -> Node:
    return Node(op, tuple(outs), tuple(ins), attrs, "")


def _rename(frm: str, to: str):
    """A rule rewriting each ``frm`` node into a ``to`` node, in place."""
    return frm, lambda node, ctx: {ctx.index(node): [node.replace(op=to)]}


def test_rules_run_to_a_fixpoint_in_every_body_and_count_each_rewrite():
    """Two rules feeding each other (a -> b -> c) over two top-level stretches and a repeat body: every node ends as
    c, and the count is one per rewrite made (two per node), however the rewrites are scheduled."""
    g = _graph(top_before=[_n("a", ["h"], ["x"]), _n("a", ["h2"], ["h"])],
               body=[_n("a", ["t"], ["h2", "w"]), _n("b", ["u"], ["t"]), _n("a", ["h2"], ["u"])],
               top_after=[_n("a", ["y"], ["h2"])], carry={"h2": "h2"})
    out, count = apply_rules(g, [_rename("b", "c"), _rename("a", "b")])
    ops = [n.op for n, _ in out.nodes()]
    assert ops == ["c"] * 6
    assert count == 2 * 5 + 1  # five a's rewritten twice, one b once
    assert [type(it) for it in out.body] == [Node, Node, Repeat, Node]


def test_a_rule_that_never_settles_is_an_error():
    flip = ("a", lambda node, ctx: {ctx.index(node): [node.replace(op="b")]})
    flop = ("b", lambda node, ctx: {ctx.index(node): [node.replace(op="a")]})
    with pytest.raises(RuntimeError, match="rewrite rules did not converge after 7 rounds"):
        apply_rules(_graph(top_after=[_n("a", ["y"], ["x"])]), [flip, flop], max_rounds=7)


def test_a_rule_may_delete_and_insert_nodes():
    def fold(node, ctx):  # neg(neg(v)) -> v, through a copy node
        inner = ctx.producing(node.ins[0])
        if inner is None or inner.op != "neg" or ctx.sole_user(inner.outs[0]) is not node:
            return None
        return {ctx.index(inner): [], ctx.index(node): [_n("copy", node.outs, inner.ins)]}

    g = _graph(top_after=[_n("neg", ["a"], ["x"]), _n("neg", ["y"], ["a"])])
    out, count = apply_rules(g, [("neg", fold)])
    assert count == 1
    assert out.body[1:] == (_n("copy", ["y"], ["x"]),)


def test_fresh_names_avoid_every_name_in_the_graph():
    """Names a rule makes (merged weights, new values) are new to the whole graph: inputs, top-level weights, every
    body's local weights and every value."""
    made = []

    def name_them(node, ctx):
        if not made:
            made.extend(ctx.fresh(base) for base in ("x", "w_top", "w", "t", "y", "new", "new"))
        return None

    g = _graph(body=[_n("mul", ["t"], ["x", "w"])], top_after=[_n("a", ["y"], ["x"])])
    apply_rules(g, [("a", name_them)])
    assert made == ["x_1", "w_top_1", "w_1", "t_1", "y_1", "new", "new_1"]


def _sole_users(g: Graph, op: str, values) -> dict:
    """``ctx.sole_user(v)`` for each of ``values``, asked from the body holding the node of ``op``: the op of the
    node it names, or None."""
    seen = {}

    def ask(node, ctx):
        for v in values:
            user = ctx.sole_user(v)
            seen[v] = user.op if user is not None else None
        return None

    apply_rules(g, [(op, ask)])
    return seen


def test_sole_user_answers_only_for_values_read_once_and_nowhere_else():
    g = _graph(top_before=[_n("a", ["h"], ["x"])],
               body=[_n("p", ["t"], ["h", "w"]), _n("q", ["u"], ["t"]), _n("r", ["v"], ["t", "u"]),
                     _n("s", ["z"], ["v"])],
               top_after=[_n("k", ["y"], ["h"])], carry={"h": "v"})
    assert _sole_users(g, "q", ["u", "t", "v", "w", "nothing"]) == {
        "u": "r",  # read once
        "t": None,  # read twice
        "v": None,  # read once, but the loop carries it into the next layer as h
        "w": "p",  # a layer weight read once
        "nothing": None,
    }


def test_values_live_beyond_their_stretch():
    """``live``: graph outputs, both names of each loop carry, and values one stretch (the top level before the
    repeat, its body, the top level after it) defines and another reads; nothing else (inputs included)."""
    g = _graph(top_before=[_n("a", ["h"], ["x"]), _n("a", ["local"], ["h"]), _n("a", ["h0"], ["local"])],
               body=[_n("p", ["t"], ["h0", "x", "w"]), _n("q", ["hc"], ["t", "x"])],
               top_after=[_n("k", ["m"], ["t", "x"]), _n("k", ["y"], ["m", "h"])], carry={"h0": "hc"})
    assert _live(g) == {"y", "h0", "hc", "t", "h"}
    # sole_user sees the same: h's one reader in its own stretch does not make it foldable
    assert _sole_users(g, "a", ["h", "local"]) == {"h": None, "local": "a"}


@pytest.mark.parametrize("case", ["plain", "bias", "prologue", "not-a-weight", "two-readers", "other-reader"])
def test_plain_linear_is_an_unbiased_linear_of_a_weight_read_only_by_the_reader(case):
    lin = {"plain": _n("linear", ["l"], ["x", "w"]), "bias": _n("linear", ["l"], ["x", "w", "b"]),
           "prologue": _n("linear", ["l"], ["x", "w"], prologue="silu_mul"),
           "not-a-weight": _n("linear", ["l"], ["x", "x"])}.get(case, _n("linear", ["l"], ["x", "w"]))
    reader = _n("relu", ["r"], ["l"])
    other = _n("add", ["o"], ["l" if case == "two-readers" else "r", "r"])
    asked = {}

    def ask(node, ctx):
        target = other if case == "other-reader" else node
        asked["lin"] = ctx.plain_linear("l", target)
        return None

    g = _graph(body=[lin, reader, other, _n("a", ["y"], ["o"])], layer_weights=("w", "b"), outputs=("y",))
    apply_rules(g, [("relu", ask)])
    assert asked["lin"] == (lin if case == "plain" else None)
