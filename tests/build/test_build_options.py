"""Build options and the model file's runtime contract: each bad value or off-contract graph is refused in one line
before anything is written; defaults come from the config where it has them."""

from __future__ import annotations

import json

import pytest

import mxc
from mxc.errors import MxcError
from tests.build.helpers import ROPE_LINE, build, build_edited, one_line


def test_bad_dtype_and_target(tmp_path):
    with pytest.raises(MxcError, match="--dtype float64"):
        build("llama.yaml", tmp_path / "art", dtype="float64")
    with pytest.raises(MxcError, match="--target tpu"):
        build("llama.yaml", tmp_path / "art", target="tpu")


@pytest.mark.parametrize("kw, needle", [(dict(quant="int8"), "--quant int8"),
                                        (dict(quant="fp8", quant_granularity="row"), "--quant-granularity row")])
def test_bad_quant_from_python(kw, needle, tmp_path):
    """mxc.build's quant arguments are not limited by argparse's choices: another value is one line naming it."""
    with pytest.raises(MxcError, match=f"{needle}.*expected fp8 with channel, tensor or block128") as e:
        build("llama.yaml", tmp_path / "art", **kw)
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_pdl_needs_cuda_sm90(ckpt, tmp_path):
    with pytest.raises(MxcError, match="--pdl: programmatic dependent launch needs --target cuda on sm_90") as e:
        build(ckpt, tmp_path / "art", pdl=True)
    one_line(e)
    with pytest.raises(MxcError, match="sm_80"):
        build(ckpt, tmp_path / "art", pdl=True, target="cuda", arch=80)
    assert not (tmp_path / "art").exists()


def test_prefill_graphs_needs_cuda_and_a_count(ckpt, tmp_path):
    with pytest.raises(MxcError, match="--prefill-graphs 256: .* with --target cuda .got --target cpu.; drop it") as e:
        build(ckpt, tmp_path / "art", prefill_graphs=256)
    one_line(e)
    with pytest.raises(MxcError, match=r"^--prefill-graphs -1: expected a token count >= 0 \(0: off\)$"):
        build(ckpt, tmp_path / "art", prefill_graphs=-1, target="cuda")
    with pytest.raises(MxcError, match=r"^--prefill-graphs True: expected a token count >= 0 \(0: off\) \(got bool\)$"):
        build(ckpt, tmp_path / "art", prefill_graphs=True)  # the Python API's bool is no count, as for --tp
    with pytest.raises(MxcError, match=r"^--prefill-graphs 15: the smallest prompt bucket .* is 16 tokens; "
                                       r"give 0 \(off\) or at least 16$"):
        build(ckpt, tmp_path / "art", prefill_graphs=15, target="cuda")  # no bucket: nothing would replay
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("mpe", [128, 8192])
def test_default_max_seq_len_is_the_models_up_to_4096(mpe, hf_checkpoint, tmp_path):
    """Without --max-seq-len the KV cache is sized for max_position_embeddings, at most 4096 rows."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", max_position_embeddings=mpe)
    art = build(str(ckpt), tmp_path / "a")
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == min(4096, mpe)


@pytest.mark.parametrize("kw", [dict(max_seq_len="512"), dict(max_batch=True), dict(max_batch=0), dict(max_seq_len=1.5)])
def test_cache_sizes_from_python_are_positive_integers(kw, tmp_path):
    """mxc.build's max_batch and max_seq_len, as the CLI's flags: a string or float used to end in a TypeError
    deep in the build."""
    with pytest.raises(MxcError, match=r"--max-batch .* / --max-seq-len .*: expected positive integers"):
        mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=lambda m: None, **kw)


@pytest.mark.parametrize("old,new,needle", [
    ("  - x = gather_rows(x, logit_rows)                      # [R, hidden]\n", "",
     r"edited\.yaml: outputs: expected one value, the logits \[R, vocab\] of the logit_rows .*; got logits \[T, 256\]"),
    ("  tokens: {shape: [T], dtype: int64}       # all sequences' tokens, flattened\n"
     "  positions: {shape: [T], dtype: int64}\n",
     "  positions: {shape: [T], dtype: int64}\n  tokens: {shape: [T], dtype: int64}\n",
     r"edited\.yaml: inputs: expected, in this order, tokens \[T\] int64, positions \[T\] int64, logit_rows \[R\] "
     r"int64; got positions \[T\] int64, tokens \[T\] int64, logit_rows \[R\] int64$"),
    ("logit_rows: {shape: [R], dtype: int64}", "logit_rows: {shape: [T], dtype: int64}",
     r"edited\.yaml: inputs: expected, in this order, .*; got tokens \[T\] int64, positions \[T\] int64, "
     r"logit_rows \[T\] int64$"),
    ("  - logits = linear(rms_norm(x, norm_f, eps=rms_norm_eps), lm_head)\n",
     "  - logits = heads(linear(rms_norm(x, norm_f, eps=rms_norm_eps), lm_head), size=16)\n",
     r"edited\.yaml: outputs: expected one value, the logits \[R, vocab\] .*; got logits \[R, 16, 16\]"),
], ids=["no-gather", "inputs-swapped", "logit-rows-of-every-token", "logits-3d"])
def test_a_graph_off_the_runtime_contract_is_refused(old, new, needle, tmp_path):
    """The runtime passes tokens, positions and logit_rows in that order and reads logits [R, vocab]: a model file
    that differs used to build and then fail (or, with the inputs swapped, run wrong) at generate time."""
    with pytest.raises(MxcError, match=needle) as e:
        build_edited(tmp_path, old, new)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()


def test_two_repeat_blocks_are_refused_in_one_line(tmp_path):
    """A second repeated block (dense layers, then others) is not something the runtime's weight layout serves yet:
    a one-line error, where it was a NotImplementedError."""
    from mxc.models.registry import MODELS_DIR

    lines = (MODELS_DIR / "llama.yaml").read_text().splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  - repeat:"))
    end = next(i for i, ln in enumerate(lines) if i > start and ln.startswith("  - ") and "repeat" not in ln
               and not ln.startswith("      "))
    block = "".join(lines[start:end])
    second = block.replace('name: "layers.{i}."', 'name: "extra.{i}."').replace(
        'hf_prefix: "model.layers.{i}."', 'hf_prefix: "model.extra.{i}."')
    old = "".join(lines[start:end])
    with pytest.raises(MxcError, match=r"edited\.yaml: 2 repeat blocks \(edited\.yaml:\d+, edited\.yaml:\d+\); the "
                                       r"runtime's weight layout supports one"):
        build_edited(tmp_path, old, old + second)


def test_two_architectures_are_refused(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["LlamaForCausalLM", "MistralForCausalLM"]
    path.write_text(json.dumps(config))
    with pytest.raises(MxcError, match="exactly one architecture") as e:
        mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("shape, dtype", [("P", "int64"), ("T", "int32")])
def test_positions_off_the_runtime_contract_are_refused_where_no_op_reads_them(shape, dtype, tmp_path):
    """A definition without RoPE (positions unread, so no op checks them) must still take positions as the runtime
    passes them: int64 [T], as many as the tokens."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    build_edited(tmp_path / "ok", ROPE_LINE, "")  # the same definition with positions as the runtime passes them
    with pytest.raises(MxcError, match=r"edited\.yaml: inputs: expected, in this order, tokens \[T\] int64, "
                                       rf"positions \[T\] int64, .*; got .*positions \[{shape}\] {dtype},") as e:
        build_edited(tmp_path / "bad", ROPE_LINE, "",
                      ("positions: {shape: [T], dtype: int64}", f"positions: {{shape: [{shape}], dtype: {dtype}}}"))
    one_line(e)
    assert not (tmp_path / "bad" / "art").exists()


def test_a_graph_without_attention_is_refused(tmp_path):
    """The runtime decodes with a KV cache the attention ops fill: a definition with none is refused at build time."""
    attention = "      - a = attention(q, k, v, scale=head_dim**-0.5, layer=i, sliding_window=attention_window)\n"
    with pytest.raises(MxcError, match=r"edited\.yaml: the graph has no attention over the KV cache") as e:
        build_edited(tmp_path, attention, "      - a = mul(q, add(k, v))\n", num_key_value_heads=4)
    one_line(e)
    assert not (tmp_path / "art").exists()


ROPE_PARAM = "  rope: {resolve: llama_rope}    # normalized rope_parameters / rope_scaling\n"


def test_default_max_seq_len_without_max_position_embeddings_is_4096(tmp_path):
    """A definition without RoPE (which needs the field) binds a config.json without max_position_embeddings: the
    KV cache then takes 4096 rows."""
    art = build_edited(tmp_path, ROPE_LINE, "", (ROPE_PARAM, ""), max_position_embeddings=None)
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == 4096


@pytest.mark.parametrize("mpe", [-5, True, 2.5, 0, 1])
def test_max_position_embeddings_not_a_positive_integer_is_refused(mpe, tmp_path):
    """Named as the config.json field it comes from (not as --max-seq-len, which was not given), where no RoPE
    checks it first; 1 leaves no room for a new token after a prompt's."""
    with pytest.raises(MxcError, match=rf"config\.json: max_position_embeddings {mpe!r}: expected an integer >= 2 "
                                       r"\(a prompt token and a new one\), or pass --max-seq-len$") as e:
        build_edited(tmp_path, ROPE_LINE, "", (ROPE_PARAM, ""), max_position_embeddings=mpe)
    one_line(e)


@pytest.mark.parametrize("tp", [0, -1, "2", 1.0, True])
def test_tp_not_a_positive_integer_is_refused(tp, tmp_path):
    with pytest.raises(MxcError, match=rf"--tp {tp}: expected a positive integer") as e:
        build("llama.yaml", tmp_path / "art", tp=tp)
    one_line(e)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("arch, pdl", [(90, True), (100, True), (89, False), (80, False)])
def test_pdl_is_on_by_default_for_cuda_on_sm90_and_later(arch, pdl, tmp_path, monkeypatch):
    """``pdl=None`` (no --pdl / --no-pdl): programmatic dependent launch wherever it exists, --target cuda on sm_90+;
    the options the artifact is written with say so (the writing itself, kernel compilation, is left out here)."""
    from mxc import builder

    seen = []
    monkeypatch.setattr(builder, "_write", lambda tmp, graph, src, options, *rest: seen.append(options))
    build("llama.yaml", tmp_path / "art", target="cuda", arch=arch)
    assert [o.pdl for o in seen] == [pdl]
    build("llama.yaml", tmp_path / "cpu", target="cpu", arch=arch)
    assert seen[-1].pdl is False


@pytest.mark.parametrize("max_seq_len, noted", [(512, False), (513, True)])
def test_a_max_seq_len_past_max_position_embeddings_is_noted(max_seq_len, noted, tmp_path):
    """The tiny config's max_position_embeddings is 512: a KV cache of exactly that many rows is within what the
    model was trained on, one row more is noted."""
    lines = []
    mxc.build("llama.yaml", out=tmp_path / "art", max_seq_len=max_seq_len, progress=False, log=lines.append)
    assert any(f"--max-seq-len {max_seq_len} is above" in ln for ln in lines) is noted, lines


@pytest.mark.parametrize("kw, pattern", [
    (dict(source=None), r"source must be a path \(str or Path\), got NoneType"),
    (dict(source=123), r"source must be a path \(str or Path\), got int"),
    (dict(out=123), r"out must be a path \(str or Path\) or None, got int"),
    (dict(out=b"x"), r"out must be a path \(str or Path\) or None, got bytes"),
    (dict(checkpoint=123), r"checkpoint must be a path"),
    (dict(config={"vocab_size": 1}), r"config must be a path \(str or Path\) or None, got dict"),
    (dict(dump_ir=1), r"dump_ir must be a path"),
    (dict(arch="90", target="cuda"), r"arch must be an integer, got '90'"),
    (dict(arch=True, target="cuda"), r"arch must be an integer, got True"),
    (dict(disable_passes=["fuse_linear_io", 3]), r"disable_passes must be a list of pass names, got \['fuse_linear_io', "
                                                 r"3\]"),
    (dict(disable_passes=None), r"disable_passes must be a list of pass names, got None"),
    (dict(disable_passes="fuse_linear_io"), r"disable_passes must be a list of pass names"),
])
def test_python_arguments_of_the_wrong_type_are_named(kw, pattern, tmp_path):
    """What the Python API may pass that the command line cannot: one line naming the argument, not a TypeError (or,
    for tp=True, a tp=1 build)."""
    kw = {"source": "llama.yaml", "out": tmp_path / "art", **kw}
    with pytest.raises(MxcError, match=pattern) as e:
        mxc.build(kw.pop("source"), progress=False, log=lambda m: None, **kw)
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_numpy_integers_are_counts_like_ints(tmp_path):
    """A script's numpy counts (np.int64(2)) are integers: built as ints, not refused as "--tp 2: expected a
    positive integer"."""
    np = pytest.importorskip("numpy")
    art = build("llama.yaml", tmp_path / "art", tp=np.int64(2), max_batch=np.int32(4), max_seq_len=np.int64(64))
    options = json.loads((art / "manifest.json").read_text())["options"]
    assert (options["tp"], options["max_batch"], options["max_seq_len"]) == (2, 4, 64)
    assert all(type(options[k]) is int for k in ("tp", "max_batch", "max_seq_len"))


@pytest.mark.parametrize("kw, pattern", [
    (dict(tp="2"), r"--tp 2: expected a positive integer \(got str\)$"),
    (dict(max_batch=4.0), r"--max-batch 4.0 / --max-seq-len 512: expected positive integers \(got float\)$"),
    (dict(mlp_pair="false"), r"mlp_pair must be True or False, got 'false'$"),
    (dict(quant_lm_head="no"), r"quant_lm_head must be True or False, got 'no'$"),
    (dict(progress="yes"), r"progress must be True or False, got 'yes'$"),
    (dict(pdl=1), r"pdl must be True or False \(or None: the default\), got 1$"),
    (dict(log=None), r"log must be a callable taking one message \(str\), got None$"),
])
def test_api_arguments_of_the_wrong_type_are_named(kw, pattern, tmp_path):
    """A string "false" counted as true (and then an error about a flag never given); log=None was a TypeError at
    the first message; a string count printed like a number without saying it was one."""
    with pytest.raises(MxcError, match=pattern) as e:
        mxc.build("llama.yaml", out=tmp_path / "art", **{"log": lambda m: None, "progress": False, **kw})
    one_line(e)
    assert not (tmp_path / "art").exists()
