"""eliminate_dead_code: unused nodes and weights go; outputs, carries and what they need stay."""

from __future__ import annotations

from mxc.compiler.passes import eliminate_dead_code
from mxc.ir import Graph, Node, Repeat, TensorType, Weight, verify


def dce(graph: Graph) -> Graph:
    out = eliminate_dead_code.run(graph, None)
    verify(out)
    return out


def layer(graph: Graph) -> Repeat:
    (rep,) = graph.repeats()
    return rep


def add_dead_code(graph: Graph) -> Graph:
    """The bound graph plus: a dead chain in the layer reading a dead top-level node, unused weights."""
    rep = layer(graph)
    spare = Weight("layers.{i}.spare", (64,), "float32", ("model.layers.{i}.spare",))
    body = list(rep.body)
    body.insert(1, Node("silu", ("dead",), ("h",), {}, "test:1"))
    body.insert(2, Node("add", ("dead_1",), ("dead", "pre"), {}, "test:2"))
    body.append(Node("mul", ("dead_2",), ("x_2", "x_2"), {}, "test:3"))  # reads the carried value; still dead
    new_rep = rep.replace(body=tuple(body), weights={**rep.weights, "spare": spare})
    top = [Node("silu", ("pre",), ("x",), {}, "test:0")]
    tail = [Node("gather_rows", ("unused_rows",), ("x", "logit_rows"), {}, "test:4")]
    items = [graph.body[0], *top, new_rep, *graph.body[2:], *tail]
    weights = {**graph.weights, "unused": Weight("unused", (4, 4), "float32", ("unused.weight",))}
    g = graph.replace(body=tuple(items), weights=weights)
    verify(g)
    return g


def test_clean_graph_is_unchanged(bind_arch):
    g = bind_arch()
    assert dce(g) == g
    assert dce(bind_arch("Qwen3ForCausalLM")) == bind_arch("Qwen3ForCausalLM")


def test_removes_dead_nodes_and_weights(bind_arch):
    g = bind_arch()
    dirty = add_dead_code(g)
    assert dce(dirty) == g  # exactly what was added is removed: nodes, layer weight, top-level weight
    assert dce(dce(dirty)) == g


def test_keeps_carries_and_outputs(bind_arch):
    g = dce(add_dead_code(bind_arch()))
    assert layer(g).carry == {"x": "x_2"}
    assert g.outputs == ("logits",)
    # x_2 is read by nobody in the body: only the carry keeps the whole residual stream alive
    assert [n.outs for n in layer(g).body][-1] == ("x_2",)
    assert len(layer(g).body) == len(layer(bind_arch()).body)


def test_drops_weights_of_removed_nodes(bind_arch):
    """Route the logits around the final norm: the norm node and its weight norm_f become dead."""
    g = bind_arch()
    head = g.body[-1].replace(ins=("x_3", "lm_head"))
    out = dce(g.replace(body=(*g.body[:-1], head)))
    assert "norm_f" not in out.weights
    assert [n.op for n in out.body if isinstance(n, Node)] == ["embedding", "gather_rows", "linear"]
    assert layer(out) == layer(g)


def _carry_graph(tail_reads_y: bool) -> Graph:
    """y = silu(x); repeat { y_1 = silu(x) } carry y <- y_1; the body never reads the incoming y."""
    f32 = TensorType(("T", 8), "float32")
    tail = Node("add", ("z",), ("y", "x"), {}, "m:4") if tail_reads_y else Node("silu", ("z",), ("x",), {}, "m:4")
    return Graph("toy", "float32", {}, {"x": f32}, {}, (
        Node("silu", ("y",), ("x",), {}, "m:1"),
        Repeat(2, "i", {}, (Node("silu", ("y_1",), ("x",), {}, "m:3"),), {"y": "y_1"}, "m:2"),
        tail,
    ), ("z",))


def test_carry_read_after_the_loop():
    g = _carry_graph(tail_reads_y=True)
    verify(g)
    assert dce(g) == g


def test_carry_unused_after_the_loop_stays_valid():
    g = _carry_graph(tail_reads_y=False)
    verify(g)
    dce(g)  # verify() inside: 'carry y <- y_1 names an undefined value'


# --- mutation sweep additions --------------------------------------------------------

def test_keeps_a_top_level_value_only_the_loop_reads():
    """t is read only inside the repeat, by the node that makes the carried value: t's producer stays."""
    f32 = TensorType(("T", 8), "float32")
    g = Graph("toy", "float32", {}, {"x": f32}, {}, (
        Node("silu", ("y",), ("x",), {}, "m:1"),
        Node("mul", ("t",), ("x", "x"), {}, "m:2"),
        Repeat(2, "i", {}, (Node("add", ("y_1",), ("y", "t"), {}, "m:4"),), {"y": "y_1"}, "m:3"),
    ), ("y",))
    verify(g)
    assert dce(g) == g


def test_keeps_a_node_with_one_output_read():
    """A multi-output node (a split) stays when any of its outputs is read."""
    f32 = TensorType(("T", 8), "float32")
    g = Graph("toy", "float32", {}, {"x": f32}, {}, (
        Node("split", ("a", "b"), ("x",), {"sizes": [4, 4]}, "m:1"),
        Node("silu", ("z",), ("a",), {}, "m:2"),
    ), ("z",))
    verify(g)
    assert dce(g) == g
