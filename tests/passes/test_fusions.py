"""fuse_rope_cache, fuse_add_rms_norm and fuse_linear_io: before/after, match counts, declines, numerics."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from mxc.compiler.options import BuildOptions
from mxc.compiler.passes import (eliminate_dead_code, fuse_add_rms_norm, fuse_linear_io, fuse_mlp, fuse_norm_linear,
                                 fuse_rope_cache, merge_gate_up, merge_qkv)
from mxc.compiler.pipeline import PIPELINE
from mxc.ir import Repeat, verify


def layer(g):
    return next(it for it in g.body if isinstance(it, Repeat))


def ops(g):
    return [n.op for n in layer(g).body]


def merged(g):
    g = merge_gate_up.run(merge_qkv.run(g, None), None)
    return eliminate_dead_code.run(g, None)


def test_fuse_rope_cache_llama(bind_arch, assert_same_logits):
    before = merged(bind_arch())
    after = eliminate_dead_code.run(fuse_rope_cache.run(before, None), None)
    verify(after)
    assert ops(after)[:4] == ["rms_norm", "linear", "qkv_rope_cache", "cached_attention"]
    assert "rope" not in ops(after) and "split" not in ops(after) and "attention" not in ops(after)
    fused = layer(after).body[2]
    assert (fused.attrs["heads"], fused.attrs["kv_heads"], fused.attrs["head_dim"]) == (4, 2, 16)
    assert "eps" not in fused.attrs and len(fused.ins) == 2
    assert_same_logits(before, after)


def test_fuse_rope_cache_takes_qk_norms(bind_arch, assert_same_logits):
    before = merged(bind_arch("Qwen3ForCausalLM", head_dim=32))
    after = eliminate_dead_code.run(fuse_rope_cache.run(before, None), None)
    fused = next(n for n in layer(after).body if n.op == "qkv_rope_cache")
    assert fused.ins[2:] == ("q_norm", "k_norm") and fused.attrs["eps"] == 1e-5
    assert ops(after).count("rms_norm") == 2  # ln1, ln2; the q/k norms are inside the fused op
    assert_same_logits(before, after)


def test_fuse_rope_cache_takes_whole_projection_qk_norms(bind_arch, assert_same_logits):
    """OLMoE normalises the whole q and k projections before the heads view: fused the same way."""
    before = merged(bind_arch("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2))
    after = eliminate_dead_code.run(fuse_rope_cache.run(before, None), None)
    verify(after)
    fused = next(n for n in layer(after).body if n.op == "qkv_rope_cache")
    assert fused.ins[2:] == ("q_norm_full", "k_norm_full") and fused.attrs["eps"] == 1e-5
    assert ops(after).count("rms_norm") == 2 and "attention" not in ops(after)  # ln1, ln2: q/k norms fused
    assert_same_logits(before, after)


def test_fuse_rope_cache_declines_without_merged_qkv(bind_arch):
    g = bind_arch()  # q, k, v from three linears, no split
    assert fuse_rope_cache.run(g, None) == g


def test_fuse_add_rms_norm(bind_arch, assert_same_logits):
    before = merged(bind_arch())
    after = fuse_add_rms_norm.run(before, None)
    verify(after)
    assert ops(before).count("add") == 2 and ops(after).count("add") == 1  # the layer-end add feeds the next layer
    node = next(n for n in layer(after).body if n.op == "add_rms_norm")
    assert node.outs == ("x_1", "h_1") and node.ins[2] == "ln2"
    assert_same_logits(before, after)


FP8 = SimpleNamespace(quant="fp8")
BF16 = SimpleNamespace(quant=None)


def test_fuse_linear_io(bind_arch, assert_same_logits):
    before = fuse_add_rms_norm.run(merged(bind_arch(mlp_bias=True)), None)
    after = fuse_linear_io.run(before, FP8)
    verify(after)
    assert "silu_mul" not in ops(after) and ops(after).count("add") == 0
    down = layer(after).body[-1]
    assert down.op == "linear" and down.outs == ("x_2",) and down.attrs["prologue"] == "silu_mul"
    assert down.ins == ("gate_up", "w_down", "b_down", "x_1")
    assert fuse_linear_io.run(after, FP8) == after  # idempotent
    assert_same_logits(before, after)


def test_fuse_linear_io_keeps_silu_mul_unquantized(bind_arch, assert_same_logits):
    """Without fp8 only the residual is folded: a bf16 GEMV would recompute SiLU in every program."""
    before = fuse_add_rms_norm.run(merged(bind_arch()), None)
    after = fuse_linear_io.run(before, BF16)
    verify(after)
    assert ops(after).count("silu_mul") == 1 and ops(after).count("add") == 0
    down = layer(after).body[-1]
    assert down.op == "linear" and "prologue" not in down.attrs and down.ins[0] != "gate_up"
    assert_same_logits(before, after)


def test_fuse_linear_io_declines_shared_intermediates(bind_arch):
    from mxc.ir import Node

    g = fuse_add_rms_norm.run(merged(bind_arch()), None)
    rep = layer(g)
    body = list(rep.body)
    m = next(n for n in body if n.op == "silu_mul").outs[0]
    down = body[-2]
    assert down.op == "linear" and body[-1].op == "add"
    extra = [Node("add", ("m_twice",), (m, m)), Node("add", ("down_twice",), (down.outs[0], down.outs[0]))]
    g2 = g.replace(body=tuple(replace(rep, body=tuple(body + extra)) if it is rep else it for it in g.body))
    verify(g2)
    after = fuse_linear_io.run(g2, FP8)
    assert after == g2  # both intermediates have a second reader: nothing to fold


def test_fuse_norm_linear(bind_arch, assert_same_logits):
    """Under fp8 each RMSNorm read only by one linear joins it: ln1 -> qkv, ln2 -> gate_up, final norm ->
    LM head; the attention's residual add then stays a plain add, which fuse_linear_io folds into the o
    projection. A bf16 graph is left alone (the fused bf16 GEMV measured slower)."""
    before = merged(bind_arch("Qwen2ForCausalLM"))  # q/k/v biases
    assert fuse_norm_linear.run(before, BF16) == before
    after = fuse_norm_linear.run(before, FP8)
    verify(after)
    body = layer(after).body
    fused = [n for n in body if n.op == "rms_norm_linear"]
    assert [(n.ins[1], n.ins[2]) for n in fused] == [("ln1", "wqkv"), ("ln2", "w_gate_up")]
    assert fused[0].ins[3] == "bqkv" and fused[0].attrs["eps"] == 1e-5 and "rms_norm" not in ops(after)
    assert any(n.op == "rms_norm_linear" and n.ins[2] == "lm_head" for n in after.body if not isinstance(n, Repeat))
    assert fuse_norm_linear.run(after, FP8) == after  # idempotent
    assert_same_logits(before, after)
    folded = fuse_linear_io.run(fuse_add_rms_norm.run(after, FP8), BF16)
    o_proj = next(n for n in layer(folded).body if n.op == "linear" and n.ins[1] == "wo")
    assert len(o_proj.ins) == 4 and "add" not in ops(folded) and "add_rms_norm" not in ops(folded)


def test_fuse_norm_linear_declines(bind_arch):
    """A norm with a second reader (a MoE block's router and experts) stays."""
    moe = merged(bind_arch("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2))
    after = fuse_norm_linear.run(moe, FP8)
    assert [n.ins[1] for n in layer(after).body if n.op == "rms_norm_linear"] == ["ln1"]
    assert "rms_norm" in ops(after)  # ln2: router and experts


def test_quantize_turns_norm_linears_into_rms_norm_qlinear(bind_arch):
    """Under fp8 the fused op is quantized like a linear: weight fp8, a scale weight, the norm weight kept."""
    from mxc.compiler.options import BuildOptions
    from mxc.compiler.passes import quantize

    fused = fuse_norm_linear.run(merged(bind_arch()), FP8)
    q = quantize.run(fused, BuildOptions(quant="fp8"))
    verify(q)
    node = next(n for n in layer(q).body if n.op == "rms_norm_qlinear")
    assert node.ins == ("x", "ln1", "wqkv", "wqkv_scale") and node.attrs["granularity"] == "channel"
    assert layer(q).weights["wqkv"].dtype == "float8_e4m3fn" and layer(q).weights["ln1"].dtype == "float32"
    assert [n.op for n in layer(q).body].count("rms_norm_qlinear") == 2


def test_values_read_beyond_their_body_are_not_folded_away(bind_arch):
    """A value also read outside its stretch of nodes (here the final norm, made a graph output too)
    keeps its producer: the rewrite engine's ``live`` set, which every folding rule asks through
    ``sole_user``. The loop's carries and the values a repeat body reads from the top level are live."""
    from mxc.compiler.rewrite import _live

    g = merged(bind_arch())
    top = [n for n in g.body if not isinstance(n, Repeat)]
    final_norm = next(n for n in top if n.op == "rms_norm")
    exposed = g.replace(outputs=g.outputs + (final_norm.outs[0],))
    verify(exposed)
    after = fuse_norm_linear.run(exposed, FP8)
    verify(after)  # folding the norm into the LM head would have deleted an output
    assert final_norm in after.body and not any(n.op == "rms_norm_linear" for n in after.body
                                                if not isinstance(n, Repeat))
    assert any(n.op == "rms_norm_linear" for n in layer(after).body)  # the layer's norms still fold
    live = _live(g)
    rep = layer(g)
    assert set(rep.carry) | set(rep.carry.values()) <= live
    assert set(g.outputs) <= live and final_norm.outs[0] not in live


def test_declines_q_k_norms_of_different_eps(bind_arch, assert_same_logits):
    g = bind_arch("Qwen3ForCausalLM")
    body = []
    for it in g.body:
        if isinstance(it, Repeat):
            nodes = tuple(n.replace(attrs={**n.attrs, "eps": 0.5}) if n.op == "rms_norm" and n.ins[1] == "k_norm"
                          else n for n in it.body)
            it = it.replace(body=nodes)
        body.append(it)
    g = g.replace(body=tuple(body))
    fused = fuse_rope_cache.run(merge_qkv.run(g, BuildOptions()), BuildOptions())
    assert not any(n.op == "qkv_rope_cache" for n, _ in fused.nodes())
    assert_same_logits(g, fused)


def test_declines_a_residual_other_than_the_norm_input(bind_arch):
    opts = BuildOptions(quant="fp8")
    g = bind_arch()
    for name, run in PIPELINE[:PIPELINE.index(("fuse_mlp", fuse_mlp.run))]:
        g = run(g, opts)
    (rep,) = [it for it in g.body if isinstance(it, Repeat)]
    (outer,) = [o for o in rep.carry]  # the layer's input x, carried: not the MLP norm's input
    nodes = list(rep.body)
    (i,) = [i for i, n in enumerate(nodes) if n.op == "qlinear" and n.attrs.get("prologue") == "silu_mul"]
    down = nodes[i]
    assert len(down.ins) == 5 and down.ins[4] != outer
    nodes[i] = down.replace(ins=down.ins[:4] + (outer,))
    g = g.replace(body=tuple(rep.replace(body=tuple(nodes)) if it is rep else it for it in g.body))
    fused = fuse_mlp.run(g, opts)
    assert not any(n.op == "rms_norm_mlp" for n, _ in fused.nodes())
    assert fused == g  # nothing else to fuse at this point
