"""The YAML dump is the IR: ``load_graph(dump_graph(g)) == g`` for every architecture, bound and compiled."""

from __future__ import annotations

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.ir import Graph, Node, QuantSpec, Repeat, ShardSpec, Sym, TensorType, Weight, dump_graph, load_graph, verify

CASES = {
    "llama_gqa": ("LlamaForCausalLM", {}),
    "qwen2_qkv_bias": ("Qwen2ForCausalLM", {}),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "tied_embeddings": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "all_biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "sliding_window": ("MistralForCausalLM", {"sliding_window": 8}),
    "moe_shared_expert": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 40, "shared_expert_intermediate_size": 48}),
    "moe_qk_norm_full": ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.fixture(params=sorted(CASES))
def bound(request, bind_arch):
    arch, fields = CASES[request.param]
    return bind_arch(arch, **fields)


def test_round_trip_bound(bound):
    text = dump_graph(bound)
    back = load_graph(text)
    assert back == bound
    assert dump_graph(back) == text


def test_round_trip_compiled(bound):
    compiled = compile_graph(bound, BuildOptions())
    back = load_graph(dump_graph(compiled))
    assert back == compiled
    assert all(n.attrs["kernel"].startswith("torch_ref.") for n, _ in back.nodes())


def test_dump_annotates_types_and_locations(bind_arch, loc_of):
    text = dump_graph(bind_arch())
    assert f"- x = embedding(tokens, embed)  # [T, 64] float32  <- {loc_of('- x = embedding(tokens, embed)')}" in text
    assert "layer=i" in text  # the repeat index stays symbolic
    plain = dump_graph(bind_arch(), comments=False)
    assert "  # " not in plain and "<- " not in plain


def test_round_trip_preserves_every_field():
    """Fields the Llama graph never sets: quant, replicated shard, init, a Sym attr, empty weights, ignore."""
    w = Weight("w", (8, 4), "bfloat16", ("a.weight",), init="ones", shard=ShardSpec("replicated"),
               quant=QuantSpec("fp8_e4m3", "channel"))
    layer_w = Weight("l.{j}.w", (8, 4), "float32", ("h.{j}.a", "h.{j}.b"), segments=(5, 3),
                     shard=ShardSpec("column", (5, 3)))
    g = Graph(family="toy", dtype="bfloat16", config={"eps": 1e-6, "flag": None, "spec": {"a": [1, 2]}},
              inputs={"x": TensorType(("T", 4), "float32"), "pos": TensorType(("T",), "int64")},
              weights={"w": w},
              body=(Node("linear", ("y",), ("x", "w"), {}, "toy.yaml:3"),
                    Repeat(3, "j", {"lw": layer_w},
                           (Node("linear", ("z",), ("x", "lw", None), {}, "toy.yaml:5"),
                            Node("split", ("p", "q"), ("z",), {"sizes": [5, 3]}, "toy.yaml:6"),
                            Node("attention", ("o",), ("p", "p", "p"), {"scale": 0.5, "layer": Sym("j")}, "")),
                           {}, "toy.yaml:4")),
              outputs=("y",), ignore=("unused.{i}.x", "other"), source="toy.yaml")
    back = load_graph(dump_graph(g))
    assert back == g
    assert back.body[1].body[2].attrs["layer"] == Sym("j")


def test_loaded_graph_verifies(bound):
    assert verify(load_graph(dump_graph(bound))) == verify(bound)


def _fp8(bind_arch):
    g = bind_arch(intermediate_size=128)  # a rank's gate rows: whole 64-row blocks, so interleave_gate_up applies
    return compile_graph(g, BuildOptions(quant="fp8"))


def test_round_trip_compiled_fp8(bind_arch):
    compiled = _fp8(bind_arch)
    assert any(w.interleave for r in compiled.repeats() for w in r.weights.values())
    back = load_graph(dump_graph(compiled))
    assert back == compiled


def _toy(weights: dict, attrs: dict | None = None, tied=()) -> Graph:
    return Graph(family="toy", dtype="bfloat16", config={}, inputs={"x": TensorType(("T", 4), "float32")},
                 weights=weights, body=(Node("linear", ("y",), ("x", next(iter(weights))), attrs or {}, "toy.yaml:3"),),
                 outputs=("y",), source="toy.yaml", tied=tied)


def test_round_trip_preserves_quant_shard_and_expert_fields():
    """The fields fp8, tensor parallelism and experts set: prequantized scales, a shard's unit and expressions, a
    weight --quant leaves alone, an expert stack, interleaved rows."""
    weights = {
        "w": Weight("w", (8, 4), "float8_e4m3fn", ("a.weight",), shard=ShardSpec("column", (), 4, ("head_dim",)),
                    quant=QuantSpec("fp8_e4m3", "block128", prequantized=True), interleave=64),
        "w_scale": Weight("w_scale", (1, 1), "float32", ("a.weight_scale_inv",), scale_of="w"),
        "router": Weight("router", (4, 4), "bfloat16", ("r.weight",), quantize=False),
        "experts": Weight("experts", (2, 4, 4), "bfloat16", ("e.{e}.weight",), stack="e"),
    }
    g = _toy(weights)
    back = load_graph(dump_graph(g))
    assert back == g
    assert back.weights["w"].quant.prequantized and back.weights["w"].shard.exprs == ("head_dim",)
    assert back.weights["router"].quantize is False


@pytest.mark.parametrize("value", ["a #b", "a#b", "k: v", "say \"hi\"", "it's", "- item", "[1", "x <- y", "{a", "*ref"])
def test_round_trip_of_string_attributes_yaml_would_misread(value):
    """A statement whose text YAML would read otherwise (a comment, a mapping, a flow sequence, an alias, the
    location marker) is quoted in the dump and reads back as it was, its location too."""
    g = _toy({"w": Weight("w", (4, 4), "float32", ("a.weight",))}, {"kernel": value, "note": "plain"})
    text = dump_graph(g)
    back = load_graph(text)
    assert back == g and back.body[0].loc == "toy.yaml:3"
    assert dump_graph(back) == text


def test_round_trip_of_tied_weights():
    w = {"embed": Weight("embed", (4, 4), "float32", ("e.weight",)), "head": Weight("head", (4, 4), "float32", ("e.weight",))}
    tied = _toy(w, tied=(("head", "embed"),))
    assert load_graph(dump_graph(tied)) == tied
    assert "tied:" in dump_graph(tied) and "tied:" not in dump_graph(_toy(w))  # absent from untied graphs' dumps


def test_a_graph_that_does_not_verify_still_dumps_with_its_locations():
    """--dump-ir is for debugging passes, so a graph the verifier refuses (here a linear of mismatched widths) dumps
    all the same, without type comments, and reads back with each node's location."""
    g = Graph(family="toy", dtype="float32", config={}, inputs={"x": TensorType(("T", 3), "float32")},
              weights={"w": Weight("w", (8, 4), "float32", ("a.weight",))},
              body=(Node("linear", ("y",), ("x", "w"), {}, "toy.yaml:7"),), outputs=("y",), source="toy.yaml")
    with pytest.raises(ValueError):
        verify(g)
    text = dump_graph(g)
    (line,) = [ln for ln in text.splitlines() if "linear(x, w)" in ln]
    assert line.endswith("<- toy.yaml:7") and "float32" not in line  # a location, no type
    back = load_graph(text)
    assert back == g and back.body[0].loc == "toy.yaml:7"
