"""Fixtures of the build tests."""

from __future__ import annotations

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.ir import Repeat
from mxc.models.registry import MODELS_DIR, bind_model, lookup


@pytest.fixture
def fp8_llama_layer():
    """Factory: the layer (the Repeat) of llama.yaml bound to ``config`` and compiled for cuda, bf16, ``--quant fp8``
    and ``options`` (BuildOptions fields)."""

    def compile_layer(config: dict, **options) -> Repeat:
        graph = bind_model(MODELS_DIR / "llama.yaml", config, "bfloat16", lookup("LlamaForCausalLM"))
        g = compile_graph(graph, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", **options))
        (rep,) = [it for it in g.body if isinstance(it, Repeat)]
        return rep

    return compile_layer


@pytest.fixture
def ckpt(hf_checkpoint):
    """The tiny Llama checkpoint the error tests edit."""
    return hf_checkpoint("LlamaForCausalLM")[0]
