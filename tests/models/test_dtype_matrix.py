"""The dtype matrix: checkpoints stored in float16 and bfloat16 (and mixed), builds in each --dtype, the default.

tests/models/test_hf_parity.py holds every architecture to transformers in float32; here each architecture family is
built from a checkpoint saved in 16 bits, in that dtype, against transformers loaded in it. The bounds are the GPU
end-to-end tests' for bf16 (tests/gpu/test_cuda_e2e.py: logits within 3% of their scale, each greedy token within 2%
of the scale of the reference's best on the same sequence): measured here, every case is within 0.8% (bf16) and
0.1% (fp16) of transformers, as transformers in 16 bits is of itself in float32; the fp16 bound sits above that.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mxc
from mxc.inspect import summary
from mxc.loaders.quantize import quantize_fp8

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
NEW = 8
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}

ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 6}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 48}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40}),
    "olmoe": ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
}


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _build(ckpt, out, **options):
    return mxc.build(str(ckpt), out=out, progress=False, log=lambda m: None, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(ARCHS))
def test_16_bit_checkpoint_built_in_its_dtype_matches_hf_in_it(case, dtype, hf_checkpoint, tmp_path):
    arch, overrides = ARCHS[case]
    ckpt, hf = hf_checkpoint(arch, dtype=dtype, **overrides)  # saved in 16 bits: config.json says so too
    name = str(dtype).removeprefix("torch.")
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == name
    model = mxc.load(_build(ckpt, tmp_path / "art", dtype=name))
    assert model.manifest["options"]["dtype"] == model.manifest["runtime"]["dtype"] == name
    with safe_open(model.path / "weights" / "rank0.safetensors", "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {{"float16": "F16", "bfloat16": "BF16"}[name]}
    assert f"dtype {name}," in summary(model.path)

    with torch.no_grad():
        ref = hf(IDS).logits
    got = model.logits(IDS)
    assert got.dtype == torch.float32 and _rel(got, ref) < TOL[dtype], _rel(got, ref)

    # greedy tokens, each checked against transformers' logits over the same sequence (teacher-forced): the chosen
    # token's logit within 2% of the scale of the best one (16-bit sums in another order flip near ties)
    tokens = model.generate(IDS, max_new_tokens=NEW)
    with torch.no_grad():
        ref = hf(torch.cat([IDS, tokens], 1)).logits.float()[:, IDS.shape[1] - 1:-1]
    gap = (ref.max(-1).values - ref.gather(-1, tokens[..., None])[..., 0]) / ref.abs().amax(-1)
    assert float(gap.max()) < 2e-2 and int((gap > 0).sum()) <= 2, gap


def test_an_expert_stack_of_mixed_dtypes_is_quantized_as_stored(hf_checkpoint, tmp_path):
    """--quant fp8 over an expert stack whose experts a checkpoint stores in different dtypes: the stack was made in
    the first expert's dtype, so a float32 expert after a float16 one was rounded to float16 before it was
    quantized (other fp8 values and scales than its own), or, with values past float16's range, cast to inf and the
    build refused ("holds NaN or infinite values once converted to float8_e4m3fn"). Each expert is now quantized
    from its values as stored, bit for bit as quantize_fp8 makes them (test_fp8.py's check)."""
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)
    tensors = load_file(ckpt / "model.safetensors")
    down = "model.layers.0.mlp.experts.{}.down_proj.weight"
    tensors[down.format(0)] = tensors[down.format(0)].to(torch.float16)
    tensors[down.format(1)] = tensors[down.format(1)] * 1e7  # float32 values up to ~1e5: past float16's 65504
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    art = _build(ckpt, tmp_path / "fp8", quant="fp8", dtype="float32")
    with safe_open(art / "weights" / "rank0.safetensors", "pt") as f:
        q, scale = f.get_tensor("layers.0.we_down"), f.get_tensor("layers.0.we_down_scale")
    for e in range(4):
        want_q, want_scale = quantize_fp8(tensors[down.format(e)], "channel")
        assert torch.equal(q[e].view(torch.uint8), want_q.view(torch.uint8)), e
        assert torch.equal(scale[e], want_scale), e


@pytest.mark.parametrize("fields, want", [
    ({"dtype": "float16"}, "float16"),
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # transformers 4's name for the field
    ({"dtype": None, "torch_dtype": "float16"}, "float16"),  # transformers: torch_dtype where dtype is null
    ({"dtype": "float32"}, "bfloat16"),  # the GPU path's default 16-bit dtype, as before
    ({}, "bfloat16"),
])
def test_a_cuda_build_without_dtype_takes_config_json_s_16_bit_dtype(fields, want, hf_checkpoint, tmp_path,
                                                                      monkeypatch):
    """With no --dtype, --target cuda built every checkpoint in bfloat16: a float16 one (config.json's dtype, what
    transformers loads it in by default) had each weight rounded from 11 bits of mantissa to 8. It now takes
    config.json's dtype where that is float16 or bfloat16 (which may differ from the stored tensors': transformers
    follows config.json there too); --dtype still decides, and the CPU target stays float32, which holds any
    checkpoint's values exactly. The kernels' compiling (minutes, and the same for any dtype) is left out."""
    from mxc import builder

    monkeypatch.setattr(builder, "_compile_kernels", lambda *a, **k: None)
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("dtype", None)
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))
    kw = dict(target="cuda", max_batch=2, max_seq_len=32)
    options = lambda art: json.loads((art / "manifest.json").read_text())["options"]  # noqa: E731
    assert options(_build(ckpt, tmp_path / "default", **kw))["dtype"] == want
    assert options(_build(ckpt, tmp_path / "asked", dtype="float32", **kw))["dtype"] == "float32"
    art = _build(ckpt, tmp_path / "cpu")
    assert options(art)["dtype"] == "float32"
    assert mxc.load(art).logits(IDS).dtype == torch.float32
