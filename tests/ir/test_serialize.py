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
