"""config.json fields that change transformers' forward in a way mxc does not implement are refused at build, in one
line naming the field, rather than built into a model that differs: OLMoE's clip_qkv (q, k and v clamped), Qwen3's
and Qwen3-MoE's use_sliding_window (windowed attention from layer max_window_layers on), and the layers Qwen2-MoE's
and Qwen3-MoE's mlp_only_layers and decoder_sparse_step make dense MLPs instead of experts.

Each case first shows, with transformers as the reference, that the field does change the model (other logits on
the same weights, or a dense MLP where the other layers have experts): the refusal guards a real difference. The
registry's refuse_if mechanics have their own tests (tests/models/test_registry_errors.py); these pin each
architecture's entries, whose removal no other test notices (a Qwen2 use_sliding_window test aside).
"""

from __future__ import annotations

import re

import pytest
import torch

import mxc
from mxc.errors import MxcError

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
WINDOW = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}  # every layer windowed, 3 tokens
CASES = [
    ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}, {"clip_qkv": 0.05}, "clip_qkv"),
    # 0.0 is set too (transformers clamps whenever it is not None: q, k and v all zero), though falsy
    ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}, {"clip_qkv": 0.0}, "clip_qkv"),
    ("Qwen3ForCausalLM", {"head_dim": 32}, WINDOW, "use_sliding_window"),
    ("Qwen3MoeForCausalLM", MOE, WINDOW, "use_sliding_window"),
    ("Qwen2MoeForCausalLM", {**MOE, "shared_expert_intermediate_size": 48}, {"mlp_only_layers": [0]},
     "mlp_only_layers"),
    ("Qwen3MoeForCausalLM", MOE, {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("Qwen2MoeForCausalLM", {**MOE, "shared_expert_intermediate_size": 48}, {"decoder_sparse_step": 2},
     "decoder_sparse_step"),
    ("Qwen3MoeForCausalLM", MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
]


@pytest.mark.parametrize("arch, base, fields, name", CASES,
                         ids=[f"{a}-{n}-{f[n]}" for a, _, f, n in CASES])
def test_fields_that_change_the_hf_model_are_refused(arch, base, fields, name, hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint(arch, name="with", **base, **fields)
    _, plain = hf_checkpoint(arch, name="without", **base)
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    if kinds != [type(layer.mlp).__name__ for layer in plain.model.layers]:
        assert len(set(kinds)) == 2, kinds  # some layers dense, the others experts
    else:  # same modules: the same weights give other logits
        plain.load_state_dict(hf.state_dict())
        ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert not torch.allclose(hf(ids).logits, plain(ids).logits, rtol=0, atol=1e-3)

    field = rf"`[^`]*\b{re.escape(name)}\b[^`]*`"
    with pytest.raises(MxcError, match=rf"config\.json: {field} is true, which is not supported for {arch}") as e:
        mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()
