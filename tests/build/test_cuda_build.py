"""`mxc build --target cuda` on a machine without a GPU: every kernel the program launches compiles for sm_90.

Runs the CLI in another process without TRITON_INTERPRET (the AOT compiler needs real JIT functions; a fork of a
warm interpreter, tests/warm_python.py), for the Llama default and a Qwen3 config (q/k norm, explicit head_dim, tied
embeddings, yarn RoPE), and checks the artifact: an ELF cubin per recorded kernel, the parameter lists read from PTX,
and the target recorded in the manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mxc.kernels import launch
from mxc.runtime_buckets import prefill_graph_buckets
from tests import warm_python
from tests.sm90_compile import compile_env

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}}


QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True}


OLMOE = {"architectures": ["OlmoeForCausalLM"], "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False}


# Mixtral keeps its routing weights in float32 (``route(fp32_weights=True)``): the routers store them in fp32, the
# fused MoE kernels read them (and the sorted path's products before the k-sum are fp32) with bf16 activations
MIXTRAL = {**{k: v for k, v in OLMOE.items() if k not in ("num_experts", "norm_topk_prob")},
           "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}


# top 1 of 6 experts: the router's top-k at k = 1 (Triton 3.6's tl.topk fails to compile there)
QWEN3_MOE_TOP1 = {**QWEN3_MOE, "num_experts": 6, "num_experts_per_tok": 1}
# float16 checkpoints build in float16 on cuda (builder.default_dtype): fp8 experts and dense layers reading fp16
# activations; a sliding window with the push all-reduce summing fp16
QWEN3_MOE_FP16 = {**QWEN3_MOE, "dtype": "float16"}
MISTRAL_FP16 = {**QWEN3, "architectures": ["MistralForCausalLM"], "sliding_window": 16, "tie_word_embeddings": False,
                "dtype": "float16"}
BUILDS = [(None, 1, None), (QWEN3, 1, None), (None, 2, None), (None, 1, "fp8"), (QWEN3_MOE, 2, None),
          (QWEN3_MOE, 1, "fp8"), (OLMOE, 1, None), (QWEN3_MOE_TOP1, 1, None), (QWEN3_MOE_FP16, 1, "fp8"),
          (MISTRAL_FP16, 2, None), (MIXTRAL, 1, None)]
BUILD_IDS = ["llama-default", "qwen3-yarn", "llama-tp2", "llama-fp8", "qwen3-moe-tp2", "qwen3-moe-fp8", "olmoe",
             "qwen3-moe-top1", "qwen3-moe-fp8-fp16", "mistral-window-tp2-fp16", "mixtral"]
GPU_TRITON = os.environ.get("MXC_GPU_TRITON")  # a folder holding the GPU machines' Triton (.ci/run fetches 3.6.0)


def _params(skip=()):
    """BUILDS as parameters; the fp8 ones share a pytest-xdist worker with the other tests that compile the CUTLASS
    library (tests/conftest.py), so one compiles it and the rest find it cached."""
    return [pytest.param(*b, id=i, marks=[pytest.mark.xdist_group("cutlass")] if b[2] == "fp8" else [])
            for b, i in zip(BUILDS, BUILD_IDS) if i not in skip]


def _build(config, tp, quant, tmp_path, triton_path=None):
    """``mxc build --target cuda`` in another process (kernels compiled, not interpreted), optionally with the
    Triton package in ``triton_path``; returns the artifact directory."""
    # --jobs 1: the kernels compile in the build's process (the suite's workers already fill the cores)
    args = [sys.executable, "-m", "mxc", "build", "llama.yaml", "--target", "cuda", "--out", str(tmp_path / "art"),
            "--max-batch", "4", "--max-seq-len", "128", "--tp", str(tp), "--jobs", "1"]
    args += ["--quant", quant] if quant else []
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "config.json")]
    proc = warm_python.run(args, env=compile_env(triton_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp_path / "art"


@pytest.mark.skipif(not GPU_TRITON, reason="MXC_GPU_TRITON not set (a folder with the GPU machines' Triton package)")
@pytest.mark.parametrize("config,tp,quant", _params(skip=["qwen3-moe-fp8"]))
def test_cuda_build_compiles_with_the_gpu_triton(config, tp, quant, tmp_path):
    """The same builds with the Triton of the GPU machines, which refuses code the newer CPU one takes
    (a None in a returned tuple broke a GPU build once): every kernel must compile with both."""
    art = _build(config, tp, quant, tmp_path, GPU_TRITON)
    version = json.loads((art / "manifest.json").read_text())["target"]["triton"]
    import triton

    assert version != triton.__version__, f"the build used this environment's Triton {version}, not MXC_GPU_TRITON's"


@pytest.mark.parametrize("config,tp,quant", _params())
def test_cuda_build_compiles_every_kernel_for_sm90(config, tp, quant, tmp_path):
    art = _build(config, tp, quant, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["name"] == "cuda" and manifest["target"]["arch"] == "sm_90"
    assert manifest["target"]["triton"]
    assert manifest["options"]["dtype"] == (config or {}).get("dtype", "bfloat16")
    index = json.loads((art / "code" / "kernels" / "index.json").read_text())
    kernels = {e["kernel"].split(":")[0].rsplit(".", 1)[1] for e in index.values()}
    # the fused operations' kernels are rendered from templates; their sources ship beside the cubins
    rendered = {e["kernel"].split(":")[0].split(".")[1].rsplit("_", 1)[0] for e in index.values() if "source" in e}
    assert {"rms_norm", "rope_qkv_write", "decode_attention", "prefill_attention"} <= rendered
    if config is None and tp == 1 and not quant:  # (fp8 folds SiLU into the quantize; tp > 1 gathers by vocab)
        assert {"silu_mul", "embedding"} <= rendered
    for entry in (e for e in index.values() if "source" in e):
        source = (art / "code" / "kernels" / entry["source"]).read_text()
        assert "Generated by mxc from mxc/kernels/templates/" in source
        assert f"def {entry['kernel'].split(':')[1]}(" in source
        assert f"code/kernels/{entry['source']}" in manifest["files"]
    assert ("triton_fp8_gemv" if quant else "triton_gemv") in kernels
    if config in (QWEN3_MOE, QWEN3_MOE_TOP1, QWEN3_MOE_FP16):
        assert "triton_moe" in kernels
    if config in (QWEN3_MOE_FP16, MISTRAL_FP16):  # every kernel compiled for fp16 tensors, none for bf16
        args = [a for e in index.values() for a in e["args"]]
        assert any("fp16" in a for a in args) and not any("bf16" in a for a in args)
    if config in (MIXTRAL, OLMOE):  # the routing weights' kernels: fp32 pointers only for Mixtral's weights
        routing = {"route_kernel", "norm_route_kernel", "_moe_gemm2_kernel", "_moe_sum_kernel",
                   "_pair_down_tile_kernel", "_pair_down_sum_kernel"}
        fp32 = {e["kernel"].split(":")[1]: "*fp32" in e["args"] for e in index.values()
                if e["kernel"].split(":")[1] in routing}
        assert set(fp32) >= routing - {"_pair_down_sum_kernel"}  # k = 2: the tiled down kernel
        assert set(fp32.values()) == {config is MIXTRAL}, fp32
        assert ("fp32_weights=True" in (art / "code" / "forward.py").read_text()) is (config is MIXTRAL)
    if config is MISTRAL_FP16:
        assert "push_all_reduce" in rendered
        assert {e.get("template_params", {}).get("WINDOW") for e in index.values()} >= {16}
    for key, entry in index.items():
        cubin = (art / "code" / "kernels" / entry["file"]).read_bytes()
        assert cubin[:4] == b"\x7fELF", key
        expected = _param_kinds(entry["args"])
        assert entry["params"][: len(expected)] == expected
        assert all(p == "ptr" for p in entry["params"][len(expected):])  # Triton's scratch pointers
        assert len(entry.get("tensordesc", [])) == sum(a.startswith("tensordesc") for a in entry["args"])
        if "prefill_attention" in entry["kernel"]:  # power-of-two heads: q, K and V through TMA maps
            assert entry["args"][-3:] == [entry["args"][-1]] * 3 and entry["args"][-1].startswith("tensordesc<")
        assert f"code/kernels/{entry['file']}" in manifest["files"]
    assert {f"weights/rank{r}.safetensors" for r in range(tp)} <= set(manifest["files"])
    program = (art / "code" / "forward.py").read_text()
    assert "cuda_ops.qkv_rope_cache" in program and "cuda_ops.cached_attention" in program
    assert ("triton_fp8.qlinear_small_m" if quant else "triton_gemv.linear_small_m") in program
    if config is None and tp == 1 and not quant:
        _same_keys_in_a_fresh_process(art, compile_env())
        from mxc.inspect import summary  # `mxc inspect`: per-bucket kernel choices and the rendered kernels

        text = summary(art)
        assert "triton_gemv.linear_small_m (<= 16 tokens) / " in text and "cublas.linear" in text
        assert "kernel modules rendered from templates" in text and "  rms_norm(BLOCK_H=" in text
        options = manifest["options"]  # the largest prompt bucket: none past --max-seq-len (512 here, under 2048)
        assert options["max_seq_len"] < options["prefill_graph_tokens"]
        largest = prefill_graph_buckets(options["prefill_graph_tokens"], options["max_seq_len"])[-1]
        assert largest <= options["max_seq_len"] and f"prefill graphs up to {largest} tokens," in text
        assert f"KV cache {manifest['options']['max_batch']} x {manifest['options']['max_seq_len']} tokens" in text


def _param_kinds(args: list[str]) -> list[str]:
    """The PTX parameter kinds of a kernel's runtime arguments: a pointer, an i32, an f32, or a tensor descriptor's
    TMA map followed by its shape (i32) and strides (i64)."""
    kinds = []
    for a in args:
        rank = launch.descriptor_rank(a)
        kinds += ["tmap"] + ["i32"] * rank + ["i64"] * rank if rank else \
            ["ptr" if a.startswith("*") else {"i32": "i32", "fp32": "f32"}[a]]
    return kinds


# Records the artifact's launches again in a new process (another hash seed and working directory) with
# its stored kernel sources pinned, as the runtime's launcher does: every binary must be found.
_RECORD_AGAIN = """
import json, sys, types
from pathlib import Path
from mxc.codegen import aot
from mxc.kernels import kernel_templates
from mxc.ir.serialize import load_graph
art = Path(sys.argv[1])
index = json.loads((art / "code/kernels/index.json").read_text())
for e in index.values():
    if "source" in e:
        kernel_templates.pin(e["template"], e["template_params"], e["kernel"].split(":")[0],
                             (art / "code/kernels" / e["source"]).read_text())
program = types.ModuleType("forward")
exec(compile((art / "code/forward.py").read_text(), "forward.py", "exec"), program.__dict__)
options = json.loads((art / "manifest.json").read_text())["options"]
specs = aot.record(program, load_graph((art / "graph.yaml").read_text()), options["max_batch"],
                   options["max_seq_len"], pdl=options.get("pdl", False),
                   prefill_graph_tokens=options.get("prefill_graph_tokens", 0))
print(json.dumps({"recorded": len(specs), "missing": [s["kernel"] for k, s in specs.items() if k not in index]}))
"""


def _same_keys_in_a_fresh_process(art, env):
    proc = subprocess.run([sys.executable, "-c", _RECORD_AGAIN, str(art)], env={**env, "PYTHONHASHSEED": "7"},
                          cwd=art.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["recorded"] > 10 and result["missing"] == []


def test_cuda_build_with_pdl(tmp_path):
    """--pdl: every kernel is compiled with USE_PDL (its PTX waits on the kernel before it; the build checks)
    and the index marks it for the programmatic-dependent launch; the manifest records the option."""
    args = [sys.executable, "-m", "mxc", "build", "llama.yaml", "--target", "cuda", "--out", str(tmp_path / "art"),
            "--max-batch", "2", "--max-seq-len", "64", "--pdl"]
    proc = warm_python.run(args, env=compile_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    art = tmp_path / "art"
    assert json.loads((art / "manifest.json").read_text())["options"]["pdl"] is True
    index = json.loads((art / "code" / "kernels" / "index.json").read_text())
    assert index and all(e["pdl"] for e in index.values())
