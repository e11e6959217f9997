"""Binding llama.yaml: `when` weights and blocks, `tied_to`, SSA renaming and loop carries."""

from __future__ import annotations

import pytest

from mxc.ir import Repeat, ShardSpec, TensorType, Weight, verify


def layer(graph) -> Repeat:
    (rep,) = graph.repeats()
    return rep


def ops(nodes) -> list[tuple[str, tuple]]:
    return [(n.op, n.ins) for n in nodes]


def after(nodes, op: str, weight: str) -> tuple:
    """The nodes after the one ``op`` node that reads ``weight`` (a block's statements, found by content)."""
    (i,) = [i for i, n in enumerate(nodes) if n.op == op and weight in n.ins]
    return nodes[i + 1:]


def test_llama_layer_structure(bind_arch, loc_of):
    g = bind_arch()
    rep = layer(g)
    assert (rep.count, rep.index, rep.carry, rep.loc) == (2, "i", {"x": "x_2"}, loc_of("- repeat:"))
    assert set(rep.weights) == {"ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down"}
    assert rep.weights["wk"] == Weight("layers.{i}.wk", (32, 64), "float32",
                                       ("model.layers.{i}.self_attn.k_proj.weight",), shard=ShardSpec("column", unit=16, exprs=("num_key_value_heads*head_dim",)))
    assert rep.weights["ln1"].init == "ones"
    # trailing absent optional inputs (disabled biases) are dropped
    assert ("linear", ("h", "wq")) in ops(rep.body)
    # no q/k norm (per head or full): the layer's only norms are its two RMSNorms
    assert [n.ins for n in rep.body if n.op == "rms_norm"] == [("x", "ln1"), ("x_1", "ln2")]
    attn = next(n for n in rep.body if n.op == "attention")
    assert attn.attrs["scale"] == 0.25 and attn.attrs["sliding_window"] is None
    assert g.outputs == ("logits",)
    assert list(g.inputs) == ["tokens", "positions", "logit_rows"]
    verify(g)


def test_when_weights_qkv_bias(bind_arch):
    g = bind_arch("Qwen2ForCausalLM")
    rep = layer(g)
    assert {"bq", "bk", "bv"} <= set(rep.weights) and "bo" not in rep.weights  # registry: o_bias false
    assert rep.weights["bk"].shape == (32,)
    assert rep.weights["bq"].hf == ("model.layers.{i}.self_attn.q_proj.bias",)
    linears = [n.ins for n in rep.body if n.op == "linear"]
    assert linears[:4] == [("h", "wq", "bq"), ("h", "wk", "bk"), ("h", "wv", "bv"), ("t_flatten_heads", "wo")]
    verify(g)


def test_when_block_qk_norm(bind_arch, loc_of):
    g = bind_arch("Qwen3ForCausalLM", head_dim=32)
    rep = layer(g)
    assert rep.weights["q_norm"].shape == (32,) and rep.weights["k_norm"].init == "ones"
    assert rep.weights["wq"].shape == (128, 64)  # head_dim from config, not hidden/heads
    norms = [(n.outs, n.ins) for n in rep.body if n.op == "rms_norm" and n.ins[1] in ("q_norm", "k_norm")]
    # q = linear (q), q = heads (q_1), then the block's q = rms_norm (q_2)
    assert norms == [(("q_2",), ("q_1", "q_norm")), (("k_2",), ("k_1", "k_norm"))]
    rope = next(n for n in rep.body if n.op == "rope")
    assert rope.ins == ("q_2", "k_2", "positions") and rope.outs == ("q_3", "k_3")
    assert verify(g)["a"].shape == ("T", 4, 32)
    # the block's statements keep their own lines
    assert [n.loc for n in rep.body if n.outs in (("q_2",), ("k_2",))] == [
        loc_of("- q = rms_norm(q, q_norm, "), loc_of("- k = rms_norm(k, k_norm, ")]


def test_when_block_qk_norm_full(bind_arch, loc_of):
    """OLMoE normalises the whole q/k projections, before they are split into heads."""
    rep = layer(bind_arch("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2))
    assert rep.weights["q_norm_full"].shape == (64,) and rep.weights["k_norm_full"].shape == (32,)
    assert rep.weights["q_norm_full"].hf == ("model.layers.{i}.self_attn.q_norm.weight",)
    assert "q_norm" not in rep.weights and "k_norm" not in rep.weights
    assert [(n.op, n.outs, n.ins[:2], n.loc) for n in after(rep.body, "linear", "wv")[:5]] == [
        ("rms_norm", ("q_1",), ("q", "q_norm_full"), loc_of("- q = rms_norm(q, q_norm_full, ")),
        ("rms_norm", ("k_1",), ("k", "k_norm_full"), loc_of("- k = rms_norm(k, k_norm_full, ")),
        ("heads", ("q_2",), ("q_1",), loc_of("- q = heads(q, size=head_dim)")),
        ("heads", ("k_2",), ("k_1",), loc_of("- k = heads(k, size=head_dim)")),
        ("heads", ("v_1",), ("v",), loc_of("- v = heads(v, size=head_dim)")),
    ]
    rope = next(n for n in rep.body if n.op == "rope")
    assert rope.ins == ("q_2", "k_2", "positions") and rope.outs == ("q_3", "k_3")


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)


def test_when_block_moe(bind_arch, loc_of):
    """`when: moe` replaces the dense MLP (and its weights) by routing and an expert stack; the nested
    `when` adds Qwen2-MoE's gated shared expert."""
    g = bind_arch("Qwen2MoeForCausalLM", **MOE, shared_expert_intermediate_size=48)
    rep = layer(g)
    assert not {"w_gate", "w_up", "w_down"} & set(rep.weights)
    assert rep.weights["w_router"] == Weight("layers.{i}.w_router", (4, 64), "float32",
                                             ("model.layers.{i}.mlp.gate.weight",), quantize=False)
    we_gate = rep.weights["we_gate"]
    assert (we_gate.shape, we_gate.stack, we_gate.hf) == (
        (4, 40, 64), "e", ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",))
    assert rep.weights["we_down"].shape == (4, 64, 40) and rep.weights["ws_router"].shape == (1, 64)
    routed, gated = loc_of("- r_w, r_ids = route("), loc_of("- y = add(y, scale_rows(s, sigmoid(")
    shared = loc_of("- s = linear(mul(silu(linear(h, ws_gate))")
    assert [(n.outs, n.op, n.ins, n.loc) for n in after(rep.body, "rms_norm", "ln2")] == [
        (("t_linear_1",), "linear", ("h_1", "w_router"), routed),
        (("r_w", "r_ids"), "route", ("t_linear_1",), routed),
        (("y",), "experts", ("h_1", "r_w", "r_ids", "we_gate", "we_up", "we_down"),
         loc_of("- y = experts(h, r_w, r_ids, we_gate, we_up, we_down)")),
        (("t_linear_2",), "linear", ("h_1", "ws_gate"), shared),
        (("t_silu",), "silu", ("t_linear_2",), shared),
        (("t_linear_3",), "linear", ("h_1", "ws_up"), shared),
        (("t_mul",), "mul", ("t_silu", "t_linear_3"), shared),
        (("s",), "linear", ("t_mul", "ws_down"), shared),
        (("t_linear_4",), "linear", ("h_1", "ws_router"), gated),
        (("t_sigmoid",), "sigmoid", ("t_linear_4",), gated),
        (("t_scale_rows",), "scale_rows", ("s", "t_sigmoid"), gated),
        (("y_1",), "add", ("y", "t_scale_rows"), gated),
        (("x_2",), "add", ("x_1", "y_1"), loc_of("- x = add(x, y)")),
    ]
    assert next(n for n in rep.body if n.op == "route").attrs == {"k": 2, "scoring": "softmax", "renormalize": False,
                                                                  "fp32_weights": False}
    assert rep.carry == {"x": "x_2"}
    types = verify(g)
    assert (types["r_w"], types["r_ids"]) == (TensorType(("T", 2), "float32"), TensorType(("T", 2), "int64"))
    assert types["t_sigmoid"] == TensorType(("T", 1), "float32") and types["y_1"] == types["x_1"]


def test_when_block_moe_without_shared_expert(bind_arch):
    """Mixtral: no shared expert; the registry renames the block and the expert projections."""
    g = bind_arch("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    rep = layer(g)
    assert not {"ws_gate", "ws_up", "ws_down", "ws_router"} & set(rep.weights)
    assert rep.weights["we_down"].hf == ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",)
    assert rep.weights["we_down"].shape == (4, 64, 96)  # moe_intermediate_size defaults to intermediate_size
    assert [n.op for n in after(rep.body, "rms_norm", "ln2")] == ["linear", "route", "experts", "add"]
    assert next(n for n in rep.body if n.op == "route").attrs["renormalize"] is True  # norm_topk_prob
    assert rep.body[-1].ins == ("x_1", "y") and rep.carry == {"x": "x_2"}
    assert verify(g)["y"] == verify(g)["x_1"]


@pytest.mark.parametrize("arch, fp32", [("MixtralForCausalLM", True), ("Qwen3MoeForCausalLM", False),
                                        ("Qwen2MoeForCausalLM", False), ("OlmoeForCausalLM", False)])
def test_routing_weights_dtype(bind_arch, arch, fp32):
    """Mixtral's routing weights stay float32 (transformers' MixtralTopKRouter does not cast them back to the
    logits' dtype; the other MoE routers do): in a bf16 graph its route's weights are float32, the others' bf16."""
    g = bind_arch(arch, dtype="bfloat16", num_experts=4, num_local_experts=4, num_experts_per_tok=2)
    route = next(n for n in layer(g).body if n.op == "route")
    assert route.attrs["fp32_weights"] is fp32
    types = verify(g)
    assert types[route.outs[0]] == TensorType(("T", 2), "float32" if fp32 else "bfloat16")
    assert types[route.outs[1]].dtype == "int64" and types["y"].dtype == "bfloat16"


def test_all_biases(bind_arch):
    rep = layer(bind_arch(attention_bias=True, mlp_bias=True))
    linears = [n.ins for n in rep.body if n.op == "linear"]
    assert [ins[2] for ins in linears] == ["bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down"]


def test_tied_embeddings(bind_arch):
    g = bind_arch(tie_word_embeddings=True)
    assert "lm_head" not in g.weights
    assert "lm_head.weight" in g.ignore
    head = g.body[-1]
    assert head.op == "linear" and head.outs == ("logits",) and head.ins[1] == "embed"
    assert [w.name for w in g.all_weights()].count("embed") == 1
    verify(g)


def test_untied_embeddings(bind_arch):
    g = bind_arch()
    assert g.weights["lm_head"].hf == ("lm_head.weight",)
    assert g.weights["lm_head"].shard == ShardSpec("vocab", exprs=("vocab_size",))
    assert "lm_head.weight" not in g.ignore
    assert g.body[-1].ins[1] == "lm_head"


def test_ssa_names_and_locations(bind_arch, loc_of):
    g = bind_arch()
    outs = [o for n, _ in g.nodes() for o in n.outs]
    assert len(outs) == len(set(outs))
    assert g.body[0].outs == ("x",) and g.body[0].loc == loc_of("- x = embedding(tokens, embed)")
    gather = g.body[2]
    assert gather.op == "gather_rows" and gather.ins == ("x", "logit_rows") and gather.outs == ("x_3",)
    # nested calls become named temporaries on the statement's line
    rep = layer(g)
    assert [n.loc for n in rep.body if n.op in ("flatten_heads", "add")][:2] == [
        loc_of("- x = add(x, linear(flatten_heads(a), wo, bo))")] * 2
    # a rebound name gets the next free suffix: q = linear(...) is q, the q = heads(q) after it writes q_1
    assert [(n.op, n.outs, n.ins[0], n.loc) for n in after(rep.body, "rms_norm", "ln1")[:6]] == [
        ("linear", ("q",), "h", loc_of("- q = linear(h, wq, bq)")),
        ("linear", ("k",), "h", loc_of("- k = linear(h, wk, bk)")),
        ("linear", ("v",), "h", loc_of("- v = linear(h, wv, bv)")),
        ("heads", ("q_1",), "q", loc_of("- q = heads(q, size=head_dim)")),
        ("heads", ("k_1",), "k", loc_of("- k = heads(k, size=head_dim)")),
        ("heads", ("v_1",), "v", loc_of("- v = heads(v, size=head_dim)")),
    ]


def test_overrides_and_registry_settings(bind_arch):
    """The registry's `set` wins over config.json (Qwen2 forces qkv_bias on, o_bias off)."""
    rep = layer(bind_arch("Qwen2ForCausalLM", attention_bias=False, qkv_bias=False, o_bias=True))
    assert "bq" in rep.weights and "bo" not in rep.weights


def test_rope_spec_is_resolved(bind_arch):
    g = bind_arch(rope_theta=500000.0)
    rope = next(n for n in layer(g).body if n.op == "rope")
    assert rope.attrs["spec"]["theta"] == 500000.0 and rope.attrs["spec"]["rotary_dim"] == 16
    assert g.config["rope"] == rope.attrs["spec"]


def test_shard_exprs_name_the_split_dim(bind_arch):
    """ShardSpec.exprs: the model file's expression for the split dim (row: dim 1; a stack's dims after the expert
    dim), named as the config sets it (Mixtral's moe_intermediate_size is its intermediate_size)."""
    rep = layer(bind_arch())
    assert rep.weights["wo"].shard == ShardSpec("row", unit=16, exprs=("num_attention_heads*head_dim",))
    assert rep.weights["w_down"].shard == ShardSpec("row", exprs=("intermediate_size",))
    rep = layer(bind_arch("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2))
    assert rep.weights["we_gate"].shard == ShardSpec("column", exprs=("intermediate_size",))
    assert rep.weights["we_down"].shard == ShardSpec("row", exprs=("intermediate_size",))
    rep = layer(bind_arch("Qwen2MoeForCausalLM", **MOE))
    assert rep.weights["we_up"].shard == ShardSpec("column", exprs=("moe_intermediate_size",))


def test_replicated_shard_has_no_split_expr(tmp_path, llama_text, bind_arch):
    path = tmp_path / "m.yaml"
    path.write_text(llama_text.replace("hf: model.norm.weight, init: ones}", "hf: model.norm.weight, init: ones, "
                                                                         "shard: replicated}"))
    assert bind_arch(model_file=path).weights["norm_f"].shard == ShardSpec("replicated")  # nothing splits


def test_tied_records_names(bind_arch):
    """Graph.tied: (the tied weight's checkpoint name, the one it reuses, its tied_if)."""
    assert bind_arch(tie_word_embeddings=True).tied == (("lm_head.weight", "model.embed_tokens.weight",
                                                         "tie_word_embeddings"),)


def test_null_config_field_takes_the_default(bind_arch):
    """A null in config.json (Mistral-style ``"head_dim": null``) is absent: the model file's default applies."""
    assert layer(bind_arch(head_dim=None)).weights["wq"].shape == (64, 64)  # head_dim = hidden_size // heads


def test_input_without_dtype_takes_the_graph_dtype(tmp_path, llama_text, bind_arch):
    path = tmp_path / "m.yaml"
    path.write_text(llama_text.replace("logit_rows: {shape: [R], dtype: int64}", "logit_rows: {shape: [R]}"))
    g = bind_arch(model_file=path, dtype="bfloat16")
    assert g.inputs["logit_rows"] == TensorType(("R",), "bfloat16")
