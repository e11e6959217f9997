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


def mlp_start(nodes) -> int:
    """Index of the layer's second norm (over ln2): the MLP's statements start there."""
    (i,) = [i for i, n in enumerate(nodes) if n.op == "rms_norm" and n.ins[1] == "ln2"]
    return i


def mlp(nodes) -> list[str]:
    return stmts(nodes[mlp_start(nodes):])


def linear_over(graph: Graph, weight: str) -> Node:
    """The one linear over ``weight`` in the layer (found by what it computes, not by its name or position)."""
    (node,) = [n for n in layer(graph).body if n.op == "linear" and n.ins[1] == weight]
    return node


BEFORE = [
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "t_linear_1 = linear(h_1, w_gate)",
    "t_silu = silu(t_linear_1)",
    "t_linear_2 = linear(h_1, w_up)",
    "m = mul(t_silu, t_linear_2)",
    "t_linear_3 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_3)",
]
AFTER = [  # the replaced producers are left for eliminate_dead_code
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "t_linear_1 = linear(h_1, w_gate)",
    "t_silu = silu(t_linear_1)",
    "t_linear_2 = linear(h_1, w_up)",
    "gate_up = linear(h_1, w_gate_up)",
    "m = silu_mul(gate_up)",
    "t_linear_3 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_3)",
]
AFTER_DCE = [
    "h_1 = rms_norm(x_1, ln2, eps=1e-05)",
    "gate_up = linear(h_1, w_gate_up)",
    "m = silu_mul(gate_up)",
    "t_linear_3 = linear(m, w_down)",
    "x_2 = add(x_1, t_linear_3)",
]
W_GATE_UP = Weight("layers.{i}.w_gate_up", (192, 64), "float32",
                   ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
                   segments=(96, 96), shard=ShardSpec("column", (96, 96), 1, ("intermediate_size",) * 2))


def test_before_after(bind_arch, loc_of):
    before = bind_arch()
    after = merge_gate_up.run(before, None)
    verify(after)
    b, a = layer(before).body, layer(after).body
    assert mlp(b) == BEFORE
    assert mlp(a) == AFTER
    assert a[:mlp_start(a)] == b[:mlp_start(b)]  # attention untouched
    # the merged projection and silu_mul take the line of the statement they replace
    assert [n.loc for n in a if n.op in ("silu_mul", "mul") or n.outs == ("gate_up",)] == [
        loc_of("- m = mul(silu(linear(h, w_gate, b_gate)), linear(h, w_up, b_up))")] * 2
    assert layer(after).weights == {**layer(before).weights, "w_gate_up": W_GATE_UP}
    cleaned = eliminate_dead_code.run(after, None)
    verify(cleaned)
    assert mlp(layer(cleaned).body) == AFTER_DCE
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


# The MLP's values, found by what computes them: the gate and up projections, and silu(gate).
PRODUCERS = {
    "gate_output": lambda g: linear_over(g, "w_gate").outs[0],
    "up_output": lambda g: linear_over(g, "w_up").outs[0],
    "silu_output": lambda g: next(n for n in layer(g).body if n.op == "silu").outs[0],
}


def _insert_user(graph: Graph, of: str) -> Graph:
    """Add ``extra = add(<of>, m)`` and make the down projection read it: ``of`` gets a second user."""
    down = linear_over(graph, "w_down")
    assert down.ins == ("m", "w_down")
    body = []
    for n in layer(graph).body:
        if n is down:
            body.append(Node("add", ("extra",), (of, "m"), {}, "test:1"))
            n = n.replace(ins=("extra", "w_down"))
        body.append(n)
    g = with_body(graph, body)
    verify(g)
    return g


@pytest.mark.parametrize("value", ["gate_output", "silu_output"])
def test_declines_when_gate_has_another_user(bind_arch, value):
    g = bind_arch()
    g = _insert_user(g, PRODUCERS[value](g))
    assert count(g) == 0
    assert merge_gate_up.run(g, None) == g


def test_up_with_another_user_still_merges(bind_arch, assert_same_logits):
    """The up projection may have other readers: it is kept for them, and the math is unchanged."""
    g = bind_arch()
    up, gate = PRODUCERS["up_output"](g), PRODUCERS["gate_output"](g)
    g = _insert_user(g, up)
    after = eliminate_dead_code.run(merge_gate_up.run(g, None), None)
    assert count(g) == 1
    assert f"{up} = linear(h_1, w_up)" in stmts(layer(after).body)
    assert f"t_silu = silu({gate})" not in stmts(layer(after).body)
    assert not [n for n in layer(after).body if n.op == "silu" or gate in n.outs]  # the gate path is gone
    assert_same_logits(g, after)


def test_declines_different_inputs(bind_arch):
    g = bind_arch()
    up = linear_over(g, "w_up")
    g = with_body(g, [n.replace(ins=("x_1", "w_up")) if n is up else n for n in layer(g).body])
    verify(g)
    assert count(g) == 0


@pytest.mark.parametrize("fields", [{}, {"mlp_bias": True}], ids=["plain", "mlp_bias"])
def test_numerics(bind_arch, assert_same_logits, fields):
    before = bind_arch(**fields)
    after = merge_gate_up.run(before, None)
    assert_same_logits(before, after)
    assert_same_logits(before, eliminate_dead_code.run(after, None))


def test_moe_shared_expert_merges(bind_arch, assert_same_logits, loc_of):
    """Qwen2-MoE's shared expert is a gated MLP too: its gate/up merge; the routed experts are fuse_moe's."""
    before = bind_arch("Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                       shared_expert_intermediate_size=48)
    after = eliminate_dead_code.run(merge_gate_up.run(before, None), None)
    verify(after)
    assert count(before) == 1 and count(after) == 0
    body = stmts(layer(after).body)
    at = body.index("gate_up = linear(h_1, ws_gate_up)")
    assert body[at + 1:at + 3] == ["t_mul = silu_mul(gate_up)", "s = linear(t_mul, ws_down)"]
    assert [n.loc for n in layer(after).body[at:at + 2]] == [loc_of("- s = linear(mul(silu(linear(h, ws_gate))")] * 2
    assert "y = experts(h_1, r_w, r_ids, we_gate, we_up, we_down)" in body
    w = layer(after).weights["ws_gate_up"]
    assert (w.shape, w.segments, w.hf) == ((96, 64), (48, 48), ("model.layers.{i}.mlp.shared_expert.gate_proj.weight",
                                                                 "model.layers.{i}.mlp.shared_expert.up_proj.weight"))
    assert_same_logits(before, after)


# --- mutation sweep additions --------------------------------------------------------

def test_declines_a_gate_other_than_silu(bind_arch):
    """mul(sigmoid(gate), up) is not SiLU-and-mul: the rewrite to silu_mul would change the math."""
    g = bind_arch()
    g = with_body(g, [n.replace(op="sigmoid") if n.op == "silu" else n for n in layer(g).body])
    verify(g)
    assert count(g) == 0
    assert merge_gate_up.run(g, None) == g


def test_declines_biases_that_are_computed_values(bind_arch):
    """Biases computed in the layer (not weights) cannot be concatenated by the loader: no merge."""
    g = bind_arch(mlp_bias=True)
    gate, up = linear_over(g, "w_gate"), linear_over(g, "w_up")
    body = []
    for n in layer(g).body:
        if n is gate or n is up:
            b = n.ins[2]
            body.append(Node("silu", (f"{b}_act",), (b,), {}, "test:1"))
            n = n.replace(ins=n.ins[:2] + (f"{b}_act",))
        body.append(n)
    g = with_body(g, body)
    verify(g)
    assert count(g) == 0
    assert merge_gate_up.run(g, None) == g
