"""--mlp-pair: the fuse_mlp pass, the persistent MLP kernel as a candidate, and what a build ships.

``fuse_mlp`` turns each layer's fp8 ``rms_norm_qlinear`` (gate/up) + ``qlinear`` (down, SiLU prologue, the
residual) into one ``rms_norm_mlp``; ``select_kernels`` gives it ``cuda_ops.rms_norm_mlp_pair`` at <= 8 tokens
where the kernel takes the shapes and the build can compile it, else the unfused nodes' kernels. On the CPU
target the fused op runs the same references, so its logits equal the unfused build's bit for bit. The
kernel's own tests: tests/kernels/test_mlp_pair_fp8.py (CPU), tests/gpu/test_mlp_pair_fp8_gpu.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import mxc
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.errors import MxcError
from mxc.ir import Node, TensorType
from mxc.kernels import cutlass_fp8, mlp_pair_fp8
from mxc.kernels.candidates import CANDIDATES, MLP_PAIR_KERNEL
from mxc.models.registry import MODELS_DIR, bind_model, lookup
from tests import warm_python
from tests.sm90_compile import compile_env

WIDE = dict(architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=256, max_position_embeddings=256)
QUIET = dict(progress=False, log=lambda m: None)


def test_fuse_mlp_makes_one_op_a_layer_and_the_pair_claims_decode(monkeypatch, fp8_llama_layer):
    monkeypatch.setattr(mlp_pair_fp8, "available", lambda: None)
    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    body = fp8_llama_layer(WIDE, mlp_pair=True).body
    (mlp,) = [n for n in body if n.op == "rms_norm_mlp"]
    assert mlp.ins == ("x_1", "ln2", "w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale")
    assert mlp.attrs["kernel"] == [[8, MLP_PAIR_KERNEL], [32, "cuda_ops.rms_norm_mlp_small_m"],
                                   [None, "cuda_ops.rms_norm_mlp_cutlass"]]
    assert not [n for n in body if n.op == "qlinear" and n.attrs.get("prologue")]  # the down projection is inside
    assert [n.op for n in body].count("rms_norm_qlinear") == 1  # qkv keeps its own
    # without the option (the default) the op stays and the GEMVs claim decode (the SiLU in the gate/up epilogue)
    (mlp,) = [n for n in fp8_llama_layer(WIDE).body if n.op == "rms_norm_mlp"]
    assert mlp.attrs["kernel"] == [[32, "cuda_ops.rms_norm_mlp_small_m"], [None, "cuda_ops.rms_norm_mlp_cutlass"]]
    # with the pass disabled, the graph keeps the two nodes
    plain = fp8_llama_layer(WIDE, mlp_pair=True, disable_passes=("fuse_mlp",)).body
    assert "rms_norm_mlp" not in [n.op for n in plain]
    assert [n.attrs.get("prologue") for n in plain if n.op == "qlinear"] == [None, "silu_mul"]
    # a MoE layer has no dense MLP to fuse
    moe = {**WIDE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 1024}
    graph = bind_model(MODELS_DIR / "llama.yaml", moe, "bfloat16", lookup("Qwen3MoeForCausalLM"))
    g = compile_graph(graph, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", mlp_pair=True))
    assert "rms_norm_mlp" not in [n.op for n, _ in g.nodes()] and "fused_moe" in [n.op for n, _ in g.nodes()]


def test_pair_says_why_not(monkeypatch, fp8_llama_layer):
    monkeypatch.setattr(mlp_pair_fp8, "available", lambda: None)
    (cand,) = [c for c in CANDIDATES["rms_norm_mlp"] if c.name == MLP_PAIR_KERNEL]
    fp8 = "float8_e4m3fn"
    x = TensorType(("T", 4096), "bfloat16")
    ins = [x, TensorType((4096,), "bfloat16"), TensorType((28672, 4096), fp8), TensorType((28672,), "float32"),
           TensorType((4096, 14336), fp8), TensorType((4096,), "float32")]

    def why(granularity="channel", x=x, down=ins[4], **options):
        node = Node("rms_norm_mlp", ("y",), ("x", "g", "wgu", "sgu", "wd", "sd"), {"granularity": granularity})
        opts = BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", **{"mlp_pair": True, **options})
        return cand.why_not(node, [x, *ins[1:4], down, ins[5]], opts)

    assert why() is None
    assert "not asked for (--mlp-pair)" in why(mlp_pair=False)
    assert "sm_90a only" in why(arch=100)
    assert "one weight scale a row" in why("block128")
    assert "computes in bf16" in why(x=TensorType(("T", 4096), "float16"))
    assert "multiples of 1024" in why(down=TensorType((4096, 11008), fp8))
    monkeypatch.setattr(mlp_pair_fp8, "available", lambda: "nvcc not found")
    assert why() == f"{MLP_PAIR_KERNEL}: nvcc not found"
    tiny = {**WIDE, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16}
    (mlp,) = [n for n in fp8_llama_layer(tiny, mlp_pair=True).body if n.op == "rms_norm_mlp"]
    assert MLP_PAIR_KERNEL not in json.dumps(mlp.attrs["kernel"])  # the unfused kernels serve every count


def test_option_errors(tmp_path):
    with pytest.raises(MxcError, match="--mlp-pair: the fused MLP kernel runs fp8 weights, and no --quant fp8 was "
                                       "given; add it"):
        mxc.build("llama.yaml", out=tmp_path / "a", mlp_pair=True, **QUIET)
    with pytest.raises(MxcError, match="--tp 2"):
        mxc.build("llama.yaml", out=tmp_path / "b", target="cuda", quant="fp8", tp=2, mlp_pair=True, **QUIET)
    with pytest.raises(MxcError, match=r"--mlp-pair: the fused MLP kernel is a cuda kernel \(got --target cpu\); add "
                                       r"--target cuda, or drop --mlp-pair"):
        mxc.build("llama.yaml", out=tmp_path / "c", quant="fp8", mlp_pair=True, **QUIET)
    assert not any(tmp_path.iterdir())


def test_cpu_fused_build_gives_the_unfused_logits(tmp_path):
    """``fuse_mlp`` (every fp8 build) against the same build without it: the CPU target's fused op is exact."""
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    plain_dir = mxc.build("llama.yaml", out=tmp_path / "plain", dtype="bfloat16", quant="fp8",
                          disable_passes=["fuse_mlp"], **QUIET)
    assert "rms_norm_mlp(" not in (plain_dir / "graph.yaml").read_text()
    plain = mxc.load(plain_dir)
    fused_dir = mxc.build("llama.yaml", out=tmp_path / "fused", dtype="bfloat16", quant="fp8", **QUIET)
    assert "rms_norm_mlp(" in (fused_dir / "graph.yaml").read_text()
    fused = mxc.load(fused_dir)
    want = plain.logits(ids)
    assert want.abs().max() > 1e-2
    assert torch.equal(fused.logits(ids), want)
    assert torch.equal(fused.generate(ids, max_new_tokens=6), plain.generate(ids, max_new_tokens=6))


@pytest.mark.skipif(mlp_pair_fp8.available() is not None, reason=f"no nvcc: {mlp_pair_fp8.available()}")
@pytest.mark.xdist_group("cutlass")  # one pytest-xdist worker compiles the library (tests/conftest.py)
def test_cuda_build_ships_the_library(tmp_path):
    """``mxc build --mlp-pair`` (the CLI) compiles the library into the artifact and the manifest lists it."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**WIDE, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))
    env = compile_env()
    env[cutlass_fp8.PREBUILT_ENV] = "none"  # prefill by torch._scaled_mm: no minute of CUTLASS nvcc here
    art = tmp_path / "art"
    proc = warm_python.run([sys.executable, "-m", "mxc", "build", "llama.yaml", "--config", str(cfg), "--target",
                            "cuda", "--quant", "fp8", "--mlp-pair", "--out", str(art), "--max-batch", "8",
                            "--max-seq-len", "64", "--jobs", "1"], env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["mlp_pair"]["library"] == mlp_pair_fp8.LIBRARY and manifest["options"]["mlp_pair"] is True
    assert mlp_pair_fp8.LIBRARY in manifest["files"] and "cutlass" not in manifest
    (mlp,) = [k for k in manifest["kernels"] if k["op"] == "rms_norm_mlp"]
    assert mlp["kernel"] == [[8, MLP_PAIR_KERNEL], [32, "cuda_ops.rms_norm_mlp_small_m"],
                             [None, "cuda_ops.rms_norm_mlp_scaled_mm"]]
    pair = mlp_pair_fp8.MlpPairFp8(art / mlp_pair_fp8.LIBRARY)  # opens without a GPU (cudart is static)
    assert pair.supports(1, 1024, 2048) and not pair.supports(9, 1024, 2048)
