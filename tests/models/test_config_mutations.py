"""Every config.json field an architecture reads, set to values of the wrong kind (a mapping, a list, a string, a
negative, zero, a fraction, null, a boolean): the build either refuses it in one line or builds a model that runs.

Random edits of this kind found a sliding_window given as a mapping or 0 that built and then failed in the
attention at run time. Binding is cheap, so every (field, value) pair is bound; the few that bind are built and
run on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

import mxc
from mxc.errors import MxcError

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
ARCHS = {"MistralForCausalLM": dict(sliding_window=16),
         "Qwen3MoeForCausalLM": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     norm_topk_prob=True),
         "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=48, qkv_bias=True),
         "OlmoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)}
EXTRA = ("rope_scaling", "partial_rotary_factor", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias")
VALUES = ({"a": 1}, [1], "x", -1, 0, 1.5, None, True)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_wrong_kinds_of_config_values_are_refused_or_run(arch, tmp_path):
    base = {**TINY, **ARCHS[arch], "architectures": [arch]}
    failures, built = [], 0
    for field in [*base, *EXTRA]:
        if field == "architectures":
            continue
        for value in VALUES:
            path = tmp_path / "config.json"
            path.write_text(json.dumps({**base, field: value}))
            out = tmp_path / f"a{built}"
            try:
                art = mxc.build("llama.yaml", config=str(path), out=out, progress=False, log=lambda m: None)
                built += 1
                mxc.load(art).logits(torch.tensor([[1, 2, 3]]))
            except MxcError as e:
                if "\n" in str(e):
                    failures.append(f"{field} = {value!r}: a multi-line error: {e}")
            except Exception as e:  # noqa: BLE001 - what the test looks for
                failures.append(f"{field} = {value!r}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures[:10])
    print(f"{arch}: {built} of the edits built and ran")


@pytest.mark.parametrize("arch,field,value,needle", [
    ("MistralForCausalLM", "sliding_window", {"a": 1}, "field sliding_window = {'a': 1}: expected an integer >= 1"),
    ("MistralForCausalLM", "sliding_window", 0, "field sliding_window = 0: expected an integer >= 1"),
    ("Qwen2MoeForCausalLM", "qkv_bias", "x", "field qkv_bias = 'x': expected true or false"),
    ("Qwen2MoeForCausalLM", "qkv_bias", 1, "field qkv_bias = 1: expected true or false"),
])
def test_values_that_used_to_build_are_refused(arch, field, value, needle, tmp_path):
    """Values the sweep above found accepted: a window of another kind (built, then failed in the attention) and a
    bias switch that is not a boolean (read as truthy)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **ARCHS[arch], "architectures": [arch], field: value}))
    with pytest.raises(MxcError, match=f"^{path}: " + needle.replace("{", r"\{").replace("(", r"\(")):
        mxc.build("llama.yaml", config=str(path), out=tmp_path / "a", progress=False, log=lambda m: None)


def test_internlm_bias_left_out_is_its_config_class_default(tmp_path):
    """InternLM's config class defaults bias to true: a config.json without it has q/k/v/o biases."""
    from mxc.models.registry import bind_model, lookup, MODELS_DIR

    g = bind_model(MODELS_DIR / "llama.yaml", {**TINY, "architectures": ["InternLMForCausalLM"]}, "float32",
                   lookup("InternLMForCausalLM"))
    assert g.config["qkv_bias"] is True and g.config["o_bias"] is True
