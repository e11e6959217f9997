"""Every binder error names file:line: field: message, pointing at the line that is wrong.

Each case copies llama.yaml, corrupts one line, and checks the exact line number
(computed from the corrupted text) and the field appear in the MxcError.
"""

from __future__ import annotations

import pytest

from mxc.errors import MxcError
from mxc.ir.ops import OPS
from mxc.models.registry import bind_model, lookup


def line_of(text: str, needle: str) -> int:
    """1-based number of the line where ``needle`` starts; it must occur exactly once in ``text``
    (end it with a newline to pin a line that is a prefix of others)."""
    assert text.count(needle) == 1, f"{needle!r} occurs {text.count(needle)} times; expected exactly once"
    return text[:text.index(needle)].count("\n") + 1


@pytest.fixture
def bind_bad(tmp_path, llama_text, bind_arch):
    """Factory: replace ``old`` by ``new`` in llama.yaml, bind it; returns (error message, line of ``mark``)."""

    def run(old: str, new: str, mark: str | None = None, arch: str = "LlamaForCausalLM",
            **fields) -> tuple[str, int | None]:
        assert llama_text.count(old) == 1, old
        text = llama_text.replace(old, new)
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(MxcError) as e:
            bind_arch(arch, model_file=path, **fields)
        mark = mark or new.splitlines()[-1]
        return str(e.value), line_of(text, mark) if mark else None  # None: the edit leaves no line to point at

    return run


def where(line: int, field: str) -> str:
    return f"bad.yaml:{line}: {field}: "


def test_malformed_yaml_unbalanced_bracket(bind_bad):
    msg, line = bind_bad("ln1:    {shape: [hidden_size], hf", "ln1:    {shape: [hidden_size, hf")
    assert f"bad.yaml:{line}: malformed YAML" in msg


def test_malformed_yaml_extra_bracket(bind_bad):
    msg, line = bind_bad("wo:     {shape: [hidden_size, num_attention_heads*head_dim]",
                         "wo:     {shape: [hidden_size, num_attention_heads*head_dim]]")
    assert f"bad.yaml:{line}: malformed YAML" in msg


def test_model_file_not_utf8(tmp_path, llama_text, bind_arch):
    path = tmp_path / "bad.yaml"
    path.write_bytes(llama_text.encode().replace(b"hidden_size", b"hidden\xff_size", 1))
    with pytest.raises(MxcError, match=r"bad\.yaml: not UTF-8 text \(invalid start byte at byte \d+\)") as e:
        bind_arch("LlamaForCausalLM", model_file=path)
    assert "\n" not in str(e.value)


def test_unknown_op(bind_bad):
    msg, line = bind_bad("- h = rms_norm(x, ln1, eps=rms_norm_eps)\n", "- h = foo(x)\n")
    assert where(line, "graph") + "unknown op 'foo'" in msg
    # the ops a model file writes, not the passes' fusions (qkv_rope_cache, all_reduce, ...) beside them
    from mxc.ir.ops import COMPILER_OPS

    assert "ops a model file writes: " + ", ".join(sorted(set(OPS) - COMPILER_OPS)) + " (the passes make " in msg
    assert "rms_norm, rope" in msg and "qkv_rope_cache" not in msg and "all_reduce" not in msg
    assert COMPILER_OPS < set(OPS)  # every name is an op


def test_compiler_ops_are_those_the_passes_make(bind_arch):
    """COMPILER_OPS (which an unknown op's error leaves out) against what the pipeline makes of the bundled model, a
    dense and an MoE config, at tp 2 and with fp8, for cpu and cuda: every op a pass introduced is listed, and none
    the model file writes."""
    from mxc.compiler.options import BuildOptions
    from mxc.compiler.pipeline import compile_graph
    from mxc.ir.ops import COMPILER_OPS

    configs = [("LlamaForCausalLM", {}), ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                      moe_intermediate_size=32, norm_topk_prob=True))]
    written, made = set(), set()
    for arch, fields in configs:
        written |= {n.op for n, _ in bind_arch(arch, dtype="bfloat16", **fields).nodes()}
        for options in (dict(target="cpu", tp=2), dict(target="cpu", quant="fp8", tp=2), dict(target="cuda"),
                        dict(target="cuda", quant="fp8")):
            graph = compile_graph(bind_arch(arch, dtype="bfloat16", **fields), BuildOptions(dtype="bfloat16",
                                                                                               **options))
            made |= {n.op for n, _ in graph.nodes()}
    assert not written & COMPILER_OPS
    both = {"split", "silu_mul"}  # made by the merge passes, and written for a checkpoint's fused projections
    assert made - written <= COMPILER_OPS | both, made - written - COMPILER_OPS - both
    assert not both & COMPILER_OPS
    assert len(made & COMPILER_OPS) >= 8  # the check saw the passes at work

def test_unknown_op_nested(bind_bad):
    msg, line = bind_bad("linear(flatten_heads(a), wo, bo)", "linear(unheads(a), wo, bo)")
    assert where(line, "graph") + "unknown op 'unheads'" in msg


def test_unknown_name_in_statement(bind_bad):
    msg, line = bind_bad("- h = rms_norm(x, ln2, eps=rms_norm_eps)", "- h = rms_norm(x, ln3, eps=rms_norm_eps)")
    assert where(line, "graph") + "rms_norm: unknown name 'ln3'" in msg


def test_value_used_before_defined(bind_bad):
    msg, line = bind_bad("- h = rms_norm(x, ln1, eps=rms_norm_eps)", "- h = rms_norm(a, ln1, eps=rms_norm_eps)")
    assert where(line, "graph") + "rms_norm: unknown name 'a'" in msg


def test_unknown_name_in_attribute(bind_bad):
    msg, line = bind_bad("- h = rms_norm(x, ln1, eps=rms_norm_eps)", "- h = rms_norm(x, ln1, eps=rms_eps)")
    assert where(line, "rms_norm.eps") + "unknown name 'rms_eps'" in msg


def test_unparsable_statement(bind_bad):
    msg, line = bind_bad("- x = embedding(tokens, embed)", "- x = embedding(tokens, embed")
    assert where(line, "graph") + "cannot parse statement" in msg


def test_statement_that_is_not_a_call(bind_bad):
    msg, line = bind_bad("- x = embedding(tokens, embed)", "- x = embedding(tokens, embed) + 1")
    assert where(line, "graph") + "expected an op call" in msg


def test_weight_with_unknown_key(bind_bad):
    msg, line = bind_bad("hf: self_attn.q_proj.weight, shard: {kind: column, unit: head_dim}}",
                         "hf: self_attn.q_proj.weight, shard: column, shardd: row}")
    assert where(line, "repeat.weights.wq") + "unknown key(s) ['shardd']" in msg


def test_top_level_weight_with_unknown_key(bind_bad):
    msg, line = bind_bad("norm_f:  {shape: [hidden_size], hf: model.norm.weight, init: ones}",
                         "norm_f:  {shape: [hidden_size], hf: model.norm.weight, init: ones, dtype: float32}")
    assert where(line, "weights.norm_f") + "unknown key(s) ['dtype']" in msg


def test_weight_missing_hf(bind_bad):
    msg, line = bind_bad("ln2:    {shape: [hidden_size], hf: post_attention_layernorm.weight, init: ones}",
                         "ln2:    {shape: [hidden_size], init: ones}")
    assert where(line, "repeat.weights.ln2") + "missing 'hf'" in msg


def test_shape_names_unknown_param(bind_bad):
    msg, line = bind_bad("wq:     {shape: [num_attention_heads*head_dim,", "wq:     {shape: [num_heads*head_dim,")
    assert where(line, "repeat.weights.wq.shape") + "unknown name 'num_heads'" in msg


def test_shape_not_positive(bind_bad):
    msg, line = bind_bad("w_up:   {shape: [intermediate_size, hidden_size]",
                         "w_up:   {shape: [intermediate_size - intermediate_size, hidden_size]")
    assert where(line, "repeat.weights.w_up.shape") + "'intermediate_size - intermediate_size' evaluates to 0; expected a positive integer" in msg


def test_bad_shard_and_init(bind_bad):
    msg, line = bind_bad("hf: model.embed_tokens.weight, shard: vocab}", "hf: model.embed_tokens.weight, shard: vocabb}")
    assert where(line, "weights.embed.shard") + "expected one of column, row, vocab, replicated" in msg
    msg, line = bind_bad("hf: model.norm.weight, init: ones}", "hf: model.norm.weight, init: zeros}")
    assert where(line, "weights.norm_f.init") + "expected 'normal' or 'ones'" in msg


def test_missing_config_field(llama_text, tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text(llama_text)
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256}
    with pytest.raises(MxcError) as e:
        bind_model(path, config, "float32", lookup("LlamaForCausalLM"))
    line = line_of(llama_text, "hidden_size: {type: int, min: 1}")
    assert (f"llama.yaml:{line}: params.hidden_size: config.json has no field 'hidden_size' "
            "and the model file gives no default") in str(e.value)


@pytest.mark.parametrize("field, want", [("intermediate_size", "an integer >= 1"), ("rms_norm_eps", "a value")])
def test_null_config_field(llama_text, tmp_path, field, want):
    """A field config.json holds as null is not 'no field': the error says it is null and what it should be (a
    param with no type: any value; rms_norm_eps's default taken out)."""
    path = tmp_path / "llama.yaml"
    path.write_text(llama_text.replace("  rms_norm_eps: {default: 1e-6}", "  rms_norm_eps: {}"))
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
              "vocab_size": 256, "rms_norm_eps": 1e-5, field: None}
    with pytest.raises(MxcError) as e:
        bind_model(path, config, "float32", lookup("LlamaForCausalLM"))
    assert str(e.value) == f"config.json: field {field} is null: expected {want} (llama.yaml gives no default)"


def test_wrong_number_of_outputs(bind_bad):
    msg, line = bind_bad("- q, k = rope(q, k, positions, spec=rope)", "- q = rope(q, k, positions, spec=rope)")
    assert where(line, "graph") + "rope has 2 output(s), but 1 name(s) are assigned" in msg
    msg, line = bind_bad("- h = rms_norm(x, ln1, eps=rms_norm_eps)", "- h, h2 = rms_norm(x, ln1, eps=rms_norm_eps)")
    assert where(line, "graph") + "rms_norm has 1 output(s), but 2 name(s) are assigned" in msg


def test_unknown_top_level_section(bind_bad):
    msg, line = bind_bad("tiny_config: configs/tiny-llama.json", "tiny_config: configs/tiny-llama.json\nlayers: 3")
    assert f"bad.yaml:{line}: layers: unknown section; expected one of " in msg
    assert "family, graph, ignore, inputs, outputs, params" in msg


def test_missing_section(bind_bad):
    msg, _ = bind_bad("outputs: [logits]\n", "\n")
    assert "outputs: missing required section" in msg


def test_unknown_output(bind_bad):
    msg, line = bind_bad("outputs: [logits]", "outputs: [logitz]")
    assert where(line, "outputs") + "'logitz' is not a value defined in the graph" in msg


def test_when_block_with_extra_key(bind_bad):
    msg, line = bind_bad("      - when: qk_norm\n        body:", "      - when: qk_norm\n        else: []\n        body:",
                         mark="- when: qk_norm\n")  # not the qk_norm_full block
    assert where(line, "repeat.body.when") + "a when block has exactly the keys when and body" in msg


def test_param_with_unknown_key(bind_bad):
    msg, line = bind_bad("  rms_norm_eps: {default: 1e-6}", "  rms_norm_eps: {defalt: 1e-6}")
    assert where(line, "params.rms_norm_eps") + "expected a mapping with keys among" in msg


def test_unknown_resolver(bind_bad):
    msg, line = bind_bad("rope: {resolve: llama_rope}", "rope: {resolve: ropee}")
    assert where(line, "params.rope.resolve") + "unknown resolver 'ropee'" in msg


def test_bad_repeat_count(bind_bad):
    msg, line = bind_bad("count: num_hidden_layers,", "count: num_hidden_layers - 2,")
    assert where(line, "repeat.count") + "expected a positive integer, got 0" in msg


def test_tied_to_unknown_weight(bind_bad):
    msg, line = bind_bad("tied_to: embed,", "tied_to: embedd,", mark="lm_head:", tie_word_embeddings=True)
    assert where(line, "weights.lm_head.tied_to") + "'embedd' is not a weight declared above it" in msg


def test_tied_shape_mismatch(bind_bad):
    msg, line = bind_bad("lm_head: {shape: [vocab_size, hidden_size]", "lm_head: {shape: [vocab_size, 2*hidden_size]",
                         tie_word_embeddings=True)
    assert where(line, "weights.lm_head.tied_to") + "shape [256, 128] differs from embed [256, 64]" in msg


def test_duplicate_key(bind_bad):
    msg, line = bind_bad("  vocab_size: {type: int, min: 1}", "  vocab_size: {}\n  hidden_size: {}",
                         mark="  vocab_size: {}")
    assert f"bad.yaml:{line + 1}: duplicate key 'hidden_size'" in msg


def test_one_of_must_be_a_list(bind_bad):
    msg, line = bind_bad("one_of: [silu, swish]", "one_of: silu")
    assert where(line, "params.hidden_act.one_of") + "expected a list of the values the graph computes" in msg


def test_param_type_must_be_known(bind_bad):
    msg, line = bind_bad("  vocab_size: {type: int, min: 1}", "  vocab_size: {type: integer}")
    assert where(line, "params.vocab_size.type") + "expected one of ['bool', 'int', 'number']" in msg
    msg, line = bind_bad("  vocab_size: {type: int, min: 1}", "  vocab_size: {type: int, min: one}")
    assert where(line, "params.vocab_size.min") + "expected a number, got 'one'" in msg


# Found by mutating llama.yaml at random (a value replaced by a YAML mapping, list or number, a line dropped):
# each used to end in a Python traceback instead of a file:line error.

def test_shard_that_is_neither_a_kind_nor_a_mapping(bind_bad):
    msg, line = bind_bad("hf: model.embed_tokens.weight, shard: vocab}", "hf: model.embed_tokens.weight, shard: 0}")
    want = "expected a kind, or {kind: ..., unit: expr, parts: [exprs]}; got 0"
    assert where(line, "weights.embed.shard") + want in msg


def test_expression_given_as_a_yaml_mapping_or_list(bind_bad):
    msg, line = bind_bad("tied_to: embed, tied_if: tie_word_embeddings}", "tied_to: embed, tied_if: {}}",
                         mark="lm_head:")
    assert where(line, "weights.lm_head.tied_if") + "expected an expression, got a mapping {}" in msg
    msg, line = bind_bad("  mlp_bias: {default: false}", "  mlp_bias: {default: [1, 2]}")
    assert where(line, "params.mlp_bias.default") + "expected an expression, got a list [1, 2]" in msg


def test_resolver_name_that_is_not_a_string(bind_bad):
    msg, line = bind_bad("rope: {resolve: llama_rope}", "rope: {resolve: [llama_rope]}")
    assert where(line, "params.rope.resolve") + "unknown resolver ['llama_rope']; known: llama_rope, rope" in msg


def test_resolver_reading_an_undeclared_param(bind_bad):
    msg, line = bind_bad("  head_dim: {default: hidden_size // num_attention_heads, type: int, min: 1}\n", "",
                         mark="  rope: {resolve: llama_rope}")
    assert where(line, "params.rope.resolve") + "resolver 'llama_rope' needs the param 'head_dim', declared above" in msg


@pytest.mark.parametrize("expr,needle", [
    ("2 ** 1000", "exponent 1000 in '2 ** 1000' is past 64"),
    ("2.0 ** 64 ** 2", "exponent 4096"),
    ("1e300 ** 2", "'1e300 ** 2': the result is too large for a float"),
    ("1 // 0", "integer division or modulo by zero"),
    ("((((10**60)**60)**60)**60)**60", "the result of '(10 ** 60) ** 60' is past 256 bits"),
    ("''a'' * 10**12 == ''b''", "\"'a' * 10 ** 12\" repeats a sequence past 4096 items"),
    ("[1] * 10**11 == []", "'[1] * 10 ** 11' repeats a sequence past 4096 items"),
])
def test_arithmetic_errors_in_expressions(bind_bad, expr, needle):
    """Arithmetic an expression cannot finish (or would take hours: 10 ** 10 ** 10, or all memory: 'a' * 10**12;
    YAML's '' is a quote) is a file:line error."""
    msg, line = bind_bad("  mlp_bias: {default: false}", f"  mlp_bias: {{default: '{expr}'}}")
    assert where(line, "params.mlp_bias.default") + needle in msg


def test_a_statement_whose_result_nothing_reads(bind_bad):
    """The layer's attention output renamed: before, the compiler dropped the attention (dead code) and the build
    wrote an artifact with no KV cache, which failed at load."""
    msg, line = bind_bad("  - x = add(x, linear(flatten_heads(a), wo, bo))", "  - y = add(x, linear(flatten_heads(a), wo, bo))")
    assert where(line, "graph") + "add computes y, which nothing below reads" in msg


@pytest.mark.parametrize("old, new, field, needle", [
    ("hf: input_layernorm.weight, init: ones}", "hf: input_layernorm.weight, init: ones, quantize: 1}",
     "repeat.weights.ln1.quantize", "expected true or false, got 1"),
    ("hf: self_attn.q_proj.weight, shard: {kind: column, unit: head_dim}}",
     "hf: self_attn.q_proj.weight, shard: {kind: column, unit: 0}}", "repeat.weights.wq.shard.unit",
     "expected a positive integer, got 0"),
    ("hf: model.norm.weight, init: ones}", "hf: 'model.{hidden_size}.weight', init: ones}", "weights.norm_f.hf",
     "{hidden_size} names a param that is not a string (64)"),
    ("ln2:    {shape: [hidden_size]", "ln2:    {shape: [not mlp_bias]", "repeat.weights.ln2.shape",
     "'not mlp_bias' evaluates to True; expected a positive integer"),
    ("outputs: [logits]", "outputs: []", "outputs", "expected a non-empty list of value names"),
], ids=["quantize-not-bool", "shard-unit-0", "hf-int-param", "shape-bool", "no-outputs"])
def test_bad_weight_fields_and_outputs(bind_bad, old, new, field, needle):
    msg, line = bind_bad(old, new)
    assert where(line, field) + needle in msg


def test_unknown_dtype(bind_arch):
    with pytest.raises(MxcError, match=r"dtype: expected one of float32, bfloat16, float16, got 'float64'"):
        bind_arch(dtype="float64")


@pytest.mark.parametrize("field, value, want", [
    # the model file's default is a literal, so the config value must be of its kind: "no" would read as true
    ("tie_word_embeddings", "no", "expected true or false"),
    ("rms_norm_eps", "1e-5", "expected a number"),  # a default written 1e-6 is a number, though YAML reads a string
    ("num_experts", -1, "expected an integer >= 0"),  # min: 0
])
def test_config_value_of_the_wrong_kind(bind_arch, field, value, want):
    with pytest.raises(MxcError) as e:
        bind_arch(**{field: value})
    assert str(e.value) == f"config.json: field {field} = {value!r}: {want}"


@pytest.mark.parametrize("arch, fields, shown, says", [
    ("LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads = 6, num_key_value_heads = 4",
     "the query heads must be a multiple of the kv heads"),
    ("LlamaForCausalLM", dict(num_key_value_heads=3), "num_attention_heads = 4, num_key_value_heads = 3",
     "the query heads must be a multiple of the kv heads"),
    ("LlamaForCausalLM", dict(rms_norm_eps=0.0), "rms_norm_eps = 0.0", "the RMSNorm epsilon must be positive"),
    # the MoE checks' `when: moe` is not shown; Mixtral's num_experts is its num_local_experts
    ("MixtralForCausalLM", dict(num_local_experts=0, num_experts_per_tok=0), "num_local_experts = 0",
     "a mixture of experts needs at least one expert"),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=0),
     "num_experts_per_tok = 0, num_local_experts = 4", "each token is routed to at least one expert and at most"),
    ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=32),
     "num_experts_per_tok = 5, num_experts = 4", "each token is routed to at least one expert and at most"),
], ids=["heads-6-of-4", "kv-3", "eps-0", "no-experts", "top-0", "top-5-of-4"])
def test_model_file_checks_name_the_config_fields(bind_arch, llama_text, arch, fields, shown, says):
    """llama.yaml's ``checks``: a config the graph cannot hold is refused in the config's terms (its fields and
    values, what they must satisfy, the check's line), not by the bound graph's verifier in the graph's."""
    with pytest.raises(MxcError) as e:
        bind_arch(arch, **fields)
    msg = str(e.value)
    assert msg.startswith(f"config.json: {shown}: {says}"), msg
    lines = llama_text.splitlines()
    check_line = max(i for i, ln in enumerate(lines[:line_of(llama_text, says)], start=1)
                     if ln.startswith("  - {"))  # the line the check starts on
    assert msg.endswith(f"(llama.yaml:{check_line}, checks)"), msg


def test_model_file_checks_pass_the_served_configs(bind_arch):
    """The checks hold for what the family serves: GQA, MHA (kv heads defaulted to the query heads) and MQA."""
    for kv in (2, 4, 1, None):
        bind_arch(num_key_value_heads=kv)


@pytest.mark.parametrize("new, field, needle", [
    ("checks: {require: true}\n", "checks", "expected a list of {require: condition over params"),
    ("checks:\n  - {require: true}\n", "checks[0]", "expected {require: condition over params, says:"),
    ("checks:\n  - {require: true, says: 1}\n", "checks[0]", "expected {require: condition over params, says:"),
    ("checks:\n  - {require: true, says: x, why: y}\n", "checks[0]", "expected {require: condition over params"),
    ("checks:\n  - {require: no_such_param > 0, says: x}\n", "checks[0].require", "unknown name 'no_such_param'"),
    ("checks:\n  - {require: hidden_size // 0, says: x}\n", "checks[0].require", "integer division or modulo by zero"),
    ("checks:\n  - {when: no_such_param, require: true, says: x}\n", "checks[0].when", "unknown name 'no_such_param'"),
], ids=["not-a-list", "no-says", "says-not-text", "extra-key", "unknown-name", "zero-division", "unknown-in-when"])
def test_malformed_checks(bind_bad, llama_text, new, field, needle):
    """The model file's own mistakes in its checks: file:line: field, as every binder error."""
    start = llama_text.index("\nchecks:") + 1
    old = llama_text[start:llama_text.index("\n\n", start) + 1]  # the whole section
    msg, line = bind_bad(old, new, mark=new.splitlines()[-1])
    assert msg.startswith(where(line, field)) and needle in msg, msg


def _section(text: str, name: str) -> str:
    """The whole top-level section ``name`` of a model file, up to the blank line that ends it."""
    start = text.index(f"\n{name}:") + 1
    return text[start:text.index("\n\n", start) + 1]


@pytest.mark.parametrize("section, new, field, needle", [
    ("params", "params: [hidden_size]\ndoc:\n", "params", "expected a mapping name -> {default: expr}"),
    ("inputs", "inputs: [tokens, positions, logit_rows]\n", "inputs", "expected a mapping name -> {shape: [...]"),
    ("inputs", "inputs:\n  tokens: T\n", "inputs.tokens", "expected {shape: [...], dtype: ...}"),
    ("inputs", "inputs:\n  tokens: {shape: 5, dtype: int64}\n", "inputs.tokens", "expected {shape: [...], dtype: ...}"),
    ("weights", "weights: [embed, norm_f, lm_head]\n", "weights", "expected a mapping name -> {shape, hf, ...}"),
    ("weights", "weights:\n  norm_f: model.norm.weight\n", "weights.norm_f", "expected a mapping with shape and hf"),
    ("weights", "weights:\n  norm_f: {shape: hidden_size, hf: model.norm.weight}\n", "weights.norm_f.shape",
     "expected a list of dimension expressions"),
    ("ignore", "ignore: model.layers.{i}.self_attn.rotary_emb.inv_freq\n", "ignore",
     "expected a list of checkpoint names"),
    ("graph", "graph: {x: embedding(tokens, embed)}\n", "graph", "expected a list of statements"),
    ("graph", "graph:\n  - repeat: 2\n    body: []\n", "repeat", "expected {repeat: {count, index, name, hf_prefix}"),
], ids=["params-not-mapping", "inputs-not-mapping", "input-not-mapping", "input-shape-not-list",
        "weights-not-mapping", "weight-not-mapping", "weight-shape-not-list", "ignore-not-list", "graph-not-list",
        "repeat-not-mapping"])
def test_malformed_sections(bind_bad, llama_text, section, new, field, needle):
    """A section of the wrong form is named at its line, as every binder error, not a traceback (an ``inputs``
    list, an input's shape of a number or an ``ignore`` string raised AttributeError or TypeError)."""
    mark = next(ln for ln in new.splitlines() if field.split(".")[min(1, field.count("."))] + ":" in ln)
    msg, line = bind_bad(_section(llama_text, section), new, mark=mark)
    assert msg.startswith(where(line, field)) and needle in msg, msg
    assert "\n" not in msg
