"""Binding llama.yaml: `when` weights and blocks, `tied_to`, SSA renaming and loop carries."""

from __future__ import annotations

from mxc.ir import Repeat, ShardSpec, Weight, verify


def layer(graph) -> Repeat:
    (rep,) = graph.repeats()
    return rep


def ops(nodes) -> list[tuple[str, tuple]]:
    return [(n.op, n.ins) for n in nodes]


def test_llama_layer_structure(bind_arch):
    g = bind_arch()
    rep = layer(g)
    assert (rep.count, rep.index, rep.carry, rep.loc) == (2, "i", {"x": "x_2"}, "llama.yaml:40")
    assert set(rep.weights) == {"ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down"}
    assert rep.weights["wk"] == Weight("layers.{i}.wk", (32, 64), "float32",
                                       ("model.layers.{i}.self_attn.k_proj.weight",), shard=ShardSpec("column", unit=16, exprs=("num_key_value_heads*head_dim",)))
    assert rep.weights["ln1"].init == "ones"
    # trailing absent optional inputs (disabled biases) are dropped
    assert ("linear", ("h", "wq")) in ops(rep.body)
    assert not [n for n in rep.body if n.op == "rms_norm" and n.ins[0] in ("q", "k")]
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


def test_when_block_qk_norm(bind_arch):
    g = bind_arch("Qwen3ForCausalLM", head_dim=32)
    rep = layer(g)
    assert rep.weights["q_norm"].shape == (32,) and rep.weights["k_norm"].init == "ones"
    assert rep.weights["wq"].shape == (128, 64)  # head_dim from config, not hidden/heads
    norms = [(n.outs, n.ins) for n in rep.body if n.op == "rms_norm" and n.ins[1] in ("q_norm", "k_norm")]
    assert norms == [(("q_1",), ("q", "q_norm")), (("k_1",), ("k", "k_norm"))]
    rope = next(n for n in rep.body if n.op == "rope")
    assert rope.ins == ("q_1", "k_1", "positions") and rope.outs == ("q_2", "k_2")
    assert verify(g)["a"].shape == ("T", 4, 32)
    # the block's statements keep their own lines
    assert [n.loc for n in rep.body if n.outs in (("q_1",), ("k_1",))] == ["llama.yaml:67", "llama.yaml:68"]


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


def test_ssa_names_and_locations(bind_arch):
    g = bind_arch()
    outs = [o for n, _ in g.nodes() for o in n.outs]
    assert len(outs) == len(set(outs))
    assert g.body[0].outs == ("x",) and g.body[0].loc == "llama.yaml:39"
    gather = g.body[2]
    assert gather.op == "gather_rows" and gather.ins == ("x", "logit_rows") and gather.outs == ("x_3",)
    # nested calls become named temporaries on the statement's line
    rep = layer(g)
    assert [n.loc for n in rep.body if n.op in ("flatten_heads", "add")][:2] == ["llama.yaml:71"] * 2


def test_overrides_and_registry_settings(bind_arch):
    """The registry's `set` wins over config.json (Qwen2 forces qkv_bias on, o_bias off)."""
    rep = layer(bind_arch("Qwen2ForCausalLM", attention_bias=False, qkv_bias=False, o_bias=True))
    assert "bq" in rep.weights and "bo" not in rep.weights


def test_rope_spec_is_resolved(bind_arch):
    g = bind_arch(rope_theta=500000.0)
    rope = next(n for n in layer(g).body if n.op == "rope")
    assert rope.attrs["spec"]["theta"] == 500000.0 and rope.attrs["spec"]["rotary_dim"] == 16
    assert g.config["rope"] == rope.attrs["spec"]
