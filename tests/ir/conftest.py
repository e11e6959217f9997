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
    """Factory: bind ``model_file`` (default llama.yaml) to a tiny config of ``arch``, fields overridden, in
    ``dtype``."""

    def bind(arch: str = "LlamaForCausalLM", model_file: Path = LLAMA_YAML, *, dtype: str = "float32", **fields):
        config = {**TINY, "architectures": [arch], **fields}
        return bind_model(Path(model_file), config, dtype, lookup(arch))

    return bind


@pytest.fixture
def llama_text() -> str:
    return LLAMA_YAML.read_text()


def unique_line(text: str, fragment: str) -> int:
    """1-based number of the one line of ``text`` containing ``fragment`` (it must be on exactly one line)."""
    lines = [i for i, ln in enumerate(text.splitlines(), start=1) if fragment in ln]
    assert len(lines) == 1, f"{fragment!r} is on lines {lines} of the model file; expected exactly one"
    return lines[0]


@pytest.fixture
def loc_of(llama_text):
    """Factory: ``"llama.yaml:N"`` for the unique line of llama.yaml containing a statement ``fragment``.

    Expected node locations are computed from the model file, so editing it elsewhere does not break them.
    """
    return lambda fragment: f"{LLAMA_YAML.name}:{unique_line(llama_text, fragment)}"
