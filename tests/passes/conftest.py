"""Pass-test fixtures: tiny bound graphs, and a harness that runs a graph's generated forward.

``run_forward(graph)`` is the numeric half of a pass test: it selects kernels,
renders the forward program, execs it, builds the runtime weight dicts from a
``DummyCheckpoint`` (by HF name, so every graph of one model sees the same
tensors; merged weights concatenate their parts along dim 0 as the loader
does) and returns the logits for a fixed batch of 2 sequences of 5 tokens,
run through an empty KV cache (fused attention ops read their keys from it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxc.codegen.render import render_forward
from mxc.compiler.options import BuildOptions
from mxc.compiler.passes import select_kernels
from mxc.ir import Graph, Repeat, Weight, verify
from mxc.kernels.context import ForwardContext
from mxc.loaders.convert import read_full
from mxc.loaders.dummy import DummyCheckpoint
from mxc.models.registry import MODELS_DIR, bind_model, lookup

LLAMA_YAML = MODELS_DIR / "llama.yaml"

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0)

B, S = 2, 5


@pytest.fixture
def bind_arch():
    """Factory: llama.yaml bound to a tiny config of ``arch``, fields overridden."""

    def bind(arch: str = "LlamaForCausalLM", model_file: Path = LLAMA_YAML, **fields) -> Graph:
        config = {**TINY, "architectures": [arch], **fields}
        return bind_model(Path(model_file), config, "float32", lookup(arch))

    return bind


@pytest.fixture
def loc_of():
    """Factory: ``"llama.yaml:N"`` for the unique line of llama.yaml containing a statement ``fragment``.

    Expected node locations are computed from the model file, so editing it elsewhere does not break them.
    """
    lines = LLAMA_YAML.read_text().splitlines()

    def loc(fragment: str) -> str:
        found = [i for i, ln in enumerate(lines, start=1) if fragment in ln]
        assert len(found) == 1, f"{fragment!r} is on lines {found} of llama.yaml; expected exactly one"
        return f"{LLAMA_YAML.name}:{found[0]}"

    return loc


def _tensor(w: Weight, ckpt) -> torch.Tensor:
    return read_full(w, ckpt)  # merged parts concatenated, expert stacks stacked, as the loader does


def runtime_weights(graph: Graph, ckpt) -> tuple[dict, list[dict]]:
    """(top-level name -> tensor, [layer i: local name -> tensor]) as the generated forward reads them."""
    top = {k: _tensor(w, ckpt) for k, w in graph.weights.items()}
    (rep,) = [it for it in graph.body if isinstance(it, Repeat)]
    layers = [{k: _tensor(w.resolve(rep.index, i), ckpt) for k, w in rep.weights.items()} for i in range(rep.count)]
    return top, layers


def forward_fn(graph: Graph):
    src = render_forward(select_kernels.run(graph, BuildOptions()), ir_hash="test")
    namespace: dict = {}
    exec(compile(src, f"<forward of {graph.family}>", "exec"), namespace)
    return namespace["forward"]


def kv_context(graph: Graph) -> ForwardContext:
    """B sequences of S new tokens each, in slots 0..B-1 of an empty KV cache."""
    c = graph.config
    shape = (B, S + 3, c["num_key_value_heads"], c["head_dim"])
    cache = lambda: [torch.zeros(shape) for _ in range(c["num_hidden_layers"])]
    return ForwardContext.build([S] * B, [0] * B, list(range(B)), cache(), cache(), torch.device("cpu"))


@pytest.fixture
def weights_of():
    """``runtime_weights`` as a fixture (conftest modules are not importable under --import-mode=importlib)."""
    return runtime_weights


@pytest.fixture
def run_forward():
    """Factory: logits [B*S, vocab] of ``graph`` on fixed tokens, weights from ``ckpt`` (default: the graph's own)."""

    def run(graph: Graph, ckpt=None, weights=None) -> torch.Tensor:
        verify(graph)
        ckpt = ckpt or DummyCheckpoint(graph)
        top, layers = weights or runtime_weights(graph, ckpt)
        vocab = graph.config["vocab_size"]
        tokens = torch.randint(0, vocab, (B * S,), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(S).repeat(B)
        rows = torch.arange(B * S)
        with torch.inference_mode():
            return forward_fn(graph)(top, layers, kv_context(graph), tokens, positions, rows)

    return run


@pytest.fixture
def assert_same_logits(run_forward):
    """Run ``before`` and ``after`` on the same checkpoint tensors; logits must agree (float32, atol 1e-5)."""

    def check(before: Graph, after: Graph) -> torch.Tensor:
        ckpt = DummyCheckpoint(before)  # names every tensor either graph can ask for
        a, b = run_forward(before, ckpt), run_forward(after, ckpt)
        assert a.shape == b.shape == (B * S, before.config["vocab_size"])
        assert a.abs().max() > 1e-2  # not trivially zero: the comparison can fail
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()
        return a

    return check
