"""A registry line with a typo, and registry expressions a config.json cannot answer: one-line errors naming the
architecture and the key, not Python tracebacks."""

from __future__ import annotations

import importlib
import re
import shutil

import pytest

from mxc.errors import MxcError
from mxc.models.registry import Entry, bind_model

reg = importlib.import_module("mxc.models.registry")  # the module: mxc.models exports a function of that name

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    shutil.copy(reg.MODELS_DIR / "llama.yaml", tmp_path / "llama.yaml")
    monkeypatch.setattr(reg, "MODELS_DIR", tmp_path)
    return tmp_path


@pytest.mark.parametrize("line,needle", [
    ("MyForCausalLM: {model: llama.yaml, sett: {qkv_bias: true}}", "MyForCausalLM: expected a mapping with model"),
    ("MyForCausalLM: llama.yaml", "MyForCausalLM: expected a mapping with model"),
    ("MyForCausalLM: {set: {qkv_bias: true}}", "MyForCausalLM: expected a mapping with model"),
    ("MyForCausalLM: {model: llama.yaml, refuse_if: use_sliding_window}",
     "MyForCausalLM: refuse_if: expected a list, got 'use_sliding_window'"),
    ("MyForCausalLM: {model: llama.yaml, set: [qkv_bias]}", "MyForCausalLM: set: expected a mapping"),
    ("MyForCausalLM: {model: lama.yaml}", "MyForCausalLM: model: no model file 'lama.yaml'"),
])
def test_a_malformed_registry_line_is_named(models_dir, line, needle):
    (models_dir / "registry.yaml").write_text(f"LlamaForCausalLM: {{model: llama.yaml}}\n{line}\n")
    with pytest.raises(MxcError, match="registry.yaml: ") as e:
        reg.lookup("LlamaForCausalLM")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_shipped_registry_reads():
    assert "LlamaForCausalLM" in reg.registry()


def test_refuse_if_over_a_field_of_another_type(tmp_path):
    entry = Entry("MyForCausalLM", "llama.yaml", refuse_if=["sliding_window > 4096"])
    with pytest.raises(MxcError, match=r"config.json: cannot check 'sliding_window > 4096' for MyForCausalLM: "
                                       r"'>' not supported"):
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY), "float32", entry)  # no sliding_window: None > 4096
    bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, sliding_window=4096), "float32", entry)  # answered: builds


def test_set_over_a_field_of_another_type():
    entry = Entry("MyForCausalLM", "llama.yaml", set={"head_dim": "hidden_size // heads_per_group"})
    with pytest.raises(MxcError, match=r"config.json: MyForCausalLM sets head_dim = hidden_size // heads_per_group, "
                                       r"which cannot be computed from it: unsupported operand"):
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY), "float32", entry)


@pytest.mark.parametrize("window", [0, 2.5, {"size": 16}, "16"])
def test_a_copied_field_of_the_wrong_type_is_named_by_its_config_name(window):
    """Mistral's registry line copies config.json's sliding_window into the model file's attention_window (an int,
    or null: no window). A value of another type used to build and then fail in the attention at run time."""
    cfg = dict(TINY, sliding_window=window)
    with pytest.raises(MxcError, match=rf"^config.json: field sliding_window = {re.escape(repr(window))}: "
                                       r"expected an integer >= 1$"):
        bind_model(reg.MODELS_DIR / "llama.yaml", cfg, "float32", reg.lookup("MistralForCausalLM"))
    for ok in (None, 16):  # null: no window
        g = bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, sliding_window=ok), "float32",
                       reg.lookup("MistralForCausalLM"))
        assert g.config["attention_window"] == ok
