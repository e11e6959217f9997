"""fuse_rope_cache, fuse_add_rms_norm and fuse_linear_io: before/after, match counts, declines, numerics."""

from __future__ import annotations

from dataclasses import replace

import pytest

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


FP8 = BuildOptions(quant="fp8")
BF16 = BuildOptions()


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


def test_fuse_norm_linear_declines_a_norm_with_two_readers(bind_arch):
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


# --- mutation sweep additions --------------------------------------------------------

def _toy(inputs: dict, weights: dict, nodes, outputs):
    """A flat graph: ``inputs`` {name: shape}, ``weights`` {name: shape} (float32), ``nodes`` Node tuples."""
    from mxc.ir import Graph, TensorType, Weight

    ws = {n: Weight(n, s, "float32", (f"{n}.weight",)) for n, s in weights.items()}
    g = Graph("toy", "float32", {}, {n: TensorType(s, "float32") for n, s in inputs.items()}, ws, tuple(nodes),
              tuple(outputs))
    verify(g)
    return g


def test_fuse_linear_io_keeps_a_linears_own_prologue():
    """A linear that already applies SiLU-and-mul to its input, reading a silu_mul: folding that one in too would
    drop one of the two activations."""
    from mxc.ir import Node

    g = _toy({"gu": ("T", 192)}, {"w": (64, 48)}, [
        Node("silu_mul", ("m",), ("gu",), {}, "toy:1"),
        Node("linear", ("y",), ("m", "w"), {"prologue": "silu_mul"}, "toy:2"),
    ], ["y"])
    assert fuse_linear_io.run(g, FP8) == g


def _norm_then(lin_ins, lin_attrs=None, norm_weight="g"):
    """``h = rms_norm(x, <norm_weight>)`` read once, by ``y = linear(*lin_ins, **lin_attrs)``."""
    from mxc.ir import Node

    pre = [Node("silu", ("g_act",), ("g",), {}, "toy:0")] if norm_weight == "g_act" else []
    return _toy({"x": ("T", 64), "z": ("S", 64)}, {"g": (64,), "w": (64, 64), "w_half": (64, 32)},
                pre + [Node("rms_norm", ("h",), ("x", norm_weight), {"eps": 1e-5}, "toy:1"),
                       Node("linear", ("y",), lin_ins, lin_attrs or {}, "toy:2")], ["y"])


def test_fuse_norm_linear_folds_the_plain_case():
    after = fuse_norm_linear.run(_norm_then(("h", "w")), FP8)
    assert [(n.op, n.ins) for n in after.body] == [("rms_norm_linear", ("x", "g", "w"))]


@pytest.mark.parametrize("case", ["computed_norm_weight", "residual", "prologue", "norm_is_the_weight_operand"])
def test_fuse_norm_linear_declines(case):
    """The norm stays when its weight is computed, or its one reader is not a plain linear over it: a linear
    with a residual or a SiLU-and-mul prologue (rms_norm_linear has neither), or one reading it as its weight."""
    g = {
        "computed_norm_weight": lambda: _norm_then(("h", "w"), norm_weight="g_act"),
        "residual": lambda: _norm_then(("h", "w", None, "x")),
        "prologue": lambda: _norm_then(("h", "w_half"), {"prologue": "silu_mul"}),
        "norm_is_the_weight_operand": lambda: _norm_then(("z", "h")),
    }[case]()
    assert fuse_norm_linear.run(g, FP8) == eliminate_dead_code.run(g, None)  # only the unused toy weights go


def test_fuse_add_rms_norm_declines_a_norm_weight_computed_after_the_add():
    """The fused op stands where the add was: a norm weight computed between the add and the norm would be read
    before it exists, so such a norm is not fused."""
    from mxc.ir import Node

    g = _toy({"x": ("T", 64), "y": ("T", 64)}, {"g": (64,)}, [
        Node("add", ("s",), ("x", "y"), {}, "toy:1"),
        Node("silu", ("g_act",), ("g",), {}, "toy:2"),
        Node("rms_norm", ("h",), ("s", "g_act"), {"eps": 1e-5}, "toy:3"),
    ], ["s", "h"])
    assert fuse_add_rms_norm.run(g, None) == g


def test_fuse_add_rms_norm_at_the_add_keeps_readers_between(bind_arch, assert_same_logits):
    """A reader of the sum between the add and its norm (here a mul(x_1, x_1)) still finds it
    defined: the fused op takes the add's place. The norm's eps carries over (here 1e-2, not the usual 1e-5)."""
    g = merged(bind_arch(rms_norm_eps=1e-2))
    rep = layer(g)
    body = list(rep.body)
    (i,) = [i for i, n in enumerate(body) if n.op == "add" and n.outs == ("x_1",)]
    assert body[i + 1].op == "rms_norm" and body[i + 1].ins[0] == "x_1"
    body.insert(i + 1, body[i].replace(op="mul", outs=("x_sq",), ins=("x_1", "x_1")))  # a second reader of x_1
    before = g.replace(body=tuple(rep.replace(body=tuple(body)) if it is rep else it for it in g.body))
    verify(before)
    after = fuse_add_rms_norm.run(before, None)
    verify(after)
    node = next(n for n in layer(after).body if n.op == "add_rms_norm")
    assert node.outs == ("x_1", "h_1") and node.attrs["eps"] == 1e-2
    assert_same_logits(before, after)


def _before_fuse_mlp(graph):
    opts = BuildOptions(quant="fp8")
    for name, run in PIPELINE[:PIPELINE.index(("fuse_mlp", fuse_mlp.run))]:
        graph = run(graph, opts)
    return graph


def _edit_mlp(g, up=lambda n: n, down=lambda n: n, weights=lambda ws: ws, extra=()):
    """``g`` with its layer's gate/up ``rms_norm_qlinear`` and down ``qlinear`` edited, ``extra`` nodes appended."""
    rep = layer(g)
    body = [up(n) if n.op == "rms_norm_qlinear" and n.ins[1] == "ln2" else
            down(n) if n.op == "qlinear" and n.ins[1] == "w_down" else n for n in rep.body]
    new = rep.replace(body=tuple(body) + tuple(extra), weights=weights(dict(rep.weights)))
    g = g.replace(body=tuple(new if it is rep else it for it in g.body))
    verify(g)
    return g


def _mlp_case(case, bind_arch):
    from mxc.ir import Node

    if case in ("down_bias", "up_bias"):  # gate/up and down both have biases: take one away
        g = _before_fuse_mlp(bind_arch(mlp_bias=True))
        if case == "down_bias":
            return _edit_mlp(g, up=lambda n: n.replace(ins=n.ins[:4]))
        return _edit_mlp(g, down=lambda n: n.replace(ins=n.ins[:3] + (None,) + n.ins[4:]))
    g = _before_fuse_mlp(bind_arch())
    if case == "plain":
        return g
    if case == "no_prologue":  # down reads gate_up itself (a [64, 2I] weight), no SiLU-and-mul
        return _edit_mlp(g, down=lambda n: n.replace(attrs={"granularity": n.attrs["granularity"]}),
                         weights=lambda ws: {**ws, "w_down": replace(ws["w_down"], shape=(64, 192))})
    if case == "gate_up_read_twice":
        return _edit_mlp(g, extra=[Node("silu_mul", ("again",), ("gate_up",), {}, "test:1")])
    assert case == "granularity_differs"
    return _edit_mlp(g, down=lambda n: n.replace(attrs={**n.attrs, "granularity": "tensor"}))


@pytest.mark.parametrize("case", ["down_bias", "up_bias", "no_prologue", "gate_up_read_twice", "granularity_differs"])
def test_fuse_mlp_declines(bind_arch, case):
    """rms_norm_mlp has no biases, always applies SiLU-and-mul between the two, takes one granularity, and hides
    gate_up: an MLP outside that stays two nodes."""
    opts = BuildOptions(quant="fp8")
    plain = _mlp_case("plain", bind_arch)
    assert sum(n.op == "rms_norm_mlp" for n in layer(fuse_mlp.run(plain, opts)).body) == 1
    g = _mlp_case(case, bind_arch)
    assert fuse_mlp.run(g, opts) == g


def _edit_layer(g, edit):
    """``g`` with ``edit(node)`` applied to every node of its layer (return the node unchanged to keep it)."""
    rep = layer(g)
    g = g.replace(body=tuple(rep.replace(body=tuple(edit(n) for n in rep.body)) if it is rep else it for it in g.body))
    verify(g)
    return g


def _rope_case(case, bind_arch):
    def reads(op, fix):  # edit the nodes of ``op``: fix(node) -> node
        return lambda n: fix(n) if n.op == op else n

    if case == "k_not_roped":  # the attention reads the k heads before RoPE
        g = merged(bind_arch())
        rope = next(n for n in layer(g).body if n.op == "rope")
        return _edit_layer(g, reads("attention", lambda n: n.replace(ins=(n.ins[0], rope.ins[1], n.ins[2]))))
    if case == "v_is_k":  # v = heads(k): q, k, v are not the split's three outputs
        g = merged(bind_arch())
        split = next(n for n in layer(g).body if n.op == "split")
        return _edit_layer(g, reads("heads", lambda n: n.replace(ins=(split.outs[1],)) if n.ins == (split.outs[2],)
                                    else n))
    if case == "v_normed":  # a per-head norm on v too (Qwen3's k_norm weight): the op norms only q and k
        from mxc.ir import Node

        g = merged(bind_arch("Qwen3ForCausalLM", head_dim=32))
        rep = layer(g)
        attn = next(n for n in rep.body if n.op == "attention")
        v_norm = Node("rms_norm", ("v_normed",), (attn.ins[2], "k_norm"), {"eps": 1e-5}, "test:1")
        at = rep.body.index(attn)
        body = rep.body[:at] + (v_norm, attn.replace(ins=attn.ins[:2] + v_norm.outs)) + rep.body[at + 1:]
        g = g.replace(body=tuple(rep.replace(body=body) if it is rep else it for it in g.body))
        verify(g)
        return g
    if case == "per_head_norm_on_q_only":  # Qwen3 with k's per-head norm taken out: RoPE reads k's heads
        g = merged(bind_arch("Qwen3ForCausalLM", head_dim=32))
        k_norm = next(n for n in layer(g).body if n.op == "rms_norm" and n.ins[1] == "k_norm")
        return _edit_layer(g, reads("rope", lambda n: n.replace(ins=(n.ins[0], k_norm.ins[0], n.ins[2]))))
    g = merged(bind_arch("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2))
    k_norm = next(n for n in layer(g).body if n.op == "rms_norm" and n.ins[1] == "k_norm_full")
    if case == "whole_norm_on_q_only":  # OLMoE with k's whole-projection norm taken out
        return _edit_layer(g, reads("heads", lambda n: n.replace(ins=k_norm.ins[:1]) if n.ins == k_norm.outs else n))
    assert case == "whole_norms_of_different_eps"
    return _edit_layer(g, lambda n: n.replace(attrs={**n.attrs, "eps": 0.5}) if n is k_norm else n)


@pytest.mark.parametrize("case", ["k_not_roped", "v_is_k", "v_normed", "per_head_norm_on_q_only",
                                  "whole_norm_on_q_only", "whole_norms_of_different_eps"])
def test_fuse_rope_cache_declines(bind_arch, case):
    """qkv_rope_cache ropes k, caches the split's own k and v (v not normed), and norms q and k alike (one eps) or
    not at all: an attention outside that keeps its unfused chain."""
    g = _rope_case(case, bind_arch)
    assert fuse_rope_cache.run(g, None) == g


def test_fuse_mlp_needs_the_norm(bind_arch):
    """A tensor-parallel rank's MLP (no residual) whose gate/up projection did not take its norm (fuse_norm_linear
    disabled) is a qlinear(h, w_gate_up, scale, bias): not rms_norm_mlp's input, so it stays unfused."""
    from mxc.compiler.pipeline import compile_graph

    g = compile_graph(bind_arch(mlp_bias=True), BuildOptions(quant="fp8", tp=2, disable_passes=("fuse_norm_linear",)))
    ops = [n.op for n in layer(g).body]
    assert "rms_norm_mlp" not in ops and ops.count("qlinear") == 4  # wqkv, wo, w_gate_up, w_down


def test_fuse_mlp_takes_the_norms_eps(bind_arch):
    g = _before_fuse_mlp(bind_arch(rms_norm_eps=1e-2))
    (mlp,) = [n for n in layer(fuse_mlp.run(g, BuildOptions(quant="fp8"))).body if n.op == "rms_norm_mlp"]
    assert mlp.attrs["eps"] == 1e-2 and mlp.ins[:3] == ("x_1", "ln2", "w_gate_up")


def test_fuse_linear_io_leaves_silu_mul_before_a_linear_that_stays_unquantized(monkeypatch):
    """fuse_linear_io fuses the prologue only where the linear's first kernel is fp8's per-token activation
    quantize. An fp8 checkpoint that stores mlp.down_proj in the model dtype keeps that projection a plain linear:
    it should read a separate silu_mul, as in a bf16 build (the GEMV takes no prologue)."""
    from mxc.compiler.pipeline import compile_graph
    from mxc.kernels import cutlass_fp8
    from mxc.models.registry import MODELS_DIR, bind_model, lookup

    monkeypatch.setattr(cutlass_fp8, "available", lambda: "not probed in this test")  # the probe takes seconds
    config = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                  architectures=["LlamaForCausalLM"])
    bound = bind_model(MODELS_DIR / "llama.yaml", config, "bfloat16", lookup("LlamaForCausalLM"))
    g = compile_graph(bound, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8",
                                          quant_scale_suffix="weight_scale_inv",
                                          quant_unquantized=("model.layers.{i}.mlp.down_proj.weight",)))
    (down,) = [n for n in layer(g).body if "w_down" in n.ins]
    assert down.op == "linear"  # kept in the model dtype, as asked
    assert "prologue" not in down.attrs and "silu_mul" in ops(g)
    assert down.attrs["kernel"][0] == [16, "triton_gemv.linear_small_m"]  # decode: the GEMV, as in a bf16 build
