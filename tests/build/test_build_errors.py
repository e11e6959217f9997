"""Bad checkpoints and configs fail at build with a one-line MxcError naming the file, field or tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import mxc
from mxc.errors import MxcError
from tests.build.helpers import DROPPED, build, edit_config, edit_tensors, one_line


def test_unknown_architecture(ckpt, tmp_path):
    edit_config(ckpt, architectures=["FooForCausalLM"])
    with pytest.raises(MxcError, match="FooForCausalLM") as e:
        build(ckpt, tmp_path / "art")
    msg = one_line(e)
    assert "config.json" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_architectures_field_missing(ckpt, tmp_path):
    edit_config(ckpt, architectures=None)
    with pytest.raises(MxcError, match="architectures"):
        build(ckpt, tmp_path / "art")


def test_config_not_json(ckpt, tmp_path):
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(MxcError, match=r"config\.json: not valid JSON") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)


def test_config_not_utf8(ckpt, tmp_path):
    """A config.json (or a shard index) holding bytes that are not UTF-8: one line naming the file, no traceback."""
    (ckpt / "config.json").write_bytes(b'{"architectures": ["Llama\xffForCausalLM"]}')
    with pytest.raises(MxcError, match=r"config\.json: not UTF-8 text \(invalid start byte at byte 25\)") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)


def test_index_not_utf8(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff": 1}}')
    with pytest.raises(MxcError, match=r"model\.safetensors\.index\.json: not UTF-8 text") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_config_missing(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    with pytest.raises(MxcError, match=r"config\.json: not found"):
        build(ckpt, tmp_path / "art")


def test_missing_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.pop(DROPPED))
    with pytest.raises(MxcError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                        r"\(expected shape \[96, 64\]") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("edit", ["missing", "misshaped", "int32"])
def test_a_bad_checkpoint_is_refused_before_the_kernels_compile(edit, ckpt, tmp_path, monkeypatch):
    """What the checkpoint's headers say is checked before a cuda build's minutes of kernel compiling."""
    from mxc import builder

    def compile_kernels(*a, **kw):
        raise AssertionError("compiled the kernels before checking the checkpoint")

    monkeypatch.setattr(builder, "_compile_kernels", compile_kernels)
    change = {"missing": lambda t: t.pop(DROPPED), "misshaped": lambda t: t.update({DROPPED: t[DROPPED][:-1]}),
              "int32": lambda t: t.update({DROPPED: t[DROPPED].to(torch.int32)})}[edit]
    edit_tensors(ckpt, change)
    with pytest.raises(MxcError, match=r"missing tensor|has shape|stored as torch.int32") as e:
        build(ckpt, tmp_path / "art", target="cuda")
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_tensor_left_out_of_the_index(ckpt, tmp_path):
    """A tensor in a shard that a stale index does not list: the error says where it is and what to fix."""
    names = sorted(load_file(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names if n != DROPPED}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MxcError, match=rf"missing tensor '{DROPPED}' .*: it is in model-00001-of-00001\.safetensors, "
                                        r"but model\.safetensors\.index\.json does not list it") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)


def test_unexpected_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(MxcError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        build(ckpt, tmp_path / "art")


def test_ignored_tensor_is_accepted(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    mxc.load(build(ckpt, tmp_path / "art"))


def test_misshaped_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.__setitem__(DROPPED, torch.zeros(95, 64)))
    with pytest.raises(MxcError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[95, 64\], "
                                        r"expected \[96, 64\]"):
        build(ckpt, tmp_path / "art")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file") as e:
        build(ckpt, tmp_path / "art")
    assert str(path) in one_line(e)


def test_garbage_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(MxcError, match=r"model\.safetensors: not a valid safetensors file") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)


def test_no_weights_in_checkpoint(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(MxcError, match="no checkpoint found"):
        build(ckpt, tmp_path / "art")


def test_garbage_bin(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not a zip file at all" * 50)
    with pytest.raises(MxcError, match=r"pytorch_model\.bin: not a valid PyTorch checkpoint"):
        build(ckpt, tmp_path / "art")


def test_unknown_source_file(tmp_path):
    with pytest.raises(MxcError, match=r"nosuch\.yaml: no such file, and not a bundled definition \(llama\.yaml"):
        build(tmp_path / "nosuch.yaml", tmp_path / "art")
    with pytest.raises(MxcError, match=r"nosuch\.yaml: no such file"):
        build("nosuch.yaml", tmp_path / "art")


def test_checkpoint_not_a_directory(tmp_path):
    with pytest.raises(MxcError, match="--checkpoint .*: not a directory"):
        build("llama.yaml", tmp_path / "art", checkpoint=str(tmp_path / "missing"))


def test_bundled_definition_for_another_arch(ckpt, tmp_path, monkeypatch):
    """A bundled definition named with a checkpoint whose architecture another definition serves is refused, naming
    both. Only llama.yaml is bundled today, so the registry is made to send Llama to another file."""
    from dataclasses import replace

    from mxc import source

    real = source.lookup
    monkeypatch.setattr(source, "lookup", lambda arch, where="config.json": replace(real(arch, where), model="gpt.yaml"))
    with pytest.raises(MxcError, match=r"config\.json: architecture LlamaForCausalLM is served by gpt\.yaml, "
                                        r"not llama\.yaml") as e:
        build("llama.yaml", tmp_path / "art", checkpoint=str(ckpt))
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_unsupported_config_qwen2_sliding_window(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM", use_sliding_window=True)
    assert json.loads((ckpt / "config.json").read_text())["use_sliding_window"] is True
    with pytest.raises(MxcError, match=r"`use_sliding_window` is true, which is not supported for Qwen2ForCausalLM"):
        build(ckpt, tmp_path / "art")


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
    edit_tensors(ckpt, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(MxcError, match=f"{name} is stored as {dtype}") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("arch, name, value, dtype, needle", [
    ("LlamaForCausalLM", "model.layers.0.mlp.up_proj.weight", 1e38, "float16",
     r"holds values up to 1e\+38, past float16's largest 6\.55e\+04 \(weight layers\.0\.w_gate_up\); build with a "
     r"wider --dtype \(bfloat16 or float32\)"),
    ("LlamaForCausalLM", "model.norm.weight", float("nan"), "float32",
     r"holds NaN or infinite values \(weight norm_f\); the checkpoint is damaged"),
    ("LlamaForCausalLM", "model.layers.1.self_attn.k_proj.weight", float("inf"), "bfloat16", "holds NaN or infinite"),
    ("MixtralForCausalLM", "model.layers.0.block_sparse_moe.experts.1.w2.weight", 1e38, "float16",
     r"holds values up to 1e\+38, past float16's largest .* \(weight layers\.0\.we_down\)"),
])
def test_weights_that_are_not_finite_in_the_build_dtype_are_refused(hf_checkpoint, tmp_path, arch, name, value,
                                                                    dtype, needle):
    """A checkpoint value past the build dtype's range was cast to inf (generate then printed garbage ids); one that
    is NaN or infinite in the checkpoint itself is damaged. Either fails naming the checkpoint tensor, expert
    stacks (cast as they are stacked) included."""
    ckpt, _ = hf_checkpoint(arch, **({"num_local_experts": 4, "num_experts_per_tok": 2} if "Mixtral" in arch else {}))
    edit_tensors(ckpt, lambda t: t[name].view(-1).__setitem__(3, value))
    with pytest.raises(MxcError, match=rf"{re.escape(name)} {needle}") as e:
        build(ckpt, tmp_path / "art", dtype=dtype)
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_a_weight_that_is_not_finite_is_refused_before_fp8_quantization(ckpt, tmp_path):
    """--quant fp8 of an inf weight: its scale came out inf, its values NaN."""
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_tensors(ckpt, lambda t: t[name].view(-1).__setitem__(0, float("-inf")))
    with pytest.raises(MxcError, match=rf"{re.escape(name)} holds NaN or infinite values \(weight layers\.1\.wo\)"):
        build(ckpt, tmp_path / "art", quant="fp8")
    assert not (tmp_path / "art").exists()


def test_a_nan_copied_into_a_tied_lm_head_is_named_as_damage(hf_checkpoint, tmp_path):
    """A tied checkpoint storing lm_head.weight as an exact copy of an embedding that holds a NaN: the copy is the
    same tensor (not "differs ... make tie_word_embeddings false"), and the NaN is what the error names."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", tie_word_embeddings=True)

    def damage(t):
        t["model.embed_tokens.weight"][5, 3] = float("nan")
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    edit_tensors(ckpt, damage)
    with pytest.raises(MxcError, match=r"model\.embed_tokens\.weight holds NaN or infinite values \(weight embed\); "
                                       r"the checkpoint is damaged") as e:
        build(ckpt, tmp_path / "art")
    one_line(e)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("library", ["cutlass", "mlp_pair"])
@pytest.mark.parametrize("error", [OSError(), RuntimeError("nvcc failed\nsecond line")], ids=["empty", "lines"])
def test_a_kernel_library_that_fails_to_build_is_one_line(library, error, tmp_path, monkeypatch):
    """The CUTLASS fp8 GEMM and the fp8 MLP pair libraries are compiled at build where chosen; a failure is one line
    quoting the error's first line, or its type where it has no message (an OSError() had the build fail with an
    IndexError traceback), and the way around it."""
    from types import SimpleNamespace

    from mxc import builder
    from mxc.kernels import cutlass_fp8, mlp_pair_fp8
    from mxc.kernels.candidates import CUTLASS_KERNELS, MLP_PAIR_KERNEL

    def fail(*a, **k):
        raise error

    kernel = CUTLASS_KERNELS[0] if library == "cutlass" else MLP_PAIR_KERNEL
    graph = SimpleNamespace(nodes=lambda: [(SimpleNamespace(attrs={"kernel": kernel}), None)])
    if library == "cutlass":
        monkeypatch.setattr(cutlass_fp8, "build_library", fail)
        call, advice = lambda: builder._cutlass_library(graph, tmp_path, print), "MXC_CUTLASS_LIBRARY=none"
    else:
        monkeypatch.setattr(mlp_pair_fp8, "library", fail)
        options = SimpleNamespace(mlp_pair=True)
        call, advice = lambda: builder._mlp_pair_library(graph, options, tmp_path, print), "without --mlp-pair"
    with pytest.raises(MxcError) as e:
        call()
    msg = one_line(e)
    assert f"failed ({'OSError' if isinstance(error, OSError) else 'nvcc failed'}); " in msg and advice in msg
