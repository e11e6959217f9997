"""merge_qkv: before/after structure, match count, when it declines, and the numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mxc.compiler.passes import merge_qkv
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node, QuantSpec, ShardSpec, TensorType, Weight, verify
from mxc.ir.statements import format_statement
from mxc.loaders.dummy import DummyCheckpoint


def stmts(nodes) -> list[str]:
    """Nodes as model-file statements, without dict-valued attrs (the RoPE spec) and kernel attrs."""
    return [format_statement(n.outs, n.op, n.ins, {k: v for k, v in n.attrs.items()
                                                     if not isinstance(v, dict) and not k.startswith("kernel")})
            for n in nodes]


def layer(graph: Graph):
    (rep,) = graph.repeats()
    return rep


def with_layer(graph: Graph, **changes) -> Graph:
    rep = layer(graph)
    return graph.replace(body=tuple(rep.replace(**changes) if it is rep else it for it in graph.body))


def count(graph: Graph) -> int:
    return apply_rules(graph, [("attention", merge_qkv._match)])[1]


def n_linears(nodes) -> int:
    return sum(n.op == "linear" for n in nodes)


BEFORE = [
    "h = rms_norm(x, ln1, eps=1e-05)",
    "q = linear(h, wq)",
    "k = linear(h, wk)",
    "v = linear(h, wv)",
    "q_1 = heads(q, size=16)",
    "k_1 = heads(k, size=16)",
    "v_1 = heads(v, size=16)",
    "q_2, k_2 = rope(q_1, k_1, positions)",
    "a = attention(q_2, k_2, v_1, scale=0.25, layer=i, sliding_window=None)",
]
AFTER = [  # the split keeps the projections' names: the rest of the layer reads them unchanged
    "h = rms_norm(x, ln1, eps=1e-05)",
    "qkv = linear(h, wqkv)",
    "q, k, v = split(qkv, sizes=[64, 32, 32])",
    "q_1 = heads(q, size=16)",
    "k_1 = heads(k, size=16)",
    "v_1 = heads(v, size=16)",
    "q_2, k_2 = rope(q_1, k_1, positions)",
    "a = attention(q_2, k_2, v_1, scale=0.25, layer=i, sliding_window=None)",
]


QKV_EXPRS = ("num_attention_heads*head_dim", "num_key_value_heads*head_dim", "num_key_value_heads*head_dim")


def test_llama_before_after(bind_arch, loc_of):
    before = bind_arch()
    after = merge_qkv.run(before, None)
    verify(after)
    b, a = layer(before), layer(after)
    assert stmts(b.body)[:len(BEFORE)] == BEFORE
    assert stmts(a.body)[:len(AFTER)] == AFTER
    assert a.body[len(AFTER):] == b.body[len(BEFORE):]  # the rest of the layer is untouched
    assert [n.loc for n in a.body[1:3]] == [loc_of("- q = linear(h, wq, bq)")] * 2  # the first projection's
    assert after.body[0] == before.body[0] and after.body[2:] == before.body[2:]
    assert after.weights == before.weights and a.carry == b.carry
    # the merged weight declares its parts; the originals stay until eliminate_dead_code
    assert a.weights == {**b.weights, "wqkv": Weight(
        "layers.{i}.wqkv", (128, 64), "float32",
        ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
         "model.layers.{i}.self_attn.v_proj.weight"),
        segments=(64, 32, 32), shard=ShardSpec("column", (64, 32, 32), 16, QKV_EXPRS))}
    assert [w.name for w in after.all_weights() if w.name.endswith("wqkv")] == ["layers.0.wqkv", "layers.1.wqkv"]


def test_match_count(bind_arch):
    before = bind_arch()
    assert count(before) == 1  # one attention per layer body
    after = merge_qkv.run(before, None)
    assert (n_linears(layer(before).body), n_linears(layer(after).body)) == (7, 5)
    assert n_linears(after.body[2:]) == n_linears(before.body[2:]) == 1  # lm_head untouched
    assert count(after) == 0  # idempotent
    assert merge_qkv.run(after, None) == after


def test_pass_is_pure(bind_arch):
    before = bind_arch()
    merge_qkv.run(before, None)
    assert before == bind_arch()


def test_qwen2_biases_merge(bind_arch):
    before = bind_arch("Qwen2ForCausalLM")
    after = merge_qkv.run(before, None)
    verify(after)
    a = layer(after)
    assert stmts(a.body)[1:3] == ["qkv = linear(h, wqkv, bqkv)", "q, k, v = split(qkv, sizes=[64, 32, 32])"]
    assert a.weights["bqkv"] == Weight(
        "layers.{i}.bqkv", (128,), "float32",
        ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
         "model.layers.{i}.self_attn.v_proj.bias"),
        segments=(64, 32, 32), shard=ShardSpec("column", (64, 32, 32), 16, QKV_EXPRS))
    assert count(before) == 1


def test_qwen3_traces_through_qk_norm(bind_arch):
    before = bind_arch("Qwen3ForCausalLM", head_dim=32)
    after = merge_qkv.run(before, None)
    verify(after)
    assert stmts(layer(after).body)[1:3] == ["qkv = linear(h, wqkv)", "q, k, v = split(qkv, sizes=[128, 64, 64])"]
    assert n_linears(layer(after).body) == 5
    # the per-head norms after the split are untouched
    assert "q_2 = rms_norm(q_1, q_norm, eps=1e-05)" in stmts(layer(after).body)


def test_olmoe_traces_through_full_qk_norm(bind_arch, assert_same_logits):
    """OLMoE normalises the whole q and k projections before heads: the trace passes those norms too."""
    before = bind_arch("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2)
    after = merge_qkv.run(before, None)
    verify(after)
    assert stmts(layer(after).body)[1:5] == ["qkv = linear(h, wqkv)", "q, k, v = split(qkv, sizes=[64, 32, 32])",
                                             "q_1 = rms_norm(q, q_norm_full, eps=1e-05)",
                                             "k_1 = rms_norm(k, k_norm_full, eps=1e-05)"]
    assert count(before) == 1 and count(after) == 0
    assert_same_logits(before, after)


# --- declines ------------------------------------------------------------------------

def _edit_weight(graph, name, **changes):
    rep = layer(graph)
    return with_layer(graph, weights={**rep.weights, name: replace(rep.weights[name], **changes)})


def _edit_projection(graph, weight, **changes):
    """Edit the one linear over ``weight`` (found by what it computes, not by its SSA name or position)."""
    rep = layer(graph)
    (node,) = [n for n in rep.body if n.op == "linear" and n.ins[1] == weight]
    return with_layer(graph, body=tuple(n.replace(**changes) if n is node else n for n in rep.body))


@pytest.mark.parametrize("case", ["k_differs", "dtype_differs", "shard_differs", "quantized", "already_merged"])
def test_declines_unmergeable_weights(bind_arch, case):
    g = bind_arch()
    g = {
        "k_differs": lambda: _edit_weight(g, "wk", shape=(32, 48)),  # not a valid graph: the pass still declines
        "dtype_differs": lambda: _edit_weight(g, "wk", dtype="bfloat16"),
        "shard_differs": lambda: _edit_weight(g, "wv", shard=ShardSpec("row")),
        "quantized": lambda: _edit_weight(g, "wq", quant=QuantSpec("fp8_e4m3", "channel")),
        "already_merged": lambda: _edit_weight(g, "wq", hf=("a", "b"), segments=(32, 32)),
    }[case]()
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


def test_declines_partial_bias(bind_arch):
    g = _edit_projection(bind_arch("Qwen2ForCausalLM"), "wk", ins=("h", "wk"))  # k without its bias
    verify(g)
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


def test_declines_different_inputs(bind_arch):
    g = _edit_projection(bind_arch(), "wv", ins=("x", "wv"))  # v projects the residual, not h
    verify(g)
    assert count(g) == 0


def test_declines_without_attention():
    """Three sibling linears of one input that feed no attention are not q, k and v."""
    f32 = lambda *s: TensorType(s, "float32")
    ws = {n: Weight(n, (r, 8), "float32", (f"{n}.weight",), shard=ShardSpec("column"))
          for n, r in (("wq", 8), ("wk", 4), ("wv", 4))}
    g = Graph("toy", "float32", {}, {"h": f32("T", 8)}, ws, (
        Node("linear", ("q",), ("h", "wq"), {}, "toy:1"),
        Node("linear", ("k",), ("h", "wk"), {}, "toy:2"),
        Node("linear", ("v",), ("h", "wv"), {}, "toy:3"),
        Node("add", ("kv",), ("k", "v"), {}, "toy:4"),
    ), ("q", "kv"))
    verify(g)
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


# --- numbers -------------------------------------------------------------------------

@pytest.mark.parametrize("arch, fields", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                          ("Qwen3ForCausalLM", {"head_dim": 32})], ids=["llama", "qwen2", "qwen3"])
def test_numerics(bind_arch, assert_same_logits, arch, fields):
    before = bind_arch(arch, **fields)
    assert_same_logits(before, merge_qkv.run(before, None))


def test_numeric_check_catches_a_wrong_concatenation(bind_arch, run_forward, weights_of):
    """Sanity: the harness notices k and v swapped in the merged weight (same shapes, wrong math)."""
    before = bind_arch()
    after = merge_qkv.run(before, None)
    ckpt = DummyCheckpoint(before)
    top, layers = weights_of(after, ckpt)
    good = run_forward(after, ckpt, (top, layers))
    for L in layers:
        q, k, v = L["wqkv"].split([64, 32, 32])
        L["wqkv"] = torch.cat([q, v, k])
    bad = run_forward(after, ckpt, (top, layers))
    assert not torch.allclose(good, bad, rtol=0, atol=1e-5)


# --- mutation sweep additions --------------------------------------------------------

@pytest.mark.parametrize("case", ["quantize_flag_differs", "shard_unit_differs"])
def test_declines_weights_the_merge_would_misdescribe(bind_arch, case):
    """The merged weight takes the first part's quantize flag and shard unit: parts that differ in them stay apart."""
    g = bind_arch()
    g = {
        "quantize_flag_differs": lambda: _edit_weight(g, "wk", quantize=False),  # k kept in the model dtype
        "shard_unit_differs": lambda: _edit_weight(g, "wv", shard=replace(layer(g).weights["wv"].shard, unit=32)),
    }[case]()
    verify(g)
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


def _edit_layer_body(graph, edit):
    rep = layer(graph)
    return with_layer(graph, body=tuple(edit(list(rep.body))))


def test_declines_k_and_v_from_one_projection(bind_arch):
    """v reading k's projection (v = heads(k)): two distinct linears, not three, so nothing to merge."""
    g = bind_arch()
    g = _edit_layer_body(g, lambda body: [n.replace(ins=("k",)) if n.outs == ("v_1",) else n for n in body])
    verify(g)
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


def test_declines_v_not_made_by_a_projection(bind_arch):
    """v computed from its projection by another op (silu) before the heads view: v traces to no linear."""
    from mxc.ir import Node

    def edit(body):
        out = []
        for n in body:
            if n.outs == ("v_1",):
                out.append(Node("silu", ("v_act",), ("v",), {}, "test:1"))
                n = n.replace(ins=("v_act",))
            out.append(n)
        return out

    g = _edit_layer_body(bind_arch(), edit)
    verify(g)
    assert count(g) == 0
    assert merge_qkv.run(g, None) == g


def test_merged_projection_takes_the_place_of_the_earliest(bind_arch, assert_same_logits):
    """Projections in another order (v first, its heads view before q's projection): the merged linear and split
    go where v was, so the heads view still reads a defined value."""
    def edit(body):
        nodes = {n.outs[0]: n for n in body}
        head = [nodes[v] for v in ("h", "v", "v_1", "q", "k", "q_1", "k_1")]
        return head + [n for n in body if n not in head]

    before = _edit_layer_body(bind_arch(), edit)
    verify(before)
    after = merge_qkv.run(before, None)
    verify(after)
    assert stmts(layer(after).body)[1:4] == ["qkv = linear(h, wqkv)", "q, k, v = split(qkv, sizes=[64, 32, 32])",
                                             "v_1 = heads(v, size=16)"]
    assert_same_logits(before, after)
