"""merge_gate_up: mul(silu(linear(h, wg)), linear(h, wu)) -> silu_mul(linear(h, w_gate_up))."""

from __future__ import annotations

import pytest

from mxc.compiler.passes import eliminate_dead_code, merge_gate_up
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node, ShardSpec, Weight, verify
from mxc.ir.statements import format_statement


def stmts(nodes) -> list[str]:
    return [format_statement(n.outs, n.op, n.ins, {k: v for k, v in n.attrs.items()
                                                     if not isinstance(v, dict) and not k.startswith("kernel")})
            for n in nodes]


def layer(graph: Graph):
    (rep,) = graph.repeats()
    return rep


def with_body(graph: Graph, body) -> Graph:
    rep = layer(graph)
    return graph.replace(body=tuple(rep.replace(body=tuple(body)) if it is rep else it for it in graph.body))


def count(graph: Graph) -> int:
    return apply_rules(graph, [("mul", merge_gate_up._match)])[1]


MLP = slice(12, None)  # the layer's statements from the second norm on

BEFORE = [
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "t_linear_4 = linear(h_1, w_gate)",
    "t_silu = silu(t_linear_4)",
    "t_linear_5 = linear(h_1, w_up)",
    "m = mul(t_silu, t_linear_5)",
    "t_linear_6 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_6)",
]
AFTER = [  # the replaced producers are left for eliminate_dead_code
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "t_linear_4 = linear(h_1, w_gate)",
    "t_silu = silu(t_linear_4)",
    "t_linear_5 = linear(h_1, w_up)",
    "gate_up = linear(h_1, w_gate_up)",
    "m = silu_mul(gate_up)",
    "t_linear_6 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_6)",
]
AFTER_DCE = [
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "gate_up = linear(h_1, w_gate_up)",
    "m = silu_mul(gate_up)",
    "t_linear_6 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_6)",
]
W_GATE_UP = Weight("layers.{i}.w_gate_up", (192, 64), "float32",
                   ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
                   segments=(96, 96), shard=ShardSpec("column", (96, 96), 1, ("intermediate_size",) * 2))


def test_before_after(bind_arch):
    before = bind_arch()
    after = merge_gate_up.run(before, None)
    verify(after)
    assert stmts(layer(before).body)[MLP] == BEFORE
    assert stmts(layer(after).body)[MLP] == AFTER
    assert layer(after).body[:12] == layer(before).body[:12]  # attention untouched
    assert [n.loc for n in layer(after).body[16:18]] == ["llama.yaml:73"] * 2
    assert layer(after).weights == {**layer(before).weights, "w_gate_up": W_GATE_UP}
    cleaned = eliminate_dead_code.run(after, None)
    verify(cleaned)
    assert stmts(layer(cleaned).body)[MLP] == AFTER_DCE
    assert "w_gate" not in layer(cleaned).weights and "w_up" not in layer(cleaned).weights
    assert layer(cleaned).weights["w_gate_up"] == W_GATE_UP


def test_match_count(bind_arch):
    before = bind_arch()
    assert count(before) == 1
    after = merge_gate_up.run(before, None)
    assert count(after) == 0
    assert merge_gate_up.run(after, None) == after
    cleaned = eliminate_dead_code.run(after, None)
    linears = lambda g: sum(n.op == "linear" for n, _ in g.nodes())
    assert (linears(before), linears(cleaned)) == (8, 7)
    assert [n.op for n, _ in cleaned.nodes()].count("silu_mul") == 1


def test_biases_merge(bind_arch):
    after = merge_gate_up.run(bind_arch(mlp_bias=True), None)
    verify(after)
    assert "gate_up = linear(h_1, w_gate_up, b_gate_up)" in stmts(layer(after).body)
    b = layer(after).weights["b_gate_up"]
    assert (b.shape, b.segments, b.shard) == ((192,), (96, 96), ShardSpec("column", (96, 96), 1, ("intermediate_size",) * 2))


def _insert_user(graph: Graph, of: str) -> Graph:
    """Add ``extra = add(<of>, m)`` and make the down projection read it: ``of`` gets a second user."""
    body = []
    for n in layer(graph).body:
        if n.outs == ("t_linear_6",):
            body.append(Node("add", ("extra",), (of, "m"), {}, "test:1"))
            n = n.replace(ins=("extra", "w_down"))
        body.append(n)
    g = with_body(graph, body)
    verify(g)
    return g


@pytest.mark.parametrize("value", ["t_linear_4", "t_silu"], ids=["gate_output", "silu_output"])
def test_declines_when_gate_has_another_user(bind_arch, value):
    g = _insert_user(bind_arch(), value)
    assert count(g) == 0
    assert merge_gate_up.run(g, None) == g


def test_up_with_another_user_still_merges(bind_arch, assert_same_logits):
    """The up projection may have other readers: it is kept for them, and the math is unchanged."""
    g = _insert_user(bind_arch(), "t_linear_5")
    after = eliminate_dead_code.run(merge_gate_up.run(g, None), None)
    assert count(g) == 1
    assert "t_linear_5 = linear(h_1, w_up)" in stmts(layer(after).body)
    assert "t_silu = silu(t_linear_4)" not in stmts(layer(after).body)
    assert_same_logits(g, after)


def test_declines_different_inputs(bind_arch):
    g = with_body(bind_arch(), [n.replace(ins=("x_1", "w_up")) if n.outs == ("t_linear_5",) else n
                                for n in layer(bind_arch()).body])
    verify(g)
    assert count(g) == 0


@pytest.mark.parametrize("fields", [{}, {"mlp_bias": True}], ids=["plain", "mlp_bias"])
def test_numerics(bind_arch, assert_same_logits, fields):
    before = bind_arch(**fields)
    after = merge_gate_up.run(before, None)
    assert_same_logits(before, after)
    assert_same_logits(before, eliminate_dead_code.run(after, None))
