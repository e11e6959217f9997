"""early_launch_o_proj: the decode attention ahead of a preloading fp8 o GEMV is marked, nothing else."""

from __future__ import annotations

import pytest
import torch

from mxc.codegen.render import render_forward
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.ir import Repeat


def _attention(graph):
    layer = next(it for it in graph.body if isinstance(it, Repeat))
    (attn,) = [n for n in layer.body if n.op == "cached_attention"]
    return attn


@pytest.mark.parametrize("quant,granularity,pdl,marked", [
    ("fp8", "channel", True, True),  # the o GEMV (64 x 64 e4m3, one token) preloads: marked
    ("fp8", "tensor", True, True),
    ("fp8", "block128", True, False),  # block scales: the GEMV does not preload
    ("fp8", "channel", False, False),  # no PDL: no launch order to change
    (None, "channel", True, False),  # bf16 o projection: not preloaded (measured slower)
])
def test_marks_only_a_preloading_o_projection(bind_arch, quant, granularity, pdl, marked):
    opts = BuildOptions(target="cuda", dtype="bfloat16", quant=quant, quant_granularity=granularity, pdl=pdl)
    graph = compile_graph(bind_arch(), opts)
    attn = _attention(graph)
    assert attn.attrs.get("early_dependents", False) is marked
    if marked:  # the generated forward passes it to the attention's kernel
        assert "early_dependents=True" in render_forward(graph, "0" * 64)


def test_can_be_disabled(bind_arch):
    opts = BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", pdl=True,
                        disable_passes=("early_launch_o_proj",))
    assert "early_dependents" not in _attention(compile_graph(bind_arch(), opts)).attrs


# --- mutation sweep additions --------------------------------------------------------

PDL_FP8 = dict(target="cuda", dtype="bfloat16", quant="fp8", pdl=True)


@pytest.fixture
def no_cutlass_probe(monkeypatch):
    """The CUTLASS kernels counted unavailable without probing for their generator (seconds, once a session)."""
    from mxc.kernels import cutlass_fp8

    monkeypatch.setattr(cutlass_fp8, "available", lambda: "not probed in this test")


@pytest.mark.parametrize("hidden, head_dim, marked", [(64, 32, True), (128, 16, False)])
def test_asks_about_the_o_weight_as_n_by_k(bind_arch, no_cutlass_probe, hidden, head_dim, marked):
    """The o projection's weight is [hidden, heads*head_dim]: [64, 128] preloads and [128, 64] does not, each
    unlike its transpose -- the question is about the weight as stored."""
    from mxc.kernels.triton_fp8_gemv import preloads

    n, k = hidden, 4 * head_dim
    assert preloads(n, k, torch.bfloat16, "channel") is marked
    assert preloads(k, n, torch.bfloat16, "channel") is not marked
    attn = _attention(compile_graph(bind_arch(hidden_size=hidden, head_dim=head_dim), BuildOptions(**PDL_FP8)))
    assert attn.attrs.get("early_dependents", False) is marked


def test_an_attention_read_by_more_than_the_o_projection_is_not_marked(bind_arch, no_cutlass_probe):
    """Early launch is for the GEMV right after the attention: with a second reader of the attention's output, the
    attention keeps its plain launch order."""
    from mxc.compiler.passes import early_launch_o_proj
    from mxc.ir import Node, verify

    g = compile_graph(bind_arch(), BuildOptions(**PDL_FP8, disable_passes=("early_launch_o_proj",)))
    (rep,) = g.repeats()
    attn = _attention(g)
    at = rep.body.index(attn) + 2  # after the attention and its flatten_heads
    assert rep.body[at - 1].op == "flatten_heads"
    body = rep.body[:at] + (Node("flatten_heads", ("a_again",), attn.outs, {}, "test:1"),) + rep.body[at:]
    g = g.replace(body=tuple(rep.replace(body=body) if it is rep else it for it in g.body))
    verify(g)
    assert early_launch_o_proj.run(g, BuildOptions(**PDL_FP8)) == g
