"""The verifier: values defined once before use, every op's rule, carries keep their type,
and each error names the node and its model-file location."""

from __future__ import annotations

import re

import pytest

from mxc.ir import Graph, Node, Repeat, TensorType, Weight, VerifyError, verify


def tt(*shape, dtype="float32"):
    return TensorType(tuple(shape), dtype)


def edit_layer(graph: Graph, fn) -> Graph:
    """``graph`` with its (single) repeat body replaced by ``fn(list of nodes)``; returns the new graph."""
    (i, rep), = [(i, it) for i, it in enumerate(graph.body) if isinstance(it, Repeat)]
    body = list(graph.body)
    body[i] = rep.replace(body=tuple(fn(list(rep.body))))
    return graph.replace(body=tuple(body))


def find(nodes, out: str) -> int:
    return next(i for i, n in enumerate(nodes) if out in n.outs)


def find_linear(nodes, weight: str) -> int:
    """Index of the one linear over ``weight`` (found by what it computes, not by its SSA name or position)."""
    (i,) = [i for i, n in enumerate(nodes) if n.op == "linear" and n.ins[1] == weight]
    return i


def test_bound_graph_types(bind_arch):
    types = verify(bind_arch())
    assert types["x"] == tt("T", 64)
    assert types["q_1"] == tt("T", 4, 16) and types["k_1"] == tt("T", 2, 16)
    assert types["m"] == tt("T", 96)
    assert types["logits"] == tt("R", 256)


def test_undefined_input(bind_arch, loc_of):
    def edit(nodes):
        i = find(nodes, "h")
        nodes[i] = nodes[i].replace(ins=("nowhere", "ln1"))
        return nodes

    at = loc_of("- h = rms_norm(x, ln1, ")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: rms_norm -> h: input 'nowhere' is not defined")):
        verify(edit_layer(bind_arch(), edit))


def test_use_before_definition(bind_arch, loc_of):
    def edit(nodes):  # move `m = mul(...)` above the linears it reads
        i = find(nodes, "m")
        return [nodes[i]] + nodes[:i] + nodes[i + 1:]

    at = loc_of("- m = mul(silu(linear(h, w_gate, b_gate))")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: mul -> m: input 't_silu' is not defined")):
        verify(edit_layer(bind_arch(), edit))


def test_redefined_value(bind_arch, loc_of):
    def edit(nodes):  # the down projection writes `h` again
        i = find_linear(nodes, "w_down")
        nodes[i] = nodes[i].replace(outs=("h",))
        return nodes

    at = loc_of("- x = add(x, linear(m, w_down, b_down))")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: linear -> h: 'h' is defined twice")):
        verify(edit_layer(bind_arch(), edit))


def test_value_shadowing_a_weight(bind_arch):
    def edit(nodes):
        i = find(nodes, "h")
        nodes[i] = nodes[i].replace(outs=("wq",))
        return nodes

    with pytest.raises(VerifyError, match="'wq' is defined twice"):
        verify(edit_layer(bind_arch(), edit))


def test_linear_weight_k_mismatch(bind_arch, loc_of):
    g = bind_arch()
    rep = g.repeats()[0]
    wo = rep.weights["wo"]
    bad_rep = rep.replace(weights={**rep.weights, "wo": Weight(wo.name, (64, 48), wo.dtype, wo.hf, shard=wo.shard)})
    g = g.replace(body=tuple(bad_rep if it is rep else it for it in g.body))
    with pytest.raises(VerifyError) as e:
        verify(g)
    msg = str(e.value)
    assert rep.body[find_linear(list(rep.body), "wo")].outs == ("t_linear",)  # the first unnamed linear
    at = loc_of("- x = add(x, linear(flatten_heads(a), wo, bo))")
    assert msg.startswith(f"{at}: linear -> t_linear: ")
    assert "disagree on K" in msg and "[64, 48] float32" in msg


def test_top_level_shape_mismatch():
    g = Graph("toy", "float32", {}, {"x": tt("T", 8)}, {"w": Weight("w", (4, 6), "float32", ("w",))},
              (Node("linear", ("y",), ("x", "w"), {}, "toy.yaml:7"),), ("y",))
    with pytest.raises(VerifyError, match=r"^toy\.yaml:7: linear -> y: x \[T, 8\] float32 and weight \[4, 6\] "):
        verify(g)


def test_carry_changing_type(bind_arch, loc_of):
    g = bind_arch()
    rep = g.repeats()[0]
    g = g.replace(body=tuple(rep.replace(carry={"x": "a"}) if it is rep else it for it in g.body))
    at = loc_of("- repeat:")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: carry x [T, 64] float32 <- a [T, 4, 16] "
                                                    "float32 changes type")):
        verify(g)


def test_carry_of_undefined_value(bind_arch, loc_of):
    g = bind_arch()
    rep = g.repeats()[0]
    g = g.replace(body=tuple(rep.replace(carry={"x": "x_9"}) if it is rep else it for it in g.body))
    at = loc_of("- repeat:")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: carry x <- x_9 names an undefined value")):
        verify(g)


def test_unknown_op_and_wrong_output_count(bind_arch, loc_of):
    def unknown(nodes):
        i = find(nodes, "t_silu")
        nodes[i] = nodes[i].replace(op="gelu")
        return nodes

    at = loc_of("- m = mul(silu(linear(h, w_gate, b_gate))")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: gelu -> t_silu: unknown op 'gelu'")):
        verify(edit_layer(bind_arch(), unknown))

    def one_out(nodes):
        i = next(i for i, n in enumerate(nodes) if n.op == "rope")
        assert nodes[i].outs == ("q_2", "k_2")
        nodes[i] = nodes[i].replace(outs=("q_2",))
        return nodes

    at = loc_of("- q, k = rope(q, k, positions, ")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: rope -> q_2: op gives 2 outputs, node names 1")):
        verify(edit_layer(bind_arch(), one_out))


def test_rule_attribute_errors_name_the_node(bind_arch, loc_of):
    def edit(nodes):
        i = find(nodes, "h")
        nodes[i] = nodes[i].replace(attrs={"eps": 1e-5, "epsilon": 1e-5})
        return nodes

    at = loc_of("- h = rms_norm(x, ln1, ")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: rms_norm -> h: unknown attribute(s) epsilon")):
        verify(edit_layer(bind_arch(), edit))


def test_undefined_output(bind_arch):
    with pytest.raises(VerifyError, match="output 'logitz' is not defined"):
        verify(bind_arch().replace(outputs=("logitz",)))


def test_weight_table_checks(bind_arch, loc_of):
    g = bind_arch()
    rep = g.repeats()[0]

    def with_weights(**ws):
        r = rep.replace(weights={**rep.weights, **ws})
        return g.replace(body=tuple(r if it is rep else it for it in g.body))

    wq = rep.weights["wq"]
    with pytest.raises(VerifyError, match=r"two weights are stored as 'layers\.0\.wq'"):
        verify(with_weights(wq2=wq))
    with pytest.raises(VerifyError, match=r"segments \[60, 2\] do not add up to 64 rows"):
        verify(with_weights(wq=Weight(wq.name, wq.shape, wq.dtype, ("a", "b"), segments=(60, 2))))
    with pytest.raises(VerifyError, match="2 sources but 0 segments"):
        verify(with_weights(wq=Weight(wq.name, wq.shape, wq.dtype, ("a", "b"))))
    at = loc_of("- repeat:")
    with pytest.raises(VerifyError, match=re.escape(f"{at}: repeat weight(s) ['embed'] shadow top-level")):
        verify(with_weights(embed=Weight("layers.{i}.embed", (4,), "float32", ("e",))))


def test_interleave_of_partial_blocks_is_refused(bind_arch):
    """An interleaved weight (gate/up rows in alternating blocks) must hold whole pairs of blocks."""
    from dataclasses import replace

    from mxc.compiler.options import BuildOptions
    from mxc.compiler.pipeline import compile_graph

    compiled = compile_graph(bind_arch(intermediate_size=128), BuildOptions(quant="fp8"))
    (rep,) = compiled.repeats()
    name, w = next((k, w) for k, w in rep.weights.items() if w.interleave and not w.scale_of)
    bad = replace(w, interleave=w.shape[0] // 2 + 1)  # 2 * interleave does not divide the rows
    broken = compiled.replace(body=tuple(it.replace(weights={**it.weights, name: bad}) if it is rep else it
                                         for it in compiled.body))
    with pytest.raises(VerifyError, match="whole blocks"):
        verify(broken)


def test_inputs_of_another_form_name_the_node(bind_arch):
    """A rule that cannot even read its inputs (here 2-D router weights where the experts' [E, rows, K] stacks go) is a
    VerifyError at the node, with the inputs, not a bare unpacking error."""
    def router_as_stacks(nodes):
        i = next(i for i, n in enumerate(nodes) if n.op == "experts")
        router = next(n for n in nodes if n.op == "linear" and "router" in n.ins[1]).ins[1]
        nodes[i] = nodes[i].replace(ins=nodes[i].ins[:3] + (router, router, router))
        return nodes

    g = bind_arch("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)
    with pytest.raises(VerifyError) as e:
        verify(edit_layer(g, router_as_stacks))
    msg = str(e.value)
    assert re.match(r"llama\.yaml:\d+: experts -> \w+: inputs \(.*\[4, 64\] float32.*\) do not have the form the op "
                    r"takes \(ValueError: ", msg), msg
    assert "\n" not in msg
