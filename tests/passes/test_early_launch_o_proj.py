"""early_launch_o_proj: the decode attention ahead of a preloading fp8 o GEMV is marked, nothing else."""

from __future__ import annotations

import pytest

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
