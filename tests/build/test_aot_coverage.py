"""The build records every kernel binary the runtime can launch: for prefills of any length up to
``max_batch * max_seq_len`` tokens and decodes of any batch up to ``max_batch`` (the fused MoE,
the GEMV and attention pick configs by token count), the launches' specs are all among those
``aot.record`` compiles. A missing one fails at run time with "not in the artifact"."""

from __future__ import annotations

import types

import pytest

from mxc.codegen import aot
from mxc.codegen.render import render_forward
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.models.registry import MODELS_DIR, bind_model, lookup

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])
MAX_BATCH, MAX_SEQ = 4, 64


def _program(arch, quant=None, **fields):
    graph = bind_model(MODELS_DIR / "llama.yaml", {**TINY, "architectures": [arch], **fields}, "bfloat16",
                       lookup(arch))
    graph = compile_graph(graph, BuildOptions(target="cuda", dtype="bfloat16", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ, quant=quant))
    program = types.ModuleType("program")
    exec(compile(render_forward(graph, "0" * 64), "forward.py", "exec"), program.__dict__)
    return program, graph


def _specs(program, graph, monkeypatch, runs):
    with monkeypatch.context() as m:
        m.setattr(aot, "scenarios", lambda max_batch, max_seq_len: runs)
        return aot.record(program, graph, MAX_BATCH, MAX_SEQ)


# (sequences, tokens each): prefills across the MoE's BLOCK_M thresholds (T * k / E at 16 and 64:
# T = 32 and 128 here), ragged lengths, the longest batch; decodes at every batch size
RUNS = [(1, 64), (2, 64), (4, 64), (3, 50), (2, 7), (1, 40), (4, 33), (1, 2)] + [(b, 1) for b in range(1, 5)]


@pytest.mark.parametrize("arch,quant,fields", [
    ("Qwen3MoeForCausalLM", None, MOE),
    ("Qwen3MoeForCausalLM", "fp8", MOE),
    ("LlamaForCausalLM", "fp8", {}),
], ids=["moe", "moe-fp8", "llama-fp8"])
def test_every_runtime_launch_is_compiled(arch, quant, fields, monkeypatch):
    program, graph = _program(arch, quant, **fields)
    built = aot.record(program, graph, MAX_BATCH, MAX_SEQ)
    for run in RUNS:
        missing = {s["kernel"] for k, s in _specs(program, graph, monkeypatch, [run]).items() if k not in built}
        assert not missing, f"{run}: {missing} not compiled"


# generate's prompts of different lengths: (tokens of each, logit rows: each prompt's last)
RAGGED = [[50, 3, 1], [64, 1], [7, 33, 2, 64], [1, 2], [63, 64, 64, 64], [2, 1, 1, 1], [17, 16]]


@pytest.mark.parametrize("arch,quant,fields", [
    ("Qwen3MoeForCausalLM", None, MOE),
    ("LlamaForCausalLM", "fp8", {}),
    ("MistralForCausalLM", None, {"sliding_window": 8}),
], ids=["moe", "llama-fp8", "mistral-window"])
def test_prefills_of_prompts_of_different_lengths_are_compiled(arch, quant, fields):
    """A prefill of prompts of different lengths picks its kernels by its token count and its longest prompt, each
    within a bucket the rectangular scenarios record."""
    from mxc.kernels import launch

    program, graph = _program(arch, quant, **fields)
    built = aot.record(program, graph, MAX_BATCH, MAX_SEQ)
    forward = aot.meta_forward(program, graph, MAX_BATCH, MAX_SEQ)
    for lens in RAGGED:
        recorder = launch.Recorder()
        with launch.using(recorder):
            forward(lens, list(range(len(lens))), len(lens))
        missing = {s["kernel"] for k, s in recorder.specs.items() if k not in built}
        assert recorder.specs and not missing, f"{lens}: {missing} not compiled"


def test_scenarios_cover_every_bucket():
    runs = aot.scenarios(64, 512)
    assert [b for b, t in runs if t == 1] == [1, 2, 4, 8, 16, 32, 64]
    totals = [b * t for b, t in runs if t > 1]
    assert max(t for b, t in runs) <= 512 and max(b for b, t in runs) <= 64
    buckets = {1 << (n - 1).bit_length() for n in totals}
    assert buckets == {1 << j for j in range(1, 16)}  # 2 .. 32768 = 64 * 512


@pytest.mark.parametrize("max_batch,max_seq_len", [(4, 64), (3, 50), (1, 128), (5, 7)])
def test_scenarios_include_the_largest_prefill(max_batch, max_seq_len):
    """The largest prefill, ``max_batch`` sequences of ``max_seq_len`` tokens, is among the scenarios; no prefill
    is longer than ``max_seq_len`` or wider than ``max_batch``, and the decodes come first, one a batch bucket."""
    from mxc.runtime_buckets import batch_buckets

    runs = aot.scenarios(max_batch, max_seq_len)
    assert (max_batch, max_seq_len) in runs
    assert all(1 <= b <= max_batch and 1 < t <= max_seq_len for b, t in runs if t > 1)
    assert [b for b, t in runs if t == 1] == list(batch_buckets(max_batch))
