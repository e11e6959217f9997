"""bench/decode.weight_bytes: the bytes one token's decode step reads, the floor every benchmark divides by."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

import mxc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from decode import weight_bytes  # noqa: E402

MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True}


def _tensors(art: Path) -> dict[str, int]:
    with safe_open(art / "weights" / "rank0.safetensors", "pt") as f:
        return {name: f.get_tensor(name).nbytes for name in f.keys()}


def test_reads_every_weight_but_the_embedding_and_only_the_top_k_experts(tmp_path):
    """Every tensor in full (attention, norms, router, LM head) but the embedding table (one row is gathered), and
    k / E of the stacked experts' bytes (a token's k experts)."""
    (tmp_path / "config.json").write_text(json.dumps(MOE))
    art = mxc.build("llama.yaml", config=str(tmp_path / "config.json"), out=tmp_path / "art", progress=False,
                    log=lambda m: None)
    sizes = _tensors(art)
    experts = sum(v for k, v in sizes.items() if ".we_" in k)
    assert experts > 0
    nbytes, _ = weight_bytes(json.loads((art / "manifest.json").read_text()), art)
    assert nbytes == sum(sizes.values()) - sizes["embed"] - experts + experts * 2 // 8
    # a batch of B tokens touches 1 - (1 - k / E) ** B of the experts under uniform routing: 1 - (6/8)^4 at 4
    batch4, _ = weight_bytes(json.loads((art / "manifest.json").read_text()), art, batch=4)
    assert batch4 == sum(sizes.values()) - sizes["embed"] - experts + int(experts * (1 - (6 / 8) ** 4))
