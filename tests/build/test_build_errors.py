"""Bad inputs fail with a one-line MxcError naming the culprit; a failed build keeps the old artifact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mxc
from mxc.errors import MxcError, size_text

DROPPED = "model.layers.1.mlp.up_proj.weight"


def _build(source, out, **kw):
    return mxc.build(str(source), out=out, progress=False, log=lambda m: None, **kw)


def _edit_tensors(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def ckpt(hf_checkpoint):
    return hf_checkpoint("LlamaForCausalLM")[0]


def test_unknown_architecture(ckpt, tmp_path):
    _edit_config(ckpt, architectures=["FooForCausalLM"])
    with pytest.raises(MxcError, match="FooForCausalLM") as e:
        _build(ckpt, tmp_path / "art")
    msg = _one_line(e)
    assert "config.json" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_architectures_field_missing(ckpt, tmp_path):
    _edit_config(ckpt, architectures=None)
    with pytest.raises(MxcError, match="architectures"):
        _build(ckpt, tmp_path / "art")


def test_config_not_json(ckpt, tmp_path):
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(MxcError, match=r"config\.json: not valid JSON") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)


def test_config_not_utf8(ckpt, tmp_path):
    """A config.json (or a shard index) holding bytes that are not UTF-8: one line naming the file, no traceback."""
    (ckpt / "config.json").write_bytes(b'{"architectures": ["Llama\xffForCausalLM"]}')
    with pytest.raises(MxcError, match=r"config\.json: not UTF-8 text \(invalid start byte at byte 25\)") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)


def test_index_not_utf8(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff": 1}}')
    with pytest.raises(MxcError, match=r"model\.safetensors\.index\.json: not UTF-8 text") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)
    assert not (tmp_path / "art").exists()


def test_config_missing(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    with pytest.raises(MxcError, match=r"config\.json: not found"):
        _build(ckpt, tmp_path / "art")


def test_missing_tensor(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.pop(DROPPED))
    with pytest.raises(MxcError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                        r"\(expected shape \[96, 64\]") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)
    assert not (tmp_path / "art").exists()


def test_tensor_left_out_of_the_index(ckpt, tmp_path):
    """A tensor in a shard that a stale index does not list: the error says where it is and what to fix."""
    names = sorted(load_file(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names if n != DROPPED}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MxcError, match=rf"missing tensor '{DROPPED}' .*: it is in model-00001-of-00001\.safetensors, "
                                        r"but model\.safetensors\.index\.json does not list it") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)


def test_unexpected_tensor(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(MxcError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        _build(ckpt, tmp_path / "art")


def test_ignored_tensor_is_accepted(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    mxc.load(_build(ckpt, tmp_path / "art"))


def test_misshaped_tensor(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.__setitem__(DROPPED, torch.zeros(95, 64)))
    with pytest.raises(MxcError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[95, 64\], "
                                        r"expected \[96, 64\]"):
        _build(ckpt, tmp_path / "art")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file") as e:
        _build(ckpt, tmp_path / "art")
    assert str(path) in _one_line(e)


def test_garbage_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)


def test_no_weights_in_checkpoint(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(MxcError, match="no checkpoint found"):
        _build(ckpt, tmp_path / "art")


def test_garbage_bin(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not a zip file at all" * 50)
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: not a valid PyTorch checkpoint"):
        _build(ckpt, tmp_path / "art")


def test_unknown_source_file(tmp_path):
    with pytest.raises(MxcError, match=r"nosuch\.yaml: no such file, and not a bundled definition \(llama\.yaml"):
        _build(tmp_path / "nosuch.yaml", tmp_path / "art")
    with pytest.raises(MxcError, match=r"nosuch\.yaml: no such file"):
        _build("nosuch.yaml", tmp_path / "art")


def test_checkpoint_not_a_directory(tmp_path):
    with pytest.raises(MxcError, match="--checkpoint .*: not a directory"):
        _build("llama.yaml", tmp_path / "art", checkpoint=str(tmp_path / "missing"))


def test_bundled_definition_for_another_arch(ckpt, tmp_path, monkeypatch):
    """A bundled definition named with a checkpoint whose architecture another definition serves is refused, naming
    both. Only llama.yaml is bundled today, so the registry is made to send Llama to another file."""
    from dataclasses import replace

    from mxc import source

    real = source.lookup
    monkeypatch.setattr(source, "lookup", lambda arch, where="config.json": replace(real(arch, where), model="gpt.yaml"))
    with pytest.raises(MxcError, match=r"config\.json: architecture LlamaForCausalLM is served by gpt\.yaml, "
                                        r"not llama\.yaml") as e:
        _build("llama.yaml", tmp_path / "art", checkpoint=str(ckpt))
    _one_line(e)
    assert not (tmp_path / "art").exists()


def test_out_is_not_an_artifact(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(MxcError, match=r"--out .*mine: exists and is not an mxc artifact"):
        _build("llama.yaml", out)
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "keep me"


def test_out_with_another_programs_manifest_is_not_an_artifact(tmp_path):
    """A directory is replaced only when its manifest.json is mxc's: a web app's is the user's."""
    out = tmp_path / "webapp"
    (out / "src").mkdir(parents=True)
    (out / "manifest.json").write_text('{"name": "my-extension"}')
    (out / "src" / "app.js").write_text("keep me")
    with pytest.raises(MxcError, match=r"--out .*webapp: exists and is not an mxc artifact"):
        _build("llama.yaml", out)
    assert (out / "src" / "app.js").read_text() == "keep me"


@pytest.mark.parametrize("content", [b'{"schema_version": 10}', b'{"mxc_version": "0.1.0"}',
                                     b'["schema_version", "mxc_version"]', b"{not json", b'{"\xff": 1}'],
                         ids=["no-mxc-version", "no-schema-version", "a-list", "not-json", "not-utf8"])
def test_out_with_a_manifest_that_is_not_mxcs_is_not_replaced(content, tmp_path):
    """Only a manifest.json that is a JSON object with both schema_version and mxc_version marks an artifact: any
    other (someone else's, or unreadable) leaves the directory the user's, refused in one line."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_bytes(content)
    with pytest.raises(MxcError, match=r"--out .*mine: exists and is not an mxc artifact") as e:
        _build("llama.yaml", out)
    _one_line(e)
    assert (out / "manifest.json").read_bytes() == content


def test_out_inside_an_artifact(tmp_path):
    """A build into a folder of another artifact would add files its manifest does not list, so that it no longer
    loads: refused, and the artifact keeps loading."""
    art = _build("llama.yaml", tmp_path / "art")
    with pytest.raises(MxcError, match=r"--out .*sub: is inside the artifact .*art; choose a path outside it") as e:
        _build("llama.yaml", art / "sub")
    _one_line(e)
    assert not (art / "sub").exists()
    mxc.load(art)


def test_out_is_a_file(tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    with pytest.raises(MxcError, match="exists and is not an mxc artifact"):
        _build("llama.yaml", out)
    assert out.read_text() == "x"


def test_unsupported_config_qwen2_sliding_window(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM", use_sliding_window=True)
    assert json.loads((ckpt / "config.json").read_text())["use_sliding_window"] is True
    with pytest.raises(MxcError, match=r"`use_sliding_window` is true, which is not supported for Qwen2ForCausalLM"):
        _build(ckpt, tmp_path / "art")


def test_bad_dtype_and_target(tmp_path):
    with pytest.raises(MxcError, match="--dtype float64"):
        _build("llama.yaml", tmp_path / "art", dtype="float64")
    with pytest.raises(MxcError, match="--target tpu"):
        _build("llama.yaml", tmp_path / "art", target="tpu")


def test_failed_build_keeps_previous_artifact(ckpt, tmp_path):
    out = tmp_path / "art"
    _build(ckpt, out)
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    logits = mxc.load(out).logits([[1, 2, 3]])

    _edit_tensors(ckpt, lambda t: t.pop(DROPPED))
    with pytest.raises(MxcError, match="missing tensor"):
        _build(ckpt, out)

    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert torch.equal(mxc.load(out).logits([[1, 2, 3]]), logits)  # loads and verifies every file
    assert not list(tmp_path.glob(".*.building-*"))
    assert not list(tmp_path.glob(".*.old-*"))


def test_pdl_needs_cuda_sm90(ckpt, tmp_path):
    with pytest.raises(MxcError, match="--pdl: programmatic dependent launch needs --target cuda on sm_90") as e:
        _build(ckpt, tmp_path / "art", pdl=True)
    _one_line(e)
    with pytest.raises(MxcError, match="sm_80"):
        _build(ckpt, tmp_path / "art", pdl=True, target="cuda", arch=80)
    assert not (tmp_path / "art").exists()


def test_prefill_graphs_needs_cuda_and_a_count(ckpt, tmp_path):
    with pytest.raises(MxcError, match="--prefill-graphs 256: .* with --target cuda") as e:
        _build(ckpt, tmp_path / "art", prefill_graphs=256)
    _one_line(e)
    with pytest.raises(MxcError, match="--prefill-graphs -1: expected a token count >= 0"):
        _build(ckpt, tmp_path / "art", prefill_graphs=-1, target="cuda")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("arch, name, dtype", [
    ("LlamaForCausalLM", "model.layers.0.mlp.up_proj.weight", torch.int32),  # the second part of gate/up
    ("LlamaForCausalLM", "model.layers.1.self_attn.v_proj.weight", torch.bool),  # the third part of qkv
    ("LlamaForCausalLM", "model.layers.0.self_attn.k_proj.weight", torch.float8_e4m3fn),
    ("MixtralForCausalLM", "model.layers.0.block_sparse_moe.experts.1.w1.weight", torch.int8),  # not the first expert
])
def test_every_part_of_a_merged_or_stacked_weight_is_checked(hf_checkpoint, tmp_path, arch, name, dtype):
    """Each checkpoint tensor of a merged (qkv, gate/up) or stacked (experts) weight must hold floating-point values:
    an integer one was cast into the weight, an fp8 one crashed in the merge."""
    ckpt, _ = hf_checkpoint(arch, **({"num_local_experts": 4, "num_experts_per_tok": 2} if "Mixtral" in arch else {}))
    _edit_tensors(ckpt, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(MxcError, match=f"{name} is stored as {dtype}") as e:
        _build(ckpt, tmp_path / "art")
    _one_line(e)
    assert not (tmp_path / "art").exists()


def _tensor_bytes(art) -> int:
    from safetensors import safe_open

    total = 0
    for path in (art / "weights").glob("rank*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


def test_too_little_disk_is_refused_before_the_build(tmp_path, monkeypatch):
    """Weights larger than the free space: one line naming --out, the bytes needed (the tensors the build writes)
    and free; nothing written."""
    import re
    import shutil

    from mxc import builder

    need = size_text(_tensor_bytes(_build("llama.yaml", tmp_path / "ref")))
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    out = tmp_path / "sub" / "art"
    with pytest.raises(MxcError, match=rf"--out .*art: the artifact's weights take {re.escape(need)} and .* has "
                                       rf"1\.0 KiB free; free some space") as e:
        _build("llama.yaml", out)
    _one_line(e)
    assert not (tmp_path / "sub").exists()
    # a filesystem that reports no size at all (total 0, as some pseudo mounts do) is not judged: the build runs
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(total=0, free=0))
    assert _build("llama.yaml", out) == out


def test_free_space_of_exactly_the_weights_is_enough(tmp_path, monkeypatch):
    """The check refuses less room than the weights take: exactly their bytes free passes, one byte less does not."""
    import shutil

    from mxc import builder

    need = _tensor_bytes(_build("llama.yaml", tmp_path / "ref"))
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(MxcError, match="free some space"):
        _build("llama.yaml", tmp_path / "art")
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    assert _build("llama.yaml", tmp_path / "art") == tmp_path / "art"


def test_an_out_whose_parent_cannot_be_written_is_refused_before_the_build(tmp_path, monkeypatch):
    """--out under an existing directory the user may not write: one line naming --out and that directory."""
    import os
    import re

    from mxc import builder

    real = os.access
    monkeypatch.setattr(builder.os, "access", lambda p, mode: os.fspath(p) != str(tmp_path) and real(p, mode))
    out = tmp_path / "sub" / "art"
    with pytest.raises(MxcError, match=rf"--out {re.escape(str(out))}: cannot be created "
                                       rf"\({re.escape(str(tmp_path))} is not writable\)") as e:
        _build("llama.yaml", out)
    _one_line(e)
    assert not (tmp_path / "sub").exists()


def test_a_stale_temporary_directory_of_this_pid_is_replaced(tmp_path):
    """A ``.art.building-PID`` left by an earlier process that had this build's pid (pids are reused, after a
    reboot or in a container) is not in the way: the build writes afresh and leaves no temporary directory."""
    import os

    stale = tmp_path / f".art.building-{os.getpid()}"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / "rank0.safetensors").write_text("half-written")
    art = _build("llama.yaml", tmp_path / "art")
    mxc.load(art)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_the_disk_check_counts_every_ranks_weights(ckpt, tmp_path, monkeypatch):
    """--tp 2 writes a weight file a rank: room for a little more than one of them is not enough."""
    import shutil

    from mxc import builder

    ref = _build(str(ckpt), tmp_path / "ref", tp=2)
    files = sorted((ref / "weights").glob("rank*.safetensors"))
    assert len(files) == 2
    need = sum(f.stat().st_size for f in files)
    real = shutil.disk_usage
    short = (need + files[0].stat().st_size) // 2
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=short))
    with pytest.raises(MxcError, match="free some space"):
        _build(str(ckpt), tmp_path / "o", tp=2)


@pytest.mark.parametrize("mpe", [128, 8192])
def test_default_max_seq_len_is_the_models_up_to_4096(mpe, hf_checkpoint, tmp_path):
    """Without --max-seq-len the KV cache is sized for max_position_embeddings, at most 4096 rows."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", max_position_embeddings=mpe)
    art = _build(str(ckpt), tmp_path / "a")
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == min(4096, mpe)


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_disk_full_while_writing_is_one_line_and_leaves_nothing(code, tmp_path, monkeypatch):
    """ENOSPC (or EDQUOT, a quota reached) from the weight writer (the disk filled by something else mid-build)
    becomes a one-line error naming --out; the half-written directory goes, and an artifact already at --out
    stays."""
    import errno
    import os
    import re

    from mxc.loaders import safetensors_writer

    out = tmp_path / "art"
    _build("llama.yaml", out)
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    need = size_text(_tensor_bytes(out))

    def full(self, name, tensor):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "write", full)
    strerror = re.escape(os.strerror(getattr(errno, code)))
    want = rf"--out .*art: {strerror} while writing the artifact \(its weights take {re.escape(need)}\); "
    with pytest.raises(MxcError, match=want + "free some space or choose another --out") as e:
        _build("llama.yaml", out)
    _one_line(e)
    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not list(tmp_path.glob(".*.building-*"))


@pytest.mark.parametrize("kw", [dict(max_seq_len="512"), dict(max_batch=True), dict(max_batch=0), dict(max_seq_len=1.5)])
def test_cache_sizes_from_python_are_positive_integers(kw, tmp_path):
    """mxc.build's max_batch and max_seq_len, as the CLI's flags: a string or float used to end in a TypeError
    deep in the build."""
    with pytest.raises(MxcError, match=r"--max-batch .* / --max-seq-len .*: expected positive integers"):
        mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=lambda m: None, **kw)


def _build_edited(tmp_path, old: str, new: str, *more: tuple[str, str], **fields):
    """Build llama.yaml with ``old`` replaced by ``new`` (and each further (old, new) pair), bound to its tiny
    config with ``fields`` overridden."""
    from mxc.models.registry import MODELS_DIR

    text = (MODELS_DIR / "llama.yaml").read_text()
    for o, n in ((old, new), *more):
        assert text.count(o) == 1, o
        text = text.replace(o, n)
    (tmp_path / "edited.yaml").write_text(text)
    config = json.loads((MODELS_DIR / "configs" / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return mxc.build(str(tmp_path / "edited.yaml"), config=str(tmp_path / "config.json"), out=tmp_path / "art",
                     progress=False, log=lambda m: None)


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
        _build_edited(tmp_path, old, new)
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
        _build_edited(tmp_path, old, old + second)


def test_two_architectures_are_refused(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["LlamaForCausalLM", "MistralForCausalLM"]
    path.write_text(json.dumps(config))
    with pytest.raises(MxcError, match="exactly one architecture") as e:
        mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


ROPE_LINE = "      - q, k = rope(q, k, positions, spec=rope)\n"


@pytest.mark.parametrize("shape, dtype", [("P", "int64"), ("T", "int32")])
def test_positions_off_the_runtime_contract_are_refused_where_no_op_reads_them(shape, dtype, tmp_path):
    """A definition without RoPE (positions unread, so no op checks them) must still take positions as the runtime
    passes them: int64 [T], as many as the tokens."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    _build_edited(tmp_path / "ok", ROPE_LINE, "")  # the same definition with positions as the runtime passes them
    with pytest.raises(MxcError, match=r"edited\.yaml: inputs: expected, in this order, tokens \[T\] int64, "
                                       rf"positions \[T\] int64, .*; got .*positions \[{shape}\] {dtype},") as e:
        _build_edited(tmp_path / "bad", ROPE_LINE, "",
                      ("positions: {shape: [T], dtype: int64}", f"positions: {{shape: [{shape}], dtype: {dtype}}}"))
    _one_line(e)
    assert not (tmp_path / "bad" / "art").exists()


def test_a_graph_without_attention_is_refused(tmp_path):
    """The runtime decodes with a KV cache the attention ops fill: a definition with none is refused at build time."""
    attention = "      - a = attention(q, k, v, scale=head_dim**-0.5, layer=i, sliding_window=attention_window)\n"
    with pytest.raises(MxcError, match=r"edited\.yaml: the graph has no attention over the KV cache") as e:
        _build_edited(tmp_path, attention, "      - a = mul(q, add(k, v))\n", num_key_value_heads=4)
    _one_line(e)
    assert not (tmp_path / "art").exists()



ROPE_PARAM = "  rope: {resolve: llama_rope}    # normalized rope_parameters / rope_scaling\n"


def test_default_max_seq_len_without_max_position_embeddings_is_4096(tmp_path):
    """A definition without RoPE (which needs the field) binds a config.json without max_position_embeddings: the
    KV cache then takes 4096 rows."""
    art = _build_edited(tmp_path, ROPE_LINE, "", (ROPE_PARAM, ""), max_position_embeddings=None)
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == 4096


@pytest.mark.parametrize("mpe", [-5, True, 2.5, 0])
def test_max_position_embeddings_not_a_positive_integer_is_refused(mpe, tmp_path):
    """Named as the config.json field it comes from (not as --max-seq-len, which was not given), where no RoPE
    checks it first."""
    with pytest.raises(MxcError, match=rf"config\.json: max_position_embeddings {mpe!r}: expected a positive "
                                       r"integer$") as e:
        _build_edited(tmp_path, ROPE_LINE, "", (ROPE_PARAM, ""), max_position_embeddings=mpe)
    _one_line(e)


@pytest.mark.parametrize("tp", [0, -1, "2", 1.0])
def test_tp_not_a_positive_integer_is_refused(tp, tmp_path):
    with pytest.raises(MxcError, match=rf"--tp {tp}: expected a positive integer") as e:
        _build("llama.yaml", tmp_path / "art", tp=tp)
    _one_line(e)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("arch, pdl", [(90, True), (100, True), (89, False), (80, False)])
def test_pdl_is_on_by_default_for_cuda_on_sm90_and_later(arch, pdl, tmp_path, monkeypatch):
    """``pdl=None`` (no --pdl / --no-pdl): programmatic dependent launch wherever it exists, --target cuda on sm_90+;
    the options the artifact is written with say so (the writing itself, kernel compilation, is left out here)."""
    from mxc import builder

    seen = []
    monkeypatch.setattr(builder, "_write", lambda tmp, graph, src, options, *rest: seen.append(options))
    _build("llama.yaml", tmp_path / "art", target="cuda", arch=arch)
    assert [o.pdl for o in seen] == [pdl]
    _build("llama.yaml", tmp_path / "cpu", target="cpu", arch=arch)
    assert seen[-1].pdl is False


@pytest.mark.parametrize("max_seq_len, noted", [(512, False), (513, True)])
def test_a_max_seq_len_past_max_position_embeddings_is_noted(max_seq_len, noted, tmp_path):
    """The tiny config's max_position_embeddings is 512: a KV cache of exactly that many rows is within what the
    model was trained on, one row more is noted."""
    lines = []
    mxc.build("llama.yaml", out=tmp_path / "art", max_seq_len=max_seq_len, progress=False, log=lines.append)
    assert any(f"--max-seq-len {max_seq_len} is above" in ln for ln in lines) is noted, lines


def test_a_stale_old_directory_of_this_pid_is_replaced(tmp_path):
    import os

    art = _build("llama.yaml", tmp_path / "art")
    stale = tmp_path / f".art.old-{os.getpid()}"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    assert _build("llama.yaml", art, max_seq_len=64) == art
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
