"""config.json fields the model math depends on, as transformers reads them: left out, set to values the graph
does not compute, or set where the architecture's transformers class ignores them.

A field a config.json leaves out must take the transformers config class's default (registry.yaml ``defaults``);
a value llama.yaml does not compute (``hidden_act``, partial rotary with the default RoPE) is refused naming the
field; a field the architecture ignores (a ``sliding_window`` left in a Llama config, ``attention_bias`` in a Mistral
one) must not change the model.
"""

from __future__ import annotations

import pytest
import transformers

from mxc.errors import MxcError
from mxc.models.registry import bind_model, lookup, registry

# only the fields without which no config binds: every other field the graph reads is left out
# (32 heads: every config class's num_key_value_heads default divides it)
REQUIRED = dict(hidden_size=1024, intermediate_size=96, num_hidden_layers=1, num_attention_heads=32, vocab_size=256,
                max_position_embeddings=128)
CONFIG_CLASSES = {
    "LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config,
    "MixtralForCausalLM": transformers.MixtralConfig, "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig, "OlmoeForCausalLM": transformers.OlmoeConfig,
}


def bound(arch: str, **fields):
    entry = lookup(arch)
    return bind_model(entry.path, {**REQUIRED, "architectures": [arch], **fields}, "float32", entry)


def hf_reads(arch: str, hf) -> dict:
    """What the architecture's transformers modeling code takes from a config (None: the graph has no such part)."""
    moe = arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
    windowed = arch in ("MistralForCausalLM", "MixtralForCausalLM") or getattr(hf, "use_sliding_window", False)
    reads = {
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "rms_norm_eps": hf.rms_norm_eps,
        "hidden_act": hf.hidden_act,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "attention_window": hf.sliding_window if windowed else None,
        "theta": hf.rope_parameters["rope_theta"],
    }
    if moe:
        reads["num_experts_per_tok"] = hf.num_experts_per_tok
        reads["num_experts"] = getattr(hf, "num_experts", None) or hf.num_local_experts
        reads["moe_intermediate_size"] = getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    if arch == "Qwen2MoeForCausalLM":
        reads["shared_expert_intermediate_size"] = hf.shared_expert_intermediate_size
        reads["qkv_bias"] = hf.qkv_bias
    return reads


@pytest.mark.parametrize("arch", sorted(CONFIG_CLASSES))
def test_fields_left_out_take_the_transformers_default(arch):
    graph = bound(arch)
    params = {**graph.config, "theta": graph.config["rope"]["theta"]}
    want = hf_reads(arch, CONFIG_CLASSES[arch](**REQUIRED))
    assert {k: params[k] for k in want} == want


def test_every_tested_architecture_is_covered():
    assert {a for a, e in registry().items() if e.tested} == set(CONFIG_CLASSES)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_an_activation_the_graph_does_not_compute_is_refused(act):
    with pytest.raises(MxcError, match=f"config.json: field hidden_act = '{act}': llama.yaml supports 'silu' or "
                                       "'swish' only"):
        bound("MixtralForCausalLM", hidden_act=act)
    bound("LlamaForCausalLM", hidden_act="swish")  # transformers' other name for SiLU


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "OlmoeForCausalLM", "Qwen3ForCausalLM"])
def test_a_window_the_architecture_ignores_is_dropped(arch):
    assert bound(arch, sliding_window=4).config["attention_window"] is None
    assert bound("MistralForCausalLM", sliding_window=4).config["attention_window"] == 4
    assert bound("MistralForCausalLM", sliding_window=None).config["attention_window"] is None  # null: no window


@pytest.mark.parametrize("arch, field", [("MistralForCausalLM", "attention_bias"), ("MistralForCausalLM", "mlp_bias"),
                                         ("MixtralForCausalLM", "attention_bias"), ("Qwen2ForCausalLM", "mlp_bias"),
                                         ("Qwen3ForCausalLM", "mlp_bias")])
def test_a_bias_the_architecture_ignores_is_dropped(arch, field):
    """transformers' class builds these projections without biases whatever the field says: a checkpoint has none."""
    biases = {"bq", "bk", "bv", "bo"} if field == "attention_bias" else {"b_gate", "b_up", "b_down"}
    assert not biases & {w for rep in bound(arch, **{field: True}).repeats() for w in rep.weights}
    llama = bound("LlamaForCausalLM", attention_bias=True, mlp_bias=True)  # Llama's class honours both
    assert {"bq", "bo", "b_gate"} <= {w for rep in llama.repeats() for w in rep.weights}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}])
def test_partial_rotary_in_the_llama_family_is_refused(scaling):
    """transformers' Llama-family models ignore partial_rotary_factor with the default RoPE type, and with a scaled
    type fail to run (tables of the rotary dims applied to whole heads): no reference, so refused (a scaled type was
    built GPT-NeoX style, which no transformers model computes for these architectures)."""
    import torch

    rope = {} if scaling is None else {"rope_scaling": scaling}
    name = "default" if scaling is None else scaling["rope_type"]
    with pytest.raises(MxcError, match=f"partial_rotary_factor < 1 with the {name} RoPE type: transformers' "
                                       f"Llama-family models .*; mxc refuses to guess"):
        bound("LlamaForCausalLM", partial_rotary_factor=0.5, **rope)
    if scaling is not None:  # the reason: transformers cannot run it
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5,
                                          rope_scaling=scaling)
        with pytest.raises(RuntimeError, match="must match the size"):
            transformers.LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("arch", list(CONFIG_CLASSES))
def test_field_aliases_are_transformers_attribute_maps(arch):
    """Each architecture renames the config.json fields its transformers config class reads under another name."""
    assert lookup(arch).field_aliases == CONFIG_CLASSES[arch].attribute_map
