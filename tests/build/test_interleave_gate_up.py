"""interleave_gate_up: the fp8 MLP's gate/up rows stored in alternating 64-row blocks, and every reader following.

The pass marks ``rms_norm_mlp`` nodes and their gate/up weight and scales; the loader reorders each rank's rows
after sharding (``interleave_rows``); the kernels read the layout from the node's attribute. On the CPU target
the references de-interleave, so an interleaved build's logits equal the halves build's bit for bit (same
values, another storage order). The CUTLASS SiLU-pair GEMM that the layout is for: tests/gpu/test_cutlass_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import mxc
from mxc.ir import ShardSpec, Weight
from mxc.kernels import cutlass_fp8, torch_ref
from mxc.loaders.convert import interleave_rows, rank_tensor

WIDE = dict(architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=256, max_position_embeddings=256)
QUIET = dict(progress=False, log=lambda m: None)


def test_the_pass_marks_the_mlp_and_its_weights(monkeypatch, fp8_llama_layer):
    def _layer(config, **options):
        rep = fp8_llama_layer(config, **options)
        (mlp,) = [n for n in rep.body if n.op == "rms_norm_mlp"]
        return mlp, rep.weights

    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    mlp, weights = _layer(WIDE)
    assert mlp.attrs["interleave"] == 64 == cutlass_fp8.PAIR_BLOCK
    assert weights[mlp.ins[2]].interleave == 64 and weights[mlp.ins[3]].interleave == 64
    assert mlp.attrs["kernel"] == [[32, "cuda_ops.rms_norm_mlp_small_m"], [None, "cuda_ops.rms_norm_mlp_cutlass"]]
    # a tensor-parallel rank's MLP (no residual: the all-reduce after it adds x), its own rows in whole blocks
    mlp, weights = _layer(WIDE, tp=2)
    assert mlp.attrs["residual"] is False and mlp.attrs["interleave"] == 64 and weights[mlp.ins[2]].interleave == 64
    mlp, weights = _layer({**WIDE, "intermediate_size": 128}, tp=4)  # 32 gate rows a rank
    assert mlp.attrs["residual"] is False and "interleave" not in mlp.attrs
    # gate rows in whole blocks (96: no); row-wise scales only; not for the persistent MLP kernel (--mlp-pair)
    for config, options in [({**WIDE, "intermediate_size": 96}, {}), (WIDE, {"quant_granularity": "block128"}),
                            (WIDE, {"mlp_pair": True}), (WIDE, {"disable_passes": ("interleave_gate_up",)})]:
        mlp, weights = _layer(config, **options)
        assert "interleave" not in mlp.attrs and weights[mlp.ins[2]].interleave == 0, (config, options)


def test_interleave_rows_and_halves_are_inverse():
    rows = torch.arange(2 * 192 * 3).reshape(2 * 192, 3)
    got = interleave_rows(rows, 64)
    assert got[:64].equal(rows[:64]) and got[64:128].equal(rows[192:256]) and got[128:192].equal(rows[64:128])
    assert torch_ref.halves(got.t(), 64).t().equal(rows)
    assert torch_ref.halves(rows, 0) is rows


@pytest.mark.parametrize("arch,overrides", [("LlamaForCausalLM", {}), ("Qwen3ForCausalLM", {"head_dim": 32})])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_an_interleaved_build_equals_the_halves_build(arch, overrides, granularity, hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint(arch, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=4, **overrides)
    kw = dict(dtype="bfloat16", quant="fp8", quant_granularity=granularity, **QUIET)
    art = mxc.build(str(ckpt), out=tmp_path / "pairs", **kw)
    halves = mxc.build(str(ckpt), out=tmp_path / "halves", disable_passes=("interleave_gate_up",), **kw)
    assert "interleave=64" in (art / "graph.yaml").read_text()
    assert "interleave" not in (halves / "graph.yaml").read_text()
    a, b = (load_file(d / "weights" / "rank0.safetensors") for d in (art, halves))
    for name in ("layers.1.w_gate_up", "layers.1.w_gate_up_scale"):
        assert not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))  # the rows did move
        assert torch.equal(a[name].view(torch.uint8), interleave_rows(b[name], 64).view(torch.uint8))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    got, want = mxc.load(art).logits(ids), mxc.load(halves).logits(ids)
    assert torch.equal(got, want)
    ref = mxc.load(mxc.build(str(ckpt), out=tmp_path / "bf16", dtype="bfloat16", **QUIET)).logits(ids)
    # fp8 against the model unquantized (as tests/models/test_fp8.py; Qwen3 here 7.8%, the same without the layout)
    assert float((got - ref).norm() / ref.norm()) < 0.1


def test_each_rank_holds_its_own_rows_interleaved():
    """Under tensor parallelism each rank's [gate; up] slice is interleaved on its own, after the shard spec cut it
    (the ranks' logits: tests/parallel/test_tensor_parallel.py)."""
    w = Weight("w_gate_up", (256, 8), "float32", ("gate", "up"), segments=(256, 256),
               shard=ShardSpec("column", (256, 256), 1, ("I", "I")), interleave=64)
    full = torch.arange(512 * 8, dtype=torch.float32).reshape(512, 8)
    for rank in (0, 1):
        local = torch.cat([full[128 * rank:128 * (rank + 1)], full[256 + 128 * rank:256 + 128 * (rank + 1)]])
        assert torch.equal(rank_tensor(full, w, 2, rank), interleave_rows(local, 64))
