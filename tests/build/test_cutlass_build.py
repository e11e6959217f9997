"""The CUTLASS fp8 GEMM as a kernel candidate: what it claims, why it declines, and what a build ships.

``select_kernels`` gives fp8 linears above the GEMV's 32 tokens to ``fp8_gemm.cutlass`` where a build can
have the library (``cutlass_fp8.available``), else to ``torch._scaled_mm``. A cuda build that chose it
compiles the library into the artifact (``code/cutlass/fp8_gemm.so``) and records it in the manifest;
the runtime opens it at load. The build test runs nvcc (1.5-2 minutes, cached) and is skipped where
the generator is missing; its GPU run is tests/gpu/test_cutlass_fp8_gpu.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.ir import Node, TensorType
from mxc.kernels import cutlass_fp8
from mxc.kernels.candidates import CANDIDATES
from mxc.models.registry import MODELS_DIR, bind_model, lookup
from tests import warm_python
from tests.sm90_compile import compile_env

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def _fp8_kernels():
    graph = bind_model(MODELS_DIR / "llama.yaml", TINY, "bfloat16", lookup("LlamaForCausalLM"))
    g = compile_graph(graph, BuildOptions(target="cuda", dtype="bfloat16", quant="fp8"))
    return {n.op: n.attrs["kernel"] for n, _ in g.nodes() if n.op in ("qlinear", "rms_norm_qlinear")}


def test_above_the_gemv_cutlass_where_it_builds_else_scaled_mm(monkeypatch):
    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    assert _fp8_kernels() == {
        "qlinear": [[32, "triton_fp8.qlinear_small_m"], [None, "fp8_gemm.cutlass"]],
        "rms_norm_qlinear": [[32, "cuda_ops.rms_norm_qlinear_small_m"], [None, "cuda_ops.rms_norm_qlinear_cutlass"]]}
    monkeypatch.setattr(cutlass_fp8, "available", lambda: "not installed")
    assert _fp8_kernels() == {
        "qlinear": [[32, "triton_fp8.qlinear_small_m"], [None, "fp8_gemm.scaled_mm"]],
        "rms_norm_qlinear": [[32, "cuda_ops.rms_norm_qlinear_small_m"], [None, "cuda_ops.rms_norm_qlinear_scaled_mm"]]}


def test_cutlass_says_why_not(monkeypatch):
    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    (cand,) = [c for c in CANDIDATES["qlinear"] if c.name == "fp8_gemm.cutlass"]
    x, w = TensorType(("T", 4096), "bfloat16"), TensorType((6144, 4096), "float8_e4m3fn")

    def why(granularity="channel", x=x, w=w, **options):
        node = Node("qlinear", ("y",), ("x", "w", "s"), {"granularity": granularity})
        return cand.why_not(node, [x, w, None], BuildOptions(target="cuda", dtype="bfloat16", **options))

    assert why() is None
    assert "row-wise scales" in why("block128")
    assert "sm_90a only, not sm_100" in why(arch=100)
    assert "multiple of 8" in why(w=TensorType((6140, 4096), "float8_e4m3fn"))
    assert "of 16" in why(w=TensorType((6144, 4088), "float8_e4m3fn"))
    assert "writes bf16" in why(x=TensorType(("T", 4096), "float16"))
    monkeypatch.setattr(cutlass_fp8, "available", lambda: "nvcc not found")
    assert why() == "fp8_gemm.cutlass: nvcc not found"


def test_turned_off_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cutlass_fp8.PREBUILT_ENV, "none")
    assert "turned off" in cutlass_fp8.available()
    monkeypatch.setenv(cutlass_fp8.PREBUILT_ENV, str(tmp_path / "missing.so"))
    assert "is not a file" in cutlass_fp8.available()


def test_runtime_without_a_library_says_so(monkeypatch):
    monkeypatch.setattr(cutlass_fp8, "_ACTIVE", [])
    with pytest.raises(RuntimeError, match="no CUTLASS fp8 library is loaded"):
        cutlass_fp8.active()


def _fp8_cuda_build(out, **env_overrides):
    env = {k: v for k, v in compile_env().items() if k != cutlass_fp8.PREBUILT_ENV}
    proc = warm_python.run([sys.executable, "-m", "mxc", "build", "llama.yaml", "--target", "cuda", "--quant", "fp8",
                            "--out", str(out), "--max-batch", "4", "--max-seq-len", "128", "--jobs", "1"],
                           env={**env, **env_overrides}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.skipif(cutlass_fp8.generator_available() is not None,
                    reason=f"CUTLASS generator unusable here: {cutlass_fp8.generator_available()}")
@pytest.mark.xdist_group("cutlass")  # one pytest-xdist worker compiles the library (tests/conftest.py)
def test_fp8_cuda_build_ships_the_library(tmp_path):
    """Generated and compiled by the build (a prebuilt library named by the environment is ignored here), then the
    same library named as prebuilt: shipped as it is, its config recorded as "prebuilt"."""
    out = tmp_path / "art"
    manifest = _fp8_cuda_build(out)
    entry = manifest["cutlass"]
    assert entry["library"] == cutlass_fp8.LIBRARY and entry["library"] in manifest["files"]
    assert entry["config"] == {"tile": [128, 128, 128], "cluster": [2, 1, 1], "schedule": "pingpong",
                               "fast_accum": True, "small_m": {"tile": [64, 128, 128], "cluster": [1, 1, 1],
                                                               "schedule": "pingpong", "fast_accum": True,
                                                               "max_m": 256}}
    gemm = cutlass_fp8.load(out / entry["library"])  # opens without a GPU (cudart is static)
    assert gemm.name == entry["kernel"] and "pingpong_fp8_fastaccum" in gemm.name
    program = (out / "code" / "forward.py").read_text()
    assert "fp8_gemm.cutlass(" in program and "cuda_ops.rms_norm_qlinear_cutlass(" in program
    assert not list(out.parent.glob(".art.*"))  # nothing half-written left
    again = _fp8_cuda_build(tmp_path / "again", **{cutlass_fp8.PREBUILT_ENV: str(out / entry["library"])})
    assert again["cutlass"] == {**entry, "config": "prebuilt"}
    assert (tmp_path / "again" / entry["library"]).read_bytes() == (out / entry["library"]).read_bytes()
