"""IR graph helpers: ``map_bodies`` (top level and every repeat body, inputs left untouched) and
``all_weights`` (every concrete weight, layers expanded, in artifact order)."""

from __future__ import annotations

from mxc.ir import Node, Weight, map_bodies


def test_map_bodies_applies_fn_to_top_level_and_repeat_and_keeps_the_input(bind_arch):
    graph = bind_arch()
    (rep,) = graph.repeats()
    before_top, before_layer = dict(graph.weights), dict(rep.weights)
    extra = Weight("extra", (4,), "float32", ("extra.weight",))
    added = Weight("added", (2,), "float32", ("added.weight",))
    calls = []

    def fn(nodes, weights):
        calls.append(len(nodes))
        weights["extra"] = extra  # in place: map_bodies hands fn copies
        return tuple(n.replace(loc="here") for n in nodes), {**weights, "added": added}  # a new dict: it is used

    out = map_bodies(graph, fn)
    groups = sum(1 for i, it in enumerate(graph.body)  # each repeat, and each run of top-level nodes
                 if not isinstance(it, Node) or i == 0 or not isinstance(graph.body[i - 1], Node))
    assert len(calls) == groups == 3 and sum(calls) == sum(1 for _ in graph.nodes())
    assert out.weights == {**before_top, "extra": extra, "added": added}
    assert out.repeats()[0].weights == {**before_layer, "extra": extra, "added": added}
    assert [type(it) for it in out.body] == [type(it) for it in graph.body]  # the repeat stays where it was
    assert all(n.loc == "here" for n, _ in out.nodes())
    assert graph.weights == before_top and rep.weights == before_layer  # the input graph is unchanged


def test_all_weights_top_level_first_then_each_layer_in_order(bind_arch):
    graph = bind_arch()
    (rep,) = graph.repeats()
    names = [w.name for w in graph.all_weights()]
    layer = lambda i: [w.name.replace("{" + rep.index + "}", str(i)) for w in rep.weights.values()]
    assert names == list(graph.weights) + [n for i in range(rep.count) for n in layer(i)]
    assert rep.count == 2 and len(set(names)) == len(names)
