"""Already-fp8 checkpoints (HF fine-grained fp8, compressed-tensors fp8) are imported without requantizing.

The test makes such checkpoints from a tiny random HF model with mxc's own
quantizer, in each format's tensor names and config, then checks that the
imported artifact holds exactly the checkpoint's fp8 values and scales, and
that it equals building the original checkpoint with ``--quant fp8`` at the
same granularity.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import mxc
from mxc.loaders.convert import interleave_rows
from mxc.loaders.quantize import quantize_fp8

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {
    "hf-fp8-block": ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
                     "block128", "weight_scale_inv"),
    "compressed-tensors-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "type": "float", "num_bits": 8, "strategy": "channel"}}},
                                    "ignore": ["lm_head"]}, "channel", "weight_scale"),
    "compressed-tensors-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "type": "float", "num_bits": 8, "strategy": "tensor"}}},
                                   "ignore": ["lm_head"]}, "tensor", "weight_scale"),
    "compressed-tensors-block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "type": "float", "num_bits": 8, "strategy": "block",
                                      "block_structure": [128, 128]}}},
                                  "ignore": ["lm_head"]}, "block128", "weight_scale"),
}
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)


def _prequantize(src, dst, qconfig, granularity, suffix, keep=lambda name: False):
    """The checkpoint at ``src`` as an fp8 one at ``dst``: every linear weight but those ``keep`` names quantized."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS and not keep(name):
            q, s = quantize_fp8(t, granularity)
            out[name] = q
            out[name[: -len("weight")] + suffix] = s if granularity != "tensor" else s[:1].reshape(())
            if suffix == "weight_scale":
                out[name[: -len("weight")] + "input_scale"] = torch.tensor(1.0)  # static scale mxc ignores
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return out


def _refused(src, tmp_path, match: str, **options) -> mxc.MxcError:
    """``mxc.build`` of ``src`` fails with a one-line error matching ``match`` and writes nothing."""
    with pytest.raises(mxc.MxcError, match=match) as e:
        mxc.build(str(src), out=tmp_path / "a", progress=False, log=lambda m: None, **options)
    assert "\n" not in str(e.value) and not (tmp_path / "a").exists()
    return e.value


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prequantized_checkpoint_is_imported_as_is(fmt, hf_checkpoint, tmp_path):
    qconfig, granularity, suffix = FORMATS[fmt]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "imported", progress=False, log=lambda m: None)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["options"]["quant"] == "fp8" and manifest["options"]["quant_granularity"] == granularity
    assert "prequantized: true" in (art / "graph.yaml").read_text()

    weights = load_file(art / "weights" / "rank0.safetensors")
    p = "model.layers.1.self_attn."
    want_q = torch.cat([fp8[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(weights["layers.1.wqkv"].view(torch.uint8), want_q.view(torch.uint8))
    scales = [fp8[p + n + "." + suffix].float() for n in ("q_proj", "k_proj", "v_proj")]
    if granularity == "tensor":
        scales = [s.reshape(1).expand(128) for s in scales]
    assert torch.equal(weights["layers.1.wqkv_scale"], torch.cat(scales))
    # the MLP's gate/up: its rows interleaved in 64-row blocks for row-wise scales (interleave_gate_up)
    m = "model.layers.1.mlp."
    want_gu = torch.cat([fp8[m + n + ".weight"] for n in ("gate_proj", "up_proj")])
    if granularity != "block128":
        want_gu = interleave_rows(want_gu, 64)
    assert torch.equal(weights["layers.1.w_gate_up"].view(torch.uint8), want_gu.view(torch.uint8))

    requantized = mxc.build(str(ckpt), out=tmp_path / "requantized", quant="fp8", quant_granularity=granularity,
                            progress=False, log=lambda m: None)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    if granularity != "tensor":  # per-part tensor scales of merged weights differ from one scale per checkpoint tensor
        assert torch.equal(mxc.load(art).logits(ids), mxc.load(requantized).logits(ids))


def test_unsupported_quantization_config_is_refused(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, tmp_path, "quant_method 'awq' is not supported")


def test_fp8_tensor_not_declared_fp8_is_refused(hf_checkpoint, tmp_path):
    """An fp8 tensor where the graph expects bf16 (here: the LM head of an fp8 checkpoint) is never cast blindly."""
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    tensors = load_file(tmp_path / "fp8-ckpt" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "fp8-ckpt" / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path / "fp8-ckpt", tmp_path, "lm_head.weight is stored as torch.float8_e4m3fn")


def test_hf_fp8_without_weight_block_size_is_block_128(hf_checkpoint, tmp_path):
    """transformers' FineGrainedFP8Config defaults weight_block_size to (128, 128): an absent key means blocks."""
    qconfig, granularity, suffix = FORMATS["hf-fp8-block"]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", {k: v for k, v in qconfig.items() if k != "weight_block_size"},
                 granularity, suffix)
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "a", progress=False, log=lambda m: None)
    assert json.loads((art / "manifest.json").read_text())["options"]["quant_granularity"] == "block128"


def test_autofp8_checkpoint_is_per_tensor(hf_checkpoint, tmp_path):
    """AutoFP8's format (neuralmagic's fp8 Llama and Mixtral checkpoints): quant_method fp8 with no
    weight_block_size, one ``weight_scale`` a tensor and static ``input_scale``s. Read as vLLM reads it: per-tensor
    scales, not transformers' default blocks."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", {"quant_method": "fp8", "activation_scheme": "static",
                                                     "ignored_layers": ["lm_head"]}, "tensor", "weight_scale")
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "a", progress=False, log=lambda m: None)
    assert json.loads((art / "manifest.json").read_text())["options"]["quant_granularity"] == "tensor"
    weights = load_file(art / "weights" / "rank0.safetensors")
    p = "model.layers.0.mlp."
    assert torch.equal(weights["layers.0.w_gate_up_scale"], interleave_rows(torch.cat(  # (interleave_gate_up)
        [fp8[p + n + ".weight_scale"].reshape(1).expand(256) for n in ("gate_proj", "up_proj")]), 64))


@pytest.mark.parametrize("said, stored", [("block128", "tensor"), ("tensor", "block128"), ("tensor", "channel")])
def test_scales_unlike_the_config_are_refused(said, stored, hf_checkpoint, tmp_path):
    """Scales stored at another granularity than quantization_config names fail with their shape, instead of being
    read as that granularity (one value of each tensor's block grid taken as its scale, say)."""
    qconfig = {"quant_method": "fp8", "weight_block_size": [128, 128] if said == "block128" else None}
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, stored, "weight_scale_inv")
    _refused(tmp_path / "fp8-ckpt", tmp_path, r"_proj\.weight_scale_inv has shape \[.*\], expected ")


def test_compressed_tensors_groups_of_several_strategies_are_refused(hf_checkpoint, tmp_path):
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    groups = {"attention": {"targets": ["re:.*self_attn.*"], "weights": {"type": "float", "num_bits": 8,
                                                                          "strategy": "tensor"}},
              "mlp": {"targets": ["re:.*mlp.*"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", {**qconfig, "config_groups": groups}, granularity, suffix)
    _refused(tmp_path / "fp8-ckpt", tmp_path, r"config_groups mix the fp8 strategies \['channel', 'tensor'\]")


def test_compressed_tensors_blocks_other_than_128_are_refused(hf_checkpoint, tmp_path):
    qconfig, granularity, suffix = FORMATS["compressed-tensors-block"]
    group = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                                                "block_structure": [64, 64]}}
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", {**qconfig, "config_groups": {"g": group}}, granularity, suffix)
    _refused(tmp_path / "fp8-ckpt", tmp_path, r"block_structure \[64, 64\] is not supported \(expected \[128, 128\]\)")


def test_quant_lm_head_over_a_bf16_lm_head_says_so(hf_checkpoint, tmp_path):
    """--quant-lm-head on an fp8 checkpoint whose LM head is bf16 (the usual case): the error names the flag."""
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    _refused(tmp_path / "fp8-ckpt", tmp_path, r"missing tensor 'lm_head\.weight_scale' .*does not store that weight "
             r"in fp8 with scales \(--quant-lm-head asks for the LM head's; build without it\)", quant_lm_head=True)


MOE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=64)


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "compressed-tensors-tensor"])
def test_prequantized_moe_checkpoint_is_imported_as_is(fmt, hf_checkpoint, tmp_path):
    """An fp8 MoE checkpoint (the experts fp8 on disk, the router in the model dtype): each expert's fp8 values and
    scales are stacked as they are (a tensor scale repeated over its part's rows), and the model runs."""
    qconfig, granularity, suffix = FORMATS[fmt]
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", **MOE)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "imported", progress=False, log=lambda m: None)
    weights = load_file(art / "weights" / "rank0.safetensors")
    p = "model.layers.1.mlp.experts."
    parts = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    for stack, names in parts.items():
        want = torch.stack([torch.cat([fp8[f"{p}{e}.{n}.weight"] for n in names]) for e in range(8)])
        assert torch.equal(weights[f"layers.1.we_{stack}"].view(torch.uint8), want.view(torch.uint8)), stack
        scales = [[fp8[f"{p}{e}.{n}.{suffix}"].float().reshape(-1).expand(fp8[f"{p}{e}.{n}.weight"].shape[0])
                   for n in names] for e in range(8)]
        assert torch.equal(weights[f"layers.1.we_{stack}_scale"], torch.stack([torch.cat(s) for s in scales])), stack
    assert weights["layers.1.w_router"].dtype == torch.float32  # the router as the checkpoint holds it

    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = mxc.load(art).logits(ids)
    if granularity == "channel":  # mxc quantizes experts per row: the same values as the checkpoint's
        requantized = mxc.build(str(ckpt), out=tmp_path / "requantized", quant="fp8", progress=False,
                                log=lambda m: None)
        assert torch.equal(logits, mxc.load(requantized).logits(ids))
    else:  # within the fp8 bound of tests/models/test_fp8.py's MoE cases, from the unquantized model
        ref = mxc.load(mxc.build(str(ckpt), out=tmp_path / "bf16", progress=False, log=lambda m: None)).logits(ids)
        assert ((logits - ref).abs().max() / ref.abs().max()).item() < 8e-2


def test_block_scaled_fp8_moe_checkpoint_matches_transformers(hf_checkpoint, tmp_path, monkeypatch):
    """transformers' fine-grained fp8 of an MoE (Qwen3-30B-A3B-FP8's format): every expert's fp8 values and 128x128
    block scales are stacked as they are, and the logits equal transformers' on the dequantized weights once the
    dense layers' per-token activation quantization is taken out (weight-only on the CPU; with it, routing flips
    amplify its noise). Each expert block's scale is multiplied by its own factor (up to 16x), so a scale applied
    to the wrong block shows."""
    qconfig, granularity, suffix = FORMATS["hf-fp8-block"]
    shape = dict(MOE, hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2,
                 moe_intermediate_size=128)  # whole 128-row blocks in every merged part
    ckpt, model = hf_checkpoint("Qwen3MoeForCausalLM", **shape)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    g = torch.Generator().manual_seed(3)
    for name in [n for n in fp8 if ".experts." in n and n.endswith(suffix)]:
        fp8[name] = fp8[name] * torch.rand(fp8[name].shape, generator=g).mul(4).exp2()
    save_file(fp8, tmp_path / "fp8-ckpt" / "model.safetensors", metadata={"format": "pt"})
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "imported", progress=False, log=lambda m: None)
    weights = load_file(art / "weights" / "rank0.safetensors")
    p = "model.layers.1.mlp.experts."
    assert torch.equal(weights["layers.1.we_down"].view(torch.uint8),
                       torch.stack([fp8[f"{p}{e}.down_proj.weight"] for e in range(8)]).view(torch.uint8))
    assert torch.equal(weights["layers.1.we_gate_up_scale"], torch.stack(
        [torch.cat([fp8[f"{p}{e}.gate_proj.{suffix}"], fp8[f"{p}{e}.up_proj.{suffix}"]]) for e in range(8)]))

    deq = {}  # the checkpoint's own values, dequantized: what transformers runs
    for name, t in fp8.items():
        if name.endswith(suffix):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = fp8[name[: -len("weight")] + suffix]
            t = t.float() * s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        deq[name] = t
    model.load_state_dict(_hf_state(model, deq))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits.float()
    from mxc.kernels import fp8_ref, torch_ref

    monkeypatch.setattr(torch_ref, "qlinear", lambda *a, **k: fp8_ref.qlinear(*a, **k, weight_only=True))
    err = ((mxc.load(art).logits(ids) - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "hf-fp8-block"])
def test_fp8_experts_past_the_dtype_once_scaled_are_refused_by_name(fmt, hf_checkpoint, tmp_path):
    """An fp8 MoE checkpoint's expert whose values times its scales go past float32's largest (a damaged scale) is
    refused naming that expert's tensors, as a dense weight's is. Past the model dtype's largest, into which the
    experts are dequantized, a float16 build is refused with the wider --dtype to use (it built, and every logit
    came out NaN), and a bfloat16 one builds and runs."""
    qconfig, granularity, suffix = FORMATS[fmt]
    blocks = dict(hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2,
                  moe_intermediate_size=128)  # whole 128-row blocks in every merged part
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", **(dict(MOE, **blocks) if granularity == "block128" else MOE))
    dst = tmp_path / "fp8-ckpt"
    fp8 = _prequantize(ckpt, dst, qconfig, granularity, suffix)
    name = "model.layers.1.mlp.experts.5.up_proj."  # a merged part, not the first, of an expert in the middle
    fp8[name + "weight"][-1, -1] = -448.0  # fp8's largest, in the last row and block (their scales' below)
    weight = r"\(weight layers\.1\.we_gate_up\)"
    for scale, dtype, match in [
            (1e36, "float32", rf"\(up to 1e\+36\) is past float32's largest 3\.403e\+38 {weight}; the checkpoint is "
                              r"damaged$"),
            (1e3, "float16", rf"\(up to 1000\) is past float16's largest 6\.55e\+04 {weight}; build with a wider "
                             r"--dtype \(bfloat16 or float32\)$")]:
        fp8[name + suffix].view(-1)[-1] = scale
        save_file(fp8, dst / "model.safetensors", metadata={"format": "pt"})
        _refused(dst, tmp_path, rf"^{re.escape(str(dst))}: {re.escape(name)}weight times its scales "
                 rf"{re.escape(name + suffix)} {match}", dtype=dtype)
    art = mxc.build(str(dst), out=tmp_path / "bf16", dtype="bfloat16", progress=False, log=lambda m: None)
    assert mxc.load(art).logits(torch.tensor([[1, 2, 3]])).isfinite().all()


def _hf_state(model, tensors: dict) -> dict:
    """``tensors`` (per-expert names, as saved) in the model's in-memory layout (transformers 5 fuses experts)."""
    state = {}
    for key, cur in model.state_dict().items():
        if key in tensors:
            state[key] = tensors[key]
        elif key.endswith("mlp.experts.gate_up_proj"):
            pre = key[: -len("gate_up_proj")]
            state[key] = torch.stack([torch.cat([tensors[f"{pre}{e}.gate_proj.weight"],
                                                 tensors[f"{pre}{e}.up_proj.weight"]]) for e in range(cur.shape[0])])
        elif key.endswith("mlp.experts.down_proj"):
            pre = key[: -len("down_proj")]
            state[key] = torch.stack([tensors[f"{pre}{e}.down_proj.weight"] for e in range(cur.shape[0])])
        else:
            raise KeyError(key)
        assert state[key].shape == cur.shape, key
    return state


def test_an_fp8_router_is_refused_by_name(hf_checkpoint, tmp_path):
    """A router stored in fp8 (mxc keeps routers in the model dtype): the error names the tensor and the weight, not
    'unexpected tensor'."""
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", **MOE)
    dst = tmp_path / "fp8-ckpt"
    _prequantize(ckpt, dst, qconfig, granularity, suffix)
    tensors = load_file(dst / "model.safetensors")
    for i in range(2):
        q, s = quantize_fp8(tensors[f"model.layers.{i}.mlp.gate.weight"], granularity)
        tensors[f"model.layers.{i}.mlp.gate.weight"], tensors[f"model.layers.{i}.mlp.gate.weight_scale"] = q, s
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    _refused(dst, tmp_path, r"model\.layers\.0\.mlp\.gate\.weight is stored in fp8 with scales .*"
             r"keeps weight layers\.0\.w_router in the model dtype")


def test_linears_an_fp8_checkpoint_keeps_unquantized_stay_so(hf_checkpoint, tmp_path):
    """Layers an fp8 checkpoint leaves in the model dtype (here the shared expert, as an ``ignore`` entry leaves it):
    told by their missing scales, imported as they are, named in the manifest; the rest imported in fp8."""
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, hf = hf_checkpoint("Qwen2MoeForCausalLM", **MOE, shared_expert_intermediate_size=96)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", {**qconfig, "ignore": ["lm_head", "re:.*shared_expert.*"]},
                       granularity, suffix, keep=lambda name: ".shared_expert." in name)
    art = mxc.build(str(tmp_path / "fp8-ckpt"), out=tmp_path / "a", progress=False, log=lambda m: None)
    kept = json.loads((art / "manifest.json").read_text())["options"]["quant_unquantized"]
    assert kept == [f"model.layers.{{i}}.mlp.shared_expert.{n}.weight" for n in ("down_proj", "gate_proj", "up_proj")]
    weights = load_file(art / "weights" / "rank0.safetensors")
    assert weights["layers.1.ws_down"].dtype == torch.float32 and "layers.1.ws_down_scale" not in weights
    assert torch.equal(weights["layers.1.ws_down"], fp8["model.layers.1.mlp.shared_expert.down_proj.weight"])
    assert weights["layers.1.we_down"].dtype == weights["layers.1.wqkv"].dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits.float()
    assert ((mxc.load(art).logits(ids) - ref).abs().max() / ref.abs().max()).item() < 8e-2


@pytest.mark.parametrize("keep, needle", [
    (lambda n: n.startswith("model.layers.0.self_attn.q_proj"),  # one layer's q_proj only
     r"model\.layers\.1\.self_attn\.q_proj\.weight is fp8 .* but model\.layers\.0\.self_attn\.q_proj\.weight is not"),
    (lambda n: ".k_proj." in n,  # k in every layer, merged with fp8 q and v
     r"stores model\.layers\.\{i\}\.self_attn\.q_proj\.weight in fp8 but .*k_proj\.weight unquantized, and mxc "
     r"merges them"),
    (lambda n: ".experts." in n and ".down_proj." in n,  # the experts' down matrices only
     r"experts\.\{e\}\.gate_proj\.weight in fp8 but .*experts\.\{e\}\.down_proj\.weight unquantized"),
], ids=["one-layer", "merged-part", "expert-down"])
def test_fp8_checkpoints_mixed_within_a_weight_are_refused(keep, needle, hf_checkpoint, tmp_path):
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", **MOE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix, keep=keep)
    assert "--quant fp8" in str(_refused(tmp_path / "fp8-ckpt", tmp_path, needle))


@pytest.mark.parametrize("arch,name,dtype", [
    ("LlamaForCausalLM", "model.layers.1.self_attn.k_proj.weight", torch.float16),  # a merged part, not the first
    ("LlamaForCausalLM", "model.layers.0.self_attn.q_proj.weight", torch.float8_e5m2),
    ("Qwen3MoeForCausalLM", "model.layers.1.mlp.experts.3.up_proj.weight", torch.bfloat16),  # an expert stack's part
], ids=["merged-part", "e5m2", "expert"])
def test_an_fp8_checkpoint_part_in_another_dtype_is_named(arch, name, dtype, hf_checkpoint, tmp_path):
    """A weight of a declared-fp8 checkpoint whose scale is there but whose values are not e4m3: the build names the
    tensor. It used to fail in torch.cat (a merged part) or, for an expert stack, cast the values into e4m3 as if
    they were its codes."""
    qconfig, granularity, suffix = FORMATS["compressed-tensors-channel"]
    ckpt, _ = hf_checkpoint(arch, **(MOE if "Moe" in arch else SHAPE))
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    fp8[name] = fp8[name].float().to(dtype)
    save_file(fp8, tmp_path / "fp8-ckpt" / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path / "fp8-ckpt", tmp_path, rf"{re.escape(name)} is stored as {dtype}, but config.json's "
             r"quantization_config says the checkpoint holds float8_e4m3fn")


def test_block_scales_of_merged_parts_off_the_block_grid_are_refused(hf_checkpoint, tmp_path):
    """q of 384 rows (3 blocks) and k, v of 96 (1 block each) stack to 5 block rows, as 576 merged rows would:
    the shapes agree, but k's and v's scales would cover rows of other parts. Refused, not built wrong."""
    qconfig, granularity, suffix = FORMATS["hf-fp8-block"]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=96)
    _prequantize(ckpt, tmp_path / "fp8", qconfig, granularity, suffix)
    _refused(tmp_path / "fp8", tmp_path, "not whole 128-row blocks; for --target cpu, --disable-pass merge_qkv "
                                         ".or merge_gate_up. keeps the parts apart$")
    apart = mxc.load(mxc.build(str(tmp_path / "fp8"), out=tmp_path / "apart", disable_passes=["merge_qkv"],
                               progress=False, log=lambda m: None))  # the hint builds
    assert apart.logits(torch.tensor([[1, 2, 3]])).isfinite().all()


def test_a_granularity_unlike_the_checkpoints_is_refused(hf_checkpoint, tmp_path):
    """--quant-granularity cannot requantize an fp8 checkpoint: asking for another one than it has is an error."""
    qconfig, granularity, suffix = FORMATS["hf-fp8-block"]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8", qconfig, granularity, suffix)
    _refused(tmp_path / "fp8", tmp_path, r"already fp8 \(block128 scales\); --quant-granularity tensor cannot "
             r"change that", quant_granularity="tensor")


def _bound(arch, **fields):
    """The bound graph of ``arch`` at a tiny size (no checkpoint: unquantized_linears only reads tensor names)."""
    from mxc.models.registry import bind_model, lookup

    config = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=10000.0, architectures=[arch], **fields)
    return bind_model(lookup(arch).path, config, "float32", lookup(arch))


def test_one_unquantized_expert_is_refused_by_name():
    """Experts are fp8 in every expert or none: one expert's gate stored without a scale (any expert, not only the
    first) is named beside a quantized one."""
    from mxc.loaders.prequantized import unquantized_linears

    graph = _bound("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    names = [f"model.layers.{i}.{p}.{s}" for i in range(2) for p in
             [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] +
             [f"mlp.experts.{e}.{n}" for e in range(4) for n in ("gate_proj", "up_proj", "down_proj")]
             for s in ("weight", "weight_scale")]
    assert unquantized_linears(graph, names, "weight_scale", "ckpt") == ()
    names.remove("model.layers.1.mlp.experts.2.gate_proj.weight_scale")
    with pytest.raises(mxc.MxcError, match=r"ckpt: model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight is fp8 "
                                           r"\(it has weight_scale\) but "
                                           r"model\.layers\.1\.mlp\.experts\.2\.gate_proj\.weight is not"):
        unquantized_linears(graph, names, "weight_scale", "ckpt")


@pytest.mark.parametrize("qc", [None, {}])
def test_no_or_empty_quantization_config_is_unquantized(qc):
    from mxc.loaders.prequantized import checkpoint_quantization

    assert checkpoint_quantization({"quantization_config": qc}, "config.json") is None
    assert checkpoint_quantization({}, "config.json") is None


@pytest.mark.parametrize("qc, needle", [
    ("fp8", r"quantization_config must be a JSON object, got str"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]},
     r"quantization_config\.weight_block_size \[64, 64\] is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": ["g"]},
     r"quantization_config\.config_groups must map group names to objects"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8,
                                                                               "strategy": "channel"}}}},
     r"compressed-tensors scheme .*'int'.* is not fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4,
                                                                               "strategy": "channel"}}}},
     r"compressed-tensors scheme .*'num_bits': 4.* is not fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, r"compressed-tensors scheme \{\} is not fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8,
                                                                               "strategy": "group"}}}},
     r"compressed-tensors fp8 strategy 'group' is not supported"),
], ids=["not-object", "block-64", "groups-list", "int8", "fp4", "no-groups", "group-strategy"])
def test_unsupported_quantization_configs_are_refused_in_one_line(qc, needle):
    from mxc.loaders.prequantized import checkpoint_quantization

    with pytest.raises(mxc.MxcError, match=r"^config\.json: " + needle) as e:
        checkpoint_quantization({"quantization_config": qc}, "config.json", names=lambda: [])
    assert "\n" not in str(e.value)


def test_fine_grained_fp8_with_some_weight_scale_names_stays_blocks():
    """quant_method fp8 without weight_block_size: per-tensor (AutoFP8) only where the scales are all
    ``weight_scale``; a checkpoint with ``weight_scale_inv`` scales is transformers' 128x128 blocks."""
    from mxc.loaders.prequantized import checkpoint_quantization

    config = {"quantization_config": {"quant_method": "fp8"}}
    autofp8 = ["a.weight", "a.weight_scale", "a.input_scale"]
    assert checkpoint_quantization(config, "c", names=lambda: autofp8) == ("tensor", "weight_scale")
    both = ["a.weight", "a.weight_scale_inv", "b.weight", "b.weight_scale"]
    assert checkpoint_quantization(config, "c", names=lambda: both) == ("block128", "weight_scale_inv")


@pytest.mark.parametrize("fmt, name", [
    ("hf-fp8-block", "model.layers.1.self_attn.k_proj.weight"),  # a merged part, not the first
    ("compressed-tensors-channel", "model.layers.0.mlp.down_proj.weight"),
    ("compressed-tensors-tensor", "model.layers.1.mlp.up_proj.weight"),
    ("compressed-tensors-block", "model.layers.0.self_attn.o_proj.weight"),
])
def test_a_nan_in_an_fp8_weight_is_refused_by_name(fmt, name, hf_checkpoint, tmp_path):
    """An fp8 weight imported as stored holding a NaN code (0x7f; e4m3fn has no infinity): refused naming the tensor,
    as a NaN in a bf16 weight is, not built into a model that generates garbage."""
    qconfig, granularity, suffix = FORMATS[fmt]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    fp8[name].view(torch.uint8)[3, 5] = 0x7F if "block" in fmt else 0xFF  # +NaN and -NaN
    save_file(fp8, tmp_path / "fp8-ckpt" / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path / "fp8-ckpt", tmp_path, rf"{re.escape(name)} holds NaN fp8 values \(bytes 0x7f or 0xff; weight "
             r"layers\.\d\.w\w+\); the checkpoint is damaged")


@pytest.mark.parametrize("fmt, dtype", [("hf-fp8-block", torch.bool), ("compressed-tensors-channel", torch.int32),
                                        ("compressed-tensors-tensor", torch.bool)])
def test_fp8_scales_stored_as_integers_or_bools_are_refused(fmt, dtype, hf_checkpoint, tmp_path):
    """A scale tensor that is not floating point (read as float: every scale 1.0, or whole numbers) is refused by
    name before the build compiles anything."""
    qconfig, granularity, suffix = FORMATS[fmt]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    fp8 = _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, suffix)
    name = f"model.layers.1.mlp.gate_proj.{suffix}"
    fp8[name] = fp8[name].to(dtype)
    save_file(fp8, tmp_path / "fp8-ckpt" / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path / "fp8-ckpt", tmp_path, rf"{re.escape(name)} is stored as {dtype}, expected floating-point fp8 "
             r"scales \(weight layers\.1\.w_gate_up_scale\)")


@pytest.mark.parametrize("fmt, stored", [("hf-fp8-block", "weight_scale"),
                                         ("compressed-tensors-block", "weight_scale_inv")])
def test_scale_names_unlike_the_config_are_refused(fmt, stored, hf_checkpoint, tmp_path):
    """quantization_config implies the scale tensors' names (transformers' blocks: weight_scale_inv; compressed-tensors:
    weight_scale); where the checkpoint has only the other name, the two disagree, which the error says rather than
    that the layers are "kept in the model dtype"."""
    qconfig, granularity, suffix = FORMATS[fmt]
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", **SHAPE)
    _prequantize(ckpt, tmp_path / "fp8-ckpt", qconfig, granularity, stored)
    _refused(tmp_path / "fp8-ckpt", tmp_path, rf"config\.json: quantization_config \(quant_method .*\) means scale "
             rf"tensors named \*\.{suffix}, but the checkpoint's are named \*\.{stored} \(model\..*\.{stored}\): the "
             r"config and the tensor names disagree")
