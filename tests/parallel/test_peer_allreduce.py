"""The one-shot all-reduce over peer memory (``--tp-allreduce one_shot``): chosen for decode token
counts only when asked, recorded in the IR with its reason, refused off CUDA; the adapter falls
back to NCCL where the runtime could not set up peer memory. The collective itself runs in
``tests/gpu/test_tp_gpu.py`` (two GPUs)."""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.kernels import cuda_ops, peer_allreduce
from mxc.kernels.candidates import ONE_SHOT_MAX_TOKENS
from mxc.kernels.context import ForwardContext
from mxc.models.registry import MODELS_DIR, bind_model, lookup

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
            architectures=["LlamaForCausalLM"])


def _all_reduces(dtype="bfloat16", **options):
    graph = bind_model(MODELS_DIR / "llama.yaml", TINY, dtype, lookup("LlamaForCausalLM"))
    g = compile_graph(graph, BuildOptions(target="cuda", dtype=dtype, tp=2, **options))
    return [n.attrs for n, _ in g.nodes() if n.op == "all_reduce"]


def test_one_shot_serves_decode_token_counts_when_asked():
    asked = _all_reduces(tp_allreduce="one_shot")
    assert len(asked) == 3  # the vocab-parallel embedding's, and the o and down projections' (layer body)
    for attrs in asked:
        assert attrs["kernel"] == [[ONE_SHOT_MAX_TOKENS, "cuda_ops.all_reduce_one_shot"], [None, "torch_ref.all_reduce"]]
        assert "peer memory" in attrs["kernel_reason"] and "above: torch reference" in attrs["kernel_reason"]
    for attrs in _all_reduces():  # default: NCCL at every token count
        assert attrs["kernel"] == "torch_ref.all_reduce"
    for attrs in _all_reduces("float16", tp_allreduce="one_shot"):  # symm_mem sums bf16 and fp32 only
        assert attrs["kernel"] == "torch_ref.all_reduce"


def test_auto_is_one_shot_on_cuda_with_tp():
    from mxc.builder import resolve_tp_allreduce

    assert resolve_tp_allreduce("auto", "cuda", 2) == "one_shot"
    assert resolve_tp_allreduce("auto", "cuda", 1) == "nccl"
    assert resolve_tp_allreduce("auto", "cpu", 4) == "nccl"
    assert resolve_tp_allreduce("nccl", "cuda", 2) == "nccl"
    assert resolve_tp_allreduce("auto", "cuda", 2, "float16") == "nccl"  # symm_mem sums bf16 and fp32 only


def test_build_refuses_one_shot_off_cuda(tmp_path):
    with pytest.raises(mxc.MxcError, match="needs --target cuda"):
        mxc.build("llama.yaml", out=tmp_path / "a", tp=2, tp_allreduce="one_shot", progress=False, log=lambda m: None)
    with pytest.raises(mxc.MxcError, match="expected auto, nccl or one_shot"):
        mxc.build("llama.yaml", out=tmp_path / "a", tp=2, tp_allreduce="ring", progress=False, log=lambda m: None)
    assert not (tmp_path / "a").exists()


def test_adapter_uses_the_runtime_collective_or_falls_back():
    calls = []

    def fake(x):
        calls.append(x.shape)
        return x * 2

    x, b = torch.ones(3, 8), torch.full((8,), 0.5)
    ctx = ForwardContext([1] * 3, [0] * 3, [0, 1, 2], world_size=2, peer_allreduce=fake)
    torch.testing.assert_close(cuda_ops.all_reduce_one_shot(x, b, ctx), torch.full((3, 8), 2.5))
    assert calls == [(3, 8)]
    single = ForwardContext([1], [0], [0])  # world size 1, no collective: the input (+ bias)
    torch.testing.assert_close(cuda_ops.all_reduce_one_shot(x, b, single), torch.full((3, 8), 1.5))
    meta = torch.empty(3, 8, device="meta")  # the build's shape-only trace never calls the collective
    assert cuda_ops.all_reduce_one_shot(meta, None, ctx).device.type == "meta" and len(calls) == 1


def test_peer_memory_needs_cuda(capsys):
    from mxc.runtime.model import _peer_allreduce

    assert "needs CUDA" in peer_allreduce.available(torch.device("cpu"))
    assert _peer_allreduce({"config": {"hidden_size": 64}}, torch.bfloat16, torch.device("cpu")) is None
    assert "one-shot all-reduce unavailable" in capsys.readouterr().err
