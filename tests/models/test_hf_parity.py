"""Hugging Face parity: each supported architecture and RoPE variant, on tiny random checkpoints.

float32 logits must match HF within 1e-4 relative to the logits' scale, and
greedy generation must produce the same 16 tokens as HF ``generate``.
"""

from __future__ import annotations

import pytest
import torch

import mxc

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-mha-tied": ("LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-mqa-bias": ("LlamaForCausalLM", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-rope-dynamic": ("LlamaForCausalLM", {"max_position_embeddings": 16,
                                                 "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-rope-yarn": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32}}),
    "llama-rope-llama3": ("LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-rope-parameters": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 6}),
    # a sliding_window left in a Llama config.json (a Mistral conversion): transformers' Llama does not window
    "llama-stray-window": ("LlamaForCausalLM", {"sliding_window": 4}),
    # bias fields left in configs of architectures whose transformers class has no such biases: ignored there
    "mistral-stray-biases": ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen3-stray-mlp-bias": ("Qwen3ForCausalLM", {"head_dim": 32, "mlp_bias": True}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    # mixture of experts
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral-sliding": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}),
    "qwen2-moe-shared": ("Qwen2MoeForCausalLM", {"num_experts": 6, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "qwen2-moe-no-qkv-bias": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "qkv_bias": False,
                                                      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "qwen3-moe-renorm": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 3,
                                                 "moe_intermediate_size": 40, "norm_topk_prob": True}),
    "qwen3-moe-no-renorm": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": 40, "norm_topk_prob": False}),
    "olmoe": ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    # MoE sizes left in configs of architectures whose transformers class does not read them: Mixtral's and OLMoE's
    # experts are intermediate_size wide, and only Qwen2-MoE has a shared expert
    "mixtral-stray-moe-sizes": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                       "moe_intermediate_size": 32,
                                                       "shared_expert_intermediate_size": 32}),
    "olmoe-stray-moe-sizes": ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "qwen3-moe-stray-shared-expert": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                              "moe_intermediate_size": 40,
                                                              "shared_expert_intermediate_size": 32}),
}

# transformers' generate builds its KV cache from the config, and a config with sliding_window gets windowed cache
# layers even where the model's forward does not window (Llama): the reference tokens come from generate without a
# cache there, which runs the forward as defined (and equals the model without the field)
NO_CACHE_REFERENCE = {"llama-stray-window"}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf(case, hf_checkpoint, tmp_path):
    arch, overrides = CASES[case]
    ckpt, hf = hf_checkpoint(arch, **overrides)
    # dynamic NTK RoPE is tested past max_position_embeddings (16), where its scaling starts: a longer sequence than
    # the build's default --max-seq-len (min(4096, max_position_embeddings)), which generate holds to
    longer = {"max_seq_len": 64} if case == "llama-rope-dynamic" else {}
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None, **longer)
    model = mxc.load(art)

    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert _rel_err(model.logits(ids), ref) <= 1e-4

    with torch.no_grad():
        ref_tokens = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                 use_cache=case not in NO_CACHE_REFERENCE)[:, ids.shape[1]:]
    assert torch.equal(model.generate(ids, max_new_tokens=16), ref_tokens)


def test_a_tied_config_over_an_untied_checkpoint(hf_checkpoint, tmp_path):
    """config.json ties the LM head to the embedding, but the checkpoint stores its own lm_head.weight with other
    values: transformers then loads the two untied, so mxc refuses (it built the embedding as the head, every logit
    wrong) and names the field; with it false, the build matches transformers. A stored copy still builds tied."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    ckpt, _ = hf_checkpoint("LlamaForCausalLM", tie_word_embeddings=True)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    mxc.build(str(ckpt), out=tmp_path / "copy", progress=False, log=lambda m: None)

    tensors["lm_head.weight"] = torch.randn(tensors["lm_head.weight"].shape, generator=torch.Generator().manual_seed(2))
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(mxc.MxcError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight, which "
                                           r"config\.json ties it to .*make `tie_word_embeddings` false") as e:
        mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()

    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()  # untied, as it warns
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert _rel_err(model.logits(ids), ref) <= 1e-4


def test_dynamic_ntk_past_max_positions_matches_hf_generate_with_its_cache(hf_checkpoint, tmp_path):
    """Dynamic-NTK RoPE well past max_position_embeddings (16): transformers' rotary embedding recomputes its
    frequencies for every forward whose longest position passes the longest seen so far (the prefill at the
    prompt's length, then each decode step at its own), and the keys in its KV cache keep the rotation they were
    written with, so its generate with a cache differs from the same model without one. mxc computes each forward's
    frequencies from that forward's positions and caches rotated keys: its logits match a fresh model's forward, and
    its tokens match generate with the cache. q/k are scaled up so that attention, and so the tokens, depend on
    the rotations (with the tiny model's weights as made, the two references give the same tokens)."""
    ckpt, hf = hf_checkpoint("LlamaForCausalLM", max_position_embeddings=16,
                             rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    hf.save_pretrained(ckpt, safe_serialization=True)
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", max_seq_len=64, progress=False, log=lambda m: None))
    fresh = lambda: hf.model.rotary_emb.__init__(hf.config)  # noqa: E731 -- transformers' frequencies as at load

    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    fresh()
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert _rel_err(model.logits(ids), ref) <= 1e-4

    prompt, new = ids[:, :6], 40
    references = {}
    for use_cache in (True, False):
        fresh()
        with torch.no_grad():
            references[use_cache] = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                use_cache=use_cache)[:, prompt.shape[1]:]
    assert not torch.equal(references[True], references[False])  # the test tells the two apart
    assert torch.equal(model.generate(prompt, max_new_tokens=new), references[True])
