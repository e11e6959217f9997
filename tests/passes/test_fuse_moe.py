"""fuse_moe: experts over separate gate/up stacks -> fused_moe over one merged stack; numerics unchanged."""

from __future__ import annotations

import pytest

from mxc.compiler.passes import eliminate_dead_code, fuse_moe
from mxc.ir import QuantSpec, Repeat, ShardSpec, verify

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)


def layer(g):
    return next(it for it in g.body if isinstance(it, Repeat))


def test_before_after_and_numerics(bind_arch, assert_same_logits):
    before = bind_arch("Qwen3MoeForCausalLM", **MOE)
    after = eliminate_dead_code.run(fuse_moe.run(before, None), None)
    verify(after)
    ops = [n.op for n in layer(after).body]
    assert "experts" not in ops and ops.count("fused_moe") == 1
    node = next(n for n in layer(after).body if n.op == "fused_moe")
    assert node.ins[3:] == ("we_gate_up", "we_down")
    w = layer(after).weights["we_gate_up"]
    assert w.shape == (4, 80, 64) and w.stack == "e" and w.segments == (40, 40)
    assert w.hf == ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight")
    assert w.shard == ShardSpec("column", (40, 40), 1, ("moe_intermediate_size",) * 2)
    assert "we_gate" not in layer(after).weights and "we_up" not in layer(after).weights
    assert fuse_moe.run(after, None) == after
    assert_same_logits(before, after)


def test_mixtral_names(bind_arch):
    g = fuse_moe.run(bind_arch("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2), None)
    assert layer(g).weights["we_gate_up"].hf == ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                                                 "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight")


def test_residual_add_folds_into_fused_moe(bind_arch, assert_same_logits):
    """fuse_linear_io folds the layer's residual add into fused_moe (its down kernel adds it); quantize
    keeps it after the scales; Qwen2-MoE's shared-expert add folds the same way."""
    from types import SimpleNamespace

    from mxc.compiler.passes import fuse_add_rms_norm, fuse_linear_io, quantize

    before = fuse_add_rms_norm.run(eliminate_dead_code.run(fuse_moe.run(bind_arch("Qwen3MoeForCausalLM", **MOE),
                                                                        None), None), None)
    after = eliminate_dead_code.run(fuse_linear_io.run(before, SimpleNamespace(quant=None)), None)
    verify(after)
    node = next(n for n in layer(after).body if n.op == "fused_moe")
    assert node.ins[5:] == (None, None, "x_1") and node.outs == ("x_2",)
    assert "add" not in [n.op for n in layer(after).body]
    assert fuse_linear_io.run(after, SimpleNamespace(quant=None)) == after
    assert_same_logits(before, after)
    from mxc.compiler.options import BuildOptions

    q = quantize.run(after, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8"))
    qnode = next(n for n in layer(q).body if n.op == "fused_moe")
    assert qnode.ins[5:] == ("we_gate_up_scale", "we_down_scale", "x_1")
    verify(q)

    shared = fuse_moe.run(bind_arch("Qwen2MoeForCausalLM", **MOE, shared_expert_intermediate_size=48), None)
    folded = eliminate_dead_code.run(fuse_linear_io.run(shared, SimpleNamespace(quant=None)), None)
    verify(folded)
    assert len(next(n for n in layer(folded).body if n.op == "fused_moe").ins) == 8
    assert_same_logits(shared, folded)


def _routed(bind_arch, arch="Qwen3MoeForCausalLM", **fields):
    from mxc.compiler.passes import fuse_add_rms_norm

    g = bind_arch(arch, **{**MOE, **fields})
    return fuse_add_rms_norm.run(eliminate_dead_code.run(fuse_moe.run(g, None), None), None)


def test_norm_and_router_fuse(bind_arch, assert_same_logits):
    """fuse_norm_route: add_rms_norm + router linear + route -> add_rms_norm_route (softmax with
    renormalisation, Qwen3-MoE; sigmoid without, as a model file may ask); under fp8 too, not at tp > 1."""
    from types import SimpleNamespace

    from mxc.compiler.passes import fuse_norm_route

    for arch, fields in (("Qwen3MoeForCausalLM", {}), ("OlmoeForCausalLM", {"norm_topk_prob": False})):
        before = _routed(bind_arch, arch, **fields)
        after = eliminate_dead_code.run(fuse_norm_route.run(before, SimpleNamespace(quant=None)), None)
        verify(after)
        ops = [n.op for n in layer(after).body]
        assert "route" not in ops and "add_rms_norm" not in ops and ops.count("add_rms_norm_route") == 1
        node = next(n for n in layer(after).body if n.op == "add_rms_norm_route")
        assert node.ins[2:] == ("ln2", "w_router") and node.attrs["k"] == 2
        moe = next(n for n in layer(after).body if n.op == "fused_moe")
        assert moe.ins[:3] == node.outs[1:]  # the experts read the fused op's normalised rows and routes
        assert fuse_norm_route.run(after, SimpleNamespace(quant=None)) == after
        assert_same_logits(before, after)
        assert fuse_norm_route.run(before, SimpleNamespace(quant="fp8")) == fuse_norm_route.run(
            before, SimpleNamespace(quant=None))  # the router stays in the model dtype under fp8
        assert fuse_norm_route.run(before, SimpleNamespace(quant=None, tp=2)) == before


def test_norm_route_leaves_logits_read_elsewhere(bind_arch):
    """Router logits another node also reads (a graph output here) are not folded away."""
    from types import SimpleNamespace

    from mxc.compiler.passes import fuse_norm_route

    g = _routed(bind_arch)
    rep = layer(g)
    route = next(n for n in rep.body if n.op == "route")
    kept = g.replace(body=tuple(it.replace(carry={**it.carry, "router_logits": route.ins[0]})
                                if isinstance(it, Repeat) else it for it in g.body))
    assert fuse_norm_route.run(kept, SimpleNamespace(quant=None)) == kept


def test_fp8_keeps_the_routers_in_the_model_dtype(bind_arch):
    """``--quant fp8`` quantizes the experts and every other linear but not the routers (``quantize: false`` in the
    model file): the expert router and Qwen2-MoE's shared-expert gate stay in the model dtype, so fp8 picks the same
    experts; the fused norm + router op takes the unquantized router. The flag survives the IR dump."""
    from mxc.compiler.options import BuildOptions
    from mxc.compiler.passes import fuse_add_rms_norm, fuse_norm_route, quantize
    from mxc.ir import dump_graph, load_graph

    g = fuse_moe.run(bind_arch("Qwen2MoeForCausalLM", **MOE, shared_expert_intermediate_size=48), None)
    g = fuse_norm_route.run(fuse_add_rms_norm.run(eliminate_dead_code.run(g, None), None),
                            BuildOptions(target="cuda", dtype="bfloat16", quant="fp8"))
    q = quantize.run(g, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8"))
    verify(q)
    ws = layer(q).weights
    assert ws["w_router"].dtype == ws["ws_router"].dtype == "float32" and ws["w_router"].quant is None
    assert not ws["w_router"].quantize and not ws["ws_router"].quantize
    assert "w_router_scale" not in ws and "ws_router_scale" not in ws
    assert ws["we_gate_up"].dtype == ws["wq"].dtype == ws["ws_gate"].dtype == "float8_e4m3fn"
    assert any(n.op == "add_rms_norm_route" and "w_router" in n.ins for n in layer(q).body)
    assert load_graph(dump_graph(q)) == q


def test_quantize_flag_must_be_a_boolean(bind_arch, tmp_path):
    import pytest

    from mxc.errors import MxcError
    from mxc.models.registry import MODELS_DIR

    text = (MODELS_DIR / "llama.yaml").read_text()
    assert "when: moe, quantize: false}" in text
    (tmp_path / "llama.yaml").write_text(text.replace("when: moe, quantize: false}", "when: moe, quantize: 'no'}"))
    with pytest.raises(MxcError, match=r"w_router\.quantize: expected true or false, got 'no'"):
        bind_arch("Qwen3MoeForCausalLM", model_file=tmp_path / "llama.yaml", **MOE)


# --- mutation sweep additions --------------------------------------------------------

def _edit_stack(graph, name, **changes):
    from dataclasses import replace

    rep = layer(graph)
    new = rep.replace(weights={**rep.weights, name: replace(rep.weights[name], **changes)})
    return graph.replace(body=tuple(new if it is rep else it for it in graph.body))


_FP8 = QuantSpec("fp8_e4m3", "channel", prequantized=True)
_UNMERGEABLE = {
    "gate_quantized": ("we_gate", dict(quant=_FP8)),
    "up_quantized": ("we_up", dict(quant=_FP8)),
    "already_merged": ("we_gate", dict(hf=("a.{e}", "b.{e}"), segments=(20, 20))),
    "shape_differs": ("we_up", dict(shape=(4, 48, 64))),  # not a valid graph: the pass still declines
    "dtype_differs": ("we_up", dict(dtype="bfloat16")),
    "shard_differs": ("we_up", dict(shard=ShardSpec("row"))),
}


@pytest.mark.parametrize("case", list(_UNMERGEABLE))
def test_declines_stacks_it_cannot_merge(bind_arch, case):
    """Quantized, already merged, or gate and up stacks of another shape, dtype or shard kind: experts stays."""
    g = bind_arch("Qwen3MoeForCausalLM", **MOE)
    assert fuse_moe.run(g, None) != g  # the unedited stacks do merge
    name, changes = _UNMERGEABLE[case]
    edited = _edit_stack(g, name, **changes)
    assert fuse_moe.run(edited, None) == edited


@pytest.mark.parametrize("arch, fields", [("Qwen3MoeForCausalLM", {"norm_topk_prob": True}),
                                          ("Qwen3MoeForCausalLM", {"moe_scoring": "sigmoid"}),
                                          ("MixtralForCausalLM", {"num_local_experts": 4})],
                         ids=["renormalize", "sigmoid", "mixtral"])
def test_norm_route_keeps_the_routers_scoring(bind_arch, assert_same_logits, arch, fields):
    """The fused op scores and renormalises as the router it replaces did (the default softmax without
    renormalisation would pick the same experts, but weight them differently), and keeps Mixtral's weights in
    float32 (``fp32_weights``) as its router does."""
    from types import SimpleNamespace

    from mxc.compiler.passes import fuse_norm_route

    before = _routed(bind_arch, arch, **fields)
    route = next(n for n in layer(before).body if n.op == "route")
    assert (route.attrs["scoring"], route.attrs["renormalize"]) != ("softmax", False)
    after = eliminate_dead_code.run(fuse_norm_route.run(before, SimpleNamespace(quant=None)), None)
    node = next(n for n in layer(after).body if n.op == "add_rms_norm_route")
    routing = ("scoring", "renormalize", "fp32_weights")
    assert {a: node.attrs[a] for a in routing} == {a: route.attrs[a] for a in routing}
    assert node.attrs["fp32_weights"] is (arch == "MixtralForCausalLM")
    assert_same_logits(before, after)


def test_norm_route_without_fuse_add_rms_norm(bind_arch, assert_same_logits):
    """With ``--disable-pass fuse_add_rms_norm`` the router reads a plain rms_norm: nothing to fuse, the build works."""
    from mxc.compiler.options import BuildOptions
    from mxc.compiler.pipeline import compile_graph

    g = bind_arch("Qwen3MoeForCausalLM", **MOE)
    out = compile_graph(g, BuildOptions(disable_passes=("fuse_add_rms_norm",)))
    ops = [n.op for n in layer(out).body]
    assert "add_rms_norm_route" not in ops and "route" in ops
    assert_same_logits(g, out)


def test_norm_route_declines_a_router_reading_the_sum(bind_arch):
    """A router over the residual sum s (not the normalised h) is not the fused op's router: it stays."""
    from types import SimpleNamespace

    from mxc.compiler.passes import fuse_norm_route

    g = _routed(bind_arch)
    rep = layer(g)
    norm = next(n for n in rep.body if n.op == "add_rms_norm")
    route = next(n for n in rep.body if n.op == "route")
    body = tuple(n.replace(ins=(norm.outs[0],) + n.ins[1:]) if n.outs == route.ins else n for n in rep.body)
    g = g.replace(body=tuple(rep.replace(body=body) if it is rep else it for it in g.body))
    verify(g)
    after = fuse_norm_route.run(g, SimpleNamespace(quant=None))
    assert after == g
