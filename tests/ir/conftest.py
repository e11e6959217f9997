"""IR test fixtures: the Llama model file bound to tiny configs of each architecture it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxc.models.registry import MODELS_DIR, bind_model, lookup

LLAMA_YAML = MODELS_DIR / "llama.yaml"

# hidden 64, 4 query heads of 16, 2 kv heads: GQA with every dimension distinct enough to catch mix-ups
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0)


@pytest.fixture
def bind_arch():
    """Factory: bind ``model_file`` (default llama.yaml) to a tiny config of ``arch``, fields overridden."""

    def bind(arch: str = "LlamaForCausalLM", model_file: Path = LLAMA_YAML, **fields):
        config = {**TINY, "architectures": [arch], **fields}
        return bind_model(Path(model_file), config, "float32", lookup(arch))

    return bind


@pytest.fixture
def llama_text() -> str:
    return LLAMA_YAML.read_text()
