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
    ("MyForCausalLM: {model: configs}", "MyForCausalLM: model: no model file 'configs'"),  # a folder
    ("MyForCausalLM: {model: llama.yaml, tested: 1}", "MyForCausalLM: tested: expected a bool, got 1"),
    ("MyForCausalLM: {model: llama.yaml, defaults: [rms_norm_eps]}", "MyForCausalLM: defaults: expected a mapping"),
    ("MyForCausalLM: {model: llama.yaml, layer_lists: mlp_only_layers}",
     "MyForCausalLM: layer_lists: expected a list, got 'mlp_only_layers'"),
])
def test_a_malformed_registry_line_is_named(models_dir, line, needle):
    (models_dir / "configs").mkdir()
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


@pytest.mark.parametrize("text", ["- LlamaForCausalLM\n", "llama.yaml\n", ""])
def test_a_registry_that_is_not_a_mapping_is_named(models_dir, text):
    (models_dir / "registry.yaml").write_text(text)
    with pytest.raises(MxcError, match=r"registry\.yaml: expected a mapping architecture -> \{model: file\.yaml") as e:
        reg.lookup("LlamaForCausalLM")
    assert "\n" not in str(e.value)


def test_an_unsupported_architecture_lists_the_supported_ones_sorted(models_dir):
    (models_dir / "registry.yaml").write_text("ZedForCausalLM: {model: llama.yaml}\nAbcForCausalLM: {model: llama.yaml}\n"
                                              "LlamaForCausalLM: {model: llama.yaml}\n")
    with pytest.raises(MxcError, match=r"^my/config\.json: architecture 'FooForCausalLM' is not supported; supported: "
                                       r"AbcForCausalLM, LlamaForCausalLM, ZedForCausalLM$"):
        reg.lookup("FooForCausalLM", "my/config.json")


def test_model_files_are_the_definitions_not_the_registry(models_dir):
    (models_dir / "registry.yaml").write_text("LlamaForCausalLM: {model: llama.yaml}\n")
    (models_dir / "gpt.yaml").write_text("family: gpt\n")
    (models_dir / "notes.txt").write_text("x")
    assert reg.model_files() == ["gpt.yaml", "llama.yaml"]


@pytest.mark.parametrize("archs", [{"LlamaForCausalLM": 1}, "L", ["LlamaForCausalLM", "MistralForCausalLM"], []])
def test_architectures_must_be_a_list_of_one(archs):
    with pytest.raises(MxcError, match=r"^my/config\.json: field 'architectures' must list exactly one architecture, "
                                       rf"got {re.escape(repr(archs))}$"):
        reg.architecture_of({"architectures": archs}, "my/config.json")
    assert reg.architecture_of({"architectures": ["LlamaForCausalLM"]}) == "LlamaForCausalLM"


def test_registry_arithmetic_a_config_cannot_answer_is_named():
    """A division by a config.json field of 0, in refuse_if or in set: one line naming the expression."""
    refuse = Entry("MyForCausalLM", "llama.yaml", refuse_if=["hidden_size // zero_field > 1"])
    with pytest.raises(MxcError, match=r"config.json: cannot check 'hidden_size // zero_field > 1' for MyForCausalLM: "
                                       r"integer division or modulo by zero"):
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, zero_field=0), "float32", refuse)
    sets = Entry("MyForCausalLM", "llama.yaml", set={"head_dim": "hidden_size // zero_field"})
    with pytest.raises(MxcError, match=r"config.json: MyForCausalLM sets head_dim = hidden_size // zero_field, which "
                                       r"cannot be computed from it: integer division or modulo by zero"):
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, zero_field=0), "float32", sets)


@pytest.mark.parametrize("value, refused", [(True, True), ([1], True), (2, True), (False, False), ([], False),
                                            (0, False), (None, False)])
def test_refuse_if_refuses_on_any_true_value(value, refused):
    """A refuse_if expression is a condition as Python reads one: a non-empty list (Qwen2-MoE's mlp_only_layers) or a
    non-zero number refuses, as True does."""
    entry = Entry("MyForCausalLM", "llama.yaml", refuse_if=["flagged"])
    config = dict(TINY, flagged=value)
    if refused:
        with pytest.raises(MxcError, match=r"config.json: `flagged` is true, which is not supported for MyForCausalLM"):
            bind_model(reg.MODELS_DIR / "llama.yaml", config, "float32", entry)
    else:
        bind_model(reg.MODELS_DIR / "llama.yaml", config, "float32", entry)


@pytest.mark.parametrize("value", [[], [2], [-1], [5, -2], ["1"], [None], [0.5], [float("inf")], [1], [1.0], [True],
                                   [7, 0], [0, 1, 1], [-2, 1.0, 9]])
def test_a_layer_list_reads_as_the_layers_transformers_picks(value):
    """A ``layer_lists`` field reads, for refuse_if, as the layers 0..num_hidden_layers-1 that transformers' test
    ``layer_idx in <field>`` picks (TINY has 2): an index past the last layer or negative picks none, and a list of
    such builds as the empty list does; 1.0 and true equal 1 and pick layer 1."""
    entry = Entry("MyForCausalLM", "llama.yaml", refuse_if=["dense_layers"], layer_lists=["dense_layers"])
    picked = [i for i in range(TINY["num_hidden_layers"]) if i in value]  # transformers' Qwen2-MoE decoder layer
    assert reg._layers_named(dict(TINY, dense_layers=value), entry)["dense_layers"] == picked
    if picked:
        with pytest.raises(MxcError, match=r"^config.json: `dense_layers` is true, which is not supported for "
                                           r"MyForCausalLM \(registry.yaml refuse_if\)$"):
            bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, dense_layers=value), "float32", entry)
    else:
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, dense_layers=value), "float32", entry)
    unlisted = Entry("MyForCausalLM", "llama.yaml", refuse_if=["dense_layers"])  # not a layer list: as written
    if value:
        with pytest.raises(MxcError, match=r"`dense_layers` is true"):
            bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, dense_layers=value), "float32", unlisted)


@pytest.mark.parametrize("config", [dict(TINY, dense_layers=3), dict(TINY, dense_layers=[5], num_hidden_layers="2")])
def test_a_layer_list_that_cannot_be_read_as_layers_is_left_as_written(config):
    """A value that is no list, or a config whose num_hidden_layers is no integer, is not read as layers: the
    field is checked as written (the model file's own checks then name a bad num_hidden_layers)."""
    entry = Entry("MyForCausalLM", "llama.yaml", layer_lists=["dense_layers"])
    assert reg._layers_named(config, entry) == config


def test_a_field_config_json_sets_wins_over_the_registry_default():
    entry = Entry("MyForCausalLM", "llama.yaml", defaults={"num_key_value_heads": 1, "rms_norm_eps": 0.25})
    g = bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY), "float32", entry)  # TINY sets num_key_value_heads 2
    assert g.config["num_key_value_heads"] == 2 and g.config["rms_norm_eps"] == TINY["rms_norm_eps"]
    no_eps = {k: v for k, v in TINY.items() if k != "rms_norm_eps"}
    assert bind_model(reg.MODELS_DIR / "llama.yaml", no_eps, "float32", entry).config["rms_norm_eps"] == 0.25


def test_a_set_naming_a_field_config_json_lacks_names_the_model_files_param():
    """``set: {num_key_value_heads: my_heads}`` copies config.json's my_heads; where config.json has no such field
    there is no field of that name to blame: the error names the model file's parameter instead."""
    entry = Entry("MyForCausalLM", "llama.yaml", set={"num_key_value_heads": "my_heads"})
    with pytest.raises(MxcError, match=r"llama\.yaml \(params\.num_key_value_heads, from config\.json\): field "
                                       r"num_key_value_heads = None: expected an integer >= 1") as e:
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY), "float32", entry)
    assert "my_heads" not in str(e.value)
    with pytest.raises(MxcError, match=r"^config\.json: field my_heads = 'x': expected an integer >= 1$"):
        bind_model(reg.MODELS_DIR / "llama.yaml", dict(TINY, my_heads="x"), "float32", entry)


@pytest.mark.parametrize("arch, experts_field", [("MixtralForCausalLM", "num_local_experts"),
                                                 ("Qwen2MoeForCausalLM", "num_experts"),
                                                 ("Qwen3MoeForCausalLM", "num_experts"),
                                                 ("Qwen3MoeForCausalLM", "num_local_experts"),
                                                 ("OlmoeForCausalLM", "num_experts")])
def test_more_experts_a_token_than_experts_names_the_config_fields(arch, experts_field):
    """num_experts_per_tok past the experts is refused by llama.yaml's checks naming config.json's fields and
    their values (under each architecture's name for the expert count, Qwen3-MoE's whichever of its two the
    config gives), not by the router op of the bound graph."""
    config = dict(TINY, num_experts_per_tok=5, moe_intermediate_size=32, **{experts_field: 4})
    with pytest.raises(MxcError, match=rf"^config.json: num_experts_per_tok = 5, {experts_field} = 4: each token is routed "
                                       rf"to at least one expert and at most all of them \(llama.yaml:\d+, checks\)$") as e:
        bind_model(reg.MODELS_DIR / "llama.yaml", config, "float32", reg.lookup(arch))
    assert "\n" not in str(e.value)
    bind_model(reg.MODELS_DIR / "llama.yaml", dict(config, num_experts_per_tok=4), "float32", reg.lookup(arch))


@pytest.mark.parametrize("expr, config, value, field", [
    ("num_local_experts", {"num_local_experts": 4}, 4, "num_local_experts"),
    ("sliding_window", {"sliding_window": None}, None, "sliding_window"),  # present, null: the field still
    ("num_experts if num_experts is not None else num_local_experts", {"num_local_experts": 4}, 4,
     "num_local_experts"),
    ("num_experts if num_experts is not None else num_local_experts", {"num_experts": 6, "num_local_experts": 4}, 6,
     None),  # two fields with values: which one it copied is not said
    ("2 * num_local_experts", {"num_local_experts": 4}, 8, None),  # computed, not copied
    (True, {}, True, None),
])
def test_the_config_field_a_set_expression_copies(expr, config, value, field):
    """Errors about a value the registry sets name the config field it copies, where there is one."""
    assert reg._copied_field(expr, config, value) == field
