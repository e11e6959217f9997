"""The ``mxc`` command line: build / generate / inspect / models, one-line user errors (--prompt: test_cli_prompt)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import mxc
from mxc.cli import main
from tests.cli.helpers import assert_user_error, build_error, run_mxc, signed, user_error

def test_build_and_generate_subprocess(tmp_path):
    out = tmp_path / "art"
    r = run_mxc("build", "llama.yaml", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert (out / "manifest.json").is_file()

    r = run_mxc("generate", out, "--ids", "1,2,3", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    result = json.loads(lines[0])
    assert list(result) == ["ids"]
    assert len(result["ids"]) == 5 and all(isinstance(t, int) for t in result["ids"])
    assert result["ids"] == mxc.load(out).generate([[1, 2, 3]], max_new_tokens=5)[0].tolist()


def test_user_error_from_console_script(tmp_path):
    exe = shutil.which("mxc", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the mxc console script is not installed next to this python")
    (tmp_path / "plain").mkdir()
    r = run_mxc("generate", tmp_path / "plain", "--ids", "1,2", exe=exe)
    assert_user_error(r.returncode, r.stderr, "not an mxc artifact")
    assert r.stdout == ""


def test_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        line = next(ln for ln in out.splitlines() if ln.split()[0] == arch)
        assert "llama.yaml" in line and "not parity-tested" not in line


def test_generate_in_process_matches_library(artifact, capsys):
    assert main(["generate", str(artifact), "--ids", "4,5,6", "--max-new-tokens", "6", "--temperature", "0.9",
                 "--top-k", "40", "--top-p", "0.95", "--seed", "11"]) == 0
    got = json.loads(capsys.readouterr().out)["ids"]
    want = mxc.load(artifact).generate([[4, 5, 6]], max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    assert got == want[0].tolist()


def test_user_errors(artifact, hf_checkpoint, tmp_path, capsys):
    user_error(capsys, ["build", tmp_path / "nosuch.yaml", "--out", tmp_path / "o1"], "nosuch.yaml: no such file")
    user_error(capsys, ["generate", artifact, "--ids", "1,x"], "--ids '1,x': item 2 'x' is not an integer; expected comma-separated integers")
    user_error(capsys, ["generate", artifact, "--ids", ","], "--ids ',': item 1 is empty")
    user_error(capsys, ["generate", artifact, "--ids", " "], "--ids: give at least one token id")
    user_error(capsys, ["generate", artifact, "--ids", "1,256"], "token id 256")
    user_error(capsys, ["generate", artifact, "--ids", "1,-3"], "token id -3")
    user_error(capsys, ["generate", artifact], "give exactly one of --ids or --prompt")
    user_error(capsys, ["generate", artifact, "--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1")
    (tmp_path / "plain").mkdir()
    user_error(capsys, ["generate", tmp_path / "plain", "--ids", "1"], "not an mxc artifact")
    user_error(capsys, ["inspect", tmp_path / "plain"], "not an mxc artifact")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "plain"], "exists and is not an mxc artifact")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o3", "--disable-pass", "shard_tp"],
           "--disable-pass shard_tp: it is required; passes that can be disabled: merge_qkv")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o3", "--disable-pass", "fuse_everything"],
           "--disable-pass fuse_everything: no such pass")

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # drop transformers' save progress bar
    user_error(capsys, ["build", ckpt, "--out", tmp_path / "o2"], "'FooForCausalLM' is not supported")
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("field,value,pattern", [
    ("tie_word_embeddings", "no", "tie_word_embeddings = 'no': expected true or false"),
    ("rms_norm_eps", "abc", "rms_norm_eps = 'abc': expected a number"),  # its default, 1e-6, is a string to YAML
    ("hidden_act", "gelu", "hidden_act = 'gelu': llama.yaml supports 'silu' or 'swish' only"),
    ("num_key_value_heads", 3, "config.json: num_attention_heads = 4, num_key_value_heads = 3: the query heads must "
                               "be a multiple of the kv heads"),  # llama.yaml's checks
    ("max_position_embeddings", "x", "max_position_embeddings 'x': expected an integer >= 2"),
    ("quantization_config", [1], "quantization_config must be a JSON object"),
    ("quantization_config", {"quant_method": "compressed-tensors", "config_groups": [1]}, "config_groups must map"),
    ("eos_token_id", "x", "eos_token_id 'x': expected a token id"),
    ("hidden_size", "64", "config.json: field hidden_size = '64': expected an integer >= 1"),
    ("num_key_value_heads", "2", "config.json: field num_key_value_heads = '2': expected an integer >= 1"),
    ("num_attention_heads", 0, "config.json: field num_attention_heads = 0: expected an integer >= 1"),
    ("hidden_size", 64.0, "field hidden_size = 64.0: expected an integer >= 1"),
    ("num_hidden_layers", -2, "field num_hidden_layers = -2: expected an integer >= 1"),
    ("vocab_size", True, "field vocab_size = True: expected an integer >= 1"),
])
def test_bad_config_fields(field, value, pattern, hf_checkpoint, tmp_path, capsys):
    """A config.json field of the wrong type or an inconsistent one: one line, nothing written."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    build_error(capsys, ["build", ckpt, "--out", tmp_path / "o"], pattern)
    assert not (tmp_path / "o").exists()


def test_config_errors_name_the_file_given(tmp_path, capsys):
    """``--config FILE``: errors about its fields name FILE, not config.json."""
    config = json.loads((Path(mxc.__file__).parent / "models" / "configs" / "tiny-llama.json").read_text())
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "mine.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "cfgs" / "mine.json", "--out", tmp_path / "o"],
           "mine.json: field hidden_size = '64': expected an integer >= 1")
    (tmp_path / "cfgs" / "rope.json").write_text(json.dumps({**config, "rope_theta": -1.0}))
    build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "cfgs" / "rope.json", "--out", tmp_path / "o"],
           "rope.json: rope_theta must be positive")
    build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "nope.json", "--out", tmp_path / "o"],
                 "nope.json: not found; check the --config path")


def test_a_graph_that_does_not_verify_names_the_statement(tmp_path, capsys):
    """A model file without the check that would have caught the config: the bound graph's verifier refuses it,
    one line naming the statement, nothing written."""
    models = Path(mxc.__file__).parent / "models"
    text = (models / "llama.yaml").read_text()
    start = text.index("\nchecks:") + 1
    (tmp_path / "nochecks.yaml").write_text(text[:start] + text[text.index("\n\n", start) + 2:])
    config = json.loads((models / "configs" / "tiny-llama.json").read_text())
    (tmp_path / "heads.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    build_error(capsys, ["build", tmp_path / "nochecks.yaml", "--config", tmp_path / "heads.json",
                         "--out", tmp_path / "o"], "the model does not hold together with this config: nochecks.yaml:")
    assert not (tmp_path / "o").exists()


def test_empty_out_is_refused_and_a_long_max_seq_len_noted(tmp_path, capsys):
    build_error(capsys, ["build", "llama.yaml", "--out", ""], "--out '': empty; give a path, or leave --out out for build/<definition>")
    lines = []
    mxc.build("llama.yaml", out=tmp_path / "a", max_seq_len=1000, progress=False, log=lines.append)
    assert any("--max-seq-len 1000 is above" in ln and "max_position_embeddings 512" in ln for ln in lines), lines


def test_integer_weights_are_refused(hf_checkpoint, tmp_path, capsys):
    """A weight stored as integers (a damaged or foreign checkpoint) is refused, not cast to the model dtype."""
    from safetensors.torch import load_file, save_file

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    [path] = list(ckpt.glob("*.safetensors"))
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    capsys.readouterr()
    build_error(capsys, ["build", ckpt, "--out", tmp_path / "o"], f"{name} is stored as torch.int32")
    assert not (tmp_path / "o").exists()


def test_bad_paths_devices_sampling_and_manifests(artifact, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    user_error(capsys, ["build", "llama.yaml", "--config", tmp_path], "cannot read it as a config.json")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "afile" / "sub"], "afile is not a directory")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--dump-ir", tmp_path / "afile"],
           "--dump-ir {}: exists and is not a directory".format(tmp_path / "afile"))
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--quant-lm-head"], "--quant-lm-head: applies to fp8")
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--quant-granularity", "block128"],
           "--quant-granularity block128: applies to fp8 weights; add --quant fp8")
    user_error(capsys, ["generate", artifact, "--ids", "1", "--temperature", "nan"], "temperature must be a finite number >= 0")
    user_error(capsys, ["generate", artifact, "--ids", "1", "--temperature", "inf"], "temperature must be a finite number")
    user_error(capsys, ["generate", artifact, "--ids", "1", "--device", "foo"], "--device foo: expected cpu, cuda")
    if not torch.cuda.is_available():
        user_error(capsys, ["generate", artifact, "--ids", "1", "--device", "cuda"], "no CUDA GPU is usable here")
    for edit, pattern in [(lambda m: m["runtime"].update(vocab_size="x"), "field runtime.vocab_size"),
                          (lambda m: m.pop("files"), "field files"), (lambda m: m.update(tp=0), "field tp"),
                          (lambda m: m.update(tp=2), "no weights/rank1.safetensors for tp=2"),
                          (lambda m: m.pop("runtime"), "field runtime"),
                          (lambda m: m.pop("target"), "field target"),
                          (lambda m: m["runtime"].update(dtype="float64"), "field runtime.dtype"),
                          (lambda m: m["runtime"].pop("kv_cache"), "field runtime.kv_cache"),
                          (lambda m: m["options"].pop("target"), "field options.target"),
                          (lambda m: m.pop("kernels"), "field kernels"),
                          (lambda m: m.pop("source"), "field source"),
                          (lambda m: m["runtime"].update(layers="x"), "field runtime.layers"),
                          (lambda m: m["runtime"]["layers"].update(prefix=5), "field runtime.layers"),
                          (lambda m: m["runtime"]["layers"].update(count=None), "field runtime.layers"),
                          (lambda m: m["config"].update(rope=None), "field config"),
                          (lambda m: m["kernels"][0].update(kernel={"a": 1}), "field kernels"),
                          (lambda m: m["kernels"][0].update(kernel=[1, 2]), "field kernels")]:
        edited = tmp_path / "edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(artifact, edited)
        manifest = json.loads((edited / "manifest.json").read_text())
        edit(manifest)
        (edited / "manifest.json").write_text(json.dumps(signed(manifest)))
        user_error(capsys, ["generate", edited, "--ids", "1"], pattern)
        user_error(capsys, ["inspect", edited], pattern)


def test_argparse_errors_are_one_line(capsys):
    from mxc.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["build", "--dtype", "float8", "llama.yaml"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mxc: error:") and "--dtype" in err[0]


def test_tensor_parallel_generate_user_errors(tmp_path):
    """``generate`` on a --tp 2 artifact starts one process a rank: bad arguments are refused before they start,
    and an error one rank meets (here rank 1's damaged weights) reaches the command as one line, exit 2."""
    out = tmp_path / "tp2"
    mxc.build("llama.yaml", out=out, tp=2, progress=False, log=lambda m: None)
    r = run_mxc("generate", out, "--ids", "1", "--top-k", "0")
    assert_user_error(r.returncode, r.stderr, "--top-k must be an integer >= 1, got 0")
    r = run_mxc("generate", out, "--ids", "1", "--seed", "1" + "0" * 30, "--temperature", "1")
    assert_user_error(r.returncode, r.stderr, "seed must be an integer in [-2**63, 2**64)")
    r = run_mxc("generate", out, "--ids", "1", "--max-new-tokens", "1000000000")
    assert_user_error(r.returncode, r.stderr, "exceeds what the artifact was built for (--max-seq-len 512)")
    r = run_mxc("generate", out, "--ids", "1", "--seed", "1" + "0" * 30, "--temperature", "1")
    assert_user_error(r.returncode, r.stderr, "seed must be an integer in [-2**63, 2**64)")
    if not torch.cuda.is_available():
        r = run_mxc("generate", out, "--ids", "1", "--device", "cuda")
        assert_user_error(r.returncode, r.stderr, "no CUDA GPU is usable here")
    with open(out / "weights" / "rank1.safetensors", "r+b") as f:
        f.truncate(1000)
    r = run_mxc("generate", out, "--ids", "1")
    assert_user_error(r.returncode, r.stderr, "weights/rank1.safetensors was modified since the build")
    assert r.stdout == ""


def test_help_states_the_defaults_the_parser_has():
    """Every option whose --help names a default ("(default N)") has that default."""
    from mxc.cli import parser

    sub = next(a for a in parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    stated = [(name, a, m) for name, p in sub.choices.items() for a in p._actions
              if (m := re.search(r"\(default (\d+)\)", a.help or ""))]
    assert stated  # --max-batch's at least
    for name, action, m in stated:
        assert int(m.group(1)) == action.default, (name, action.dest)


def test_no_subcommand_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert_user_error(exc.value.code, capsys.readouterr().err)


def test_help_exits_zero_and_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("build", "generate", "inspect", "models"))


def test_ids_and_prompt_together_are_refused(artifact, capsys):
    user_error(capsys, ["generate", artifact, "--ids", "1", "--prompt", "hello"], "give exactly one of --ids or --prompt")


def test_generate_arguments_are_checked_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    """At --tp 2 the command checks the token ids (first bad one named, with the vocabulary's range) and the
    sampling arguments itself, before it starts any rank; ids 0 and vocab-1 are in range."""
    import mxc.runtime.ranks

    art = mxc.build("llama.yaml", out=tmp_path / "tp2", tp=2, progress=False, log=lambda m: None)
    vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
    started = []
    monkeypatch.setattr(mxc.runtime.ranks, "run_ranks", lambda fn, tp, device, args, ids: started.append(ids))
    user_error(capsys, ["generate", art, "--ids", f"1,{vocab},-1"], f"token id {vocab} is outside the vocabulary "
                                                                 f"(0..{vocab - 1})")
    user_error(capsys, ["generate", art, "--ids", "-1"], "token id -1 is outside")
    user_error(capsys, ["generate", art, "--ids", "1", "--ids", f"2,{vocab}"],
               f"--ids '2,{vocab}': token id {vocab} is outside")  # of several prompts, the one named
    user_error(capsys, ["generate", art, "--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1")
    user_error(capsys, ["generate", art, "--ids", "1,2", "--max-new-tokens", "511"],
           "batch 1 x 513 tokens (2 prompt + 511 new) exceeds what the artifact was built for (--max-seq-len 512); "
           "ask for at most 510 new tokens, or rebuild with --max-seq-len 513")
    user_error(capsys, ["generate", art, "--ids", "1", "--ids", "2,3,4", "--max-new-tokens", "510"],
               "batch 2 x 513 tokens (3 prompt + 510 new) exceeds")  # the longest prompt counts
    assert started == []
    assert main(["generate", str(art), "--ids", f"0,{vocab - 1}"]) == 0
    assert main(["generate", str(art), "--ids", "5", "--ids", "6,7"]) == 0
    assert started == [[[0, vocab - 1]], [[5], [6, 7]]]


def test_generate_length_is_held_to_the_max_seq_len_built_for(artifact, capsys):
    """Prompt + --max-new-tokens beyond the artifact's --max-seq-len (512): one line with both counts and the
    limit, on the CPU too (a billion new tokens crashed allocating the KV cache; 2000 decoded past the limit)."""
    for n in (10**9, 2000):
        user_error(capsys, ["generate", artifact, "--ids", "1", "--max-new-tokens", n],
               f"batch 1 x {n + 1} tokens (1 prompt + {n} new) exceeds what the artifact was built for "
               f"(--max-seq-len 512); ask for at most 511 new tokens, or rebuild with --max-seq-len {n + 1}")
    assert main(["generate", str(artifact), "--ids", "1,2", "--max-new-tokens", "510"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 510


@pytest.mark.parametrize("flag,value", [("--top-k", "5"), ("--top-p", "0.9"), ("--seed", "0")])
def test_sampling_flags_need_a_temperature(artifact, capsys, flag, value):
    """--top-k, --top-p and --seed shape sampling: greedy decoding (no --temperature, or 0) would ignore them."""
    user_error(capsys, ["generate", artifact, "--ids", "1", flag, value],
           f"{flag} needs --temperature > 0 (greedy decoding does not sample)")
    user_error(capsys, ["generate", artifact, "--ids", "1", flag, value, "--temperature", "0"],
           f"{flag} needs --temperature")
    assert main(["generate", str(artifact), "--ids", "1", flag, value, "--temperature", "0.5"]) == 0


def test_a_cuda_artifact_on_the_cpu_says_which_flag(artifact, tmp_path, capsys, monkeypatch):
    """The command line's words (--device cuda), not the Python API's (device='cuda'); on a machine with no GPU it
    says so instead (--device cuda would not do either)."""
    import torch

    art = tmp_path / "cuda"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["target"].update(name="cuda", arch="sm_90")
    manifest["options"]["target"] = "cuda"
    (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    if not torch.cuda.is_available():
        for device in ("cpu", "cuda"):
            user_error(capsys, ["generate", art, "--ids", "1", "--device", device],
                   f"{art}: built for --target cuda, and no CUDA GPU is usable here (torch.cuda.is_available() is "
                   f"false); run it on a machine with one, or rebuild with --target cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, --device cpu
    user_error(capsys, ["generate", art, "--ids", "1", "--device", "cpu"],
               f"{art}: built for --target cuda; run it with --device cuda (or rebuild with --target cpu)")


@pytest.mark.parametrize("target, device", [("cuda", "cuda"), ("cpu", "cpu")])
def test_generate_runs_on_the_artifacts_target_by_default(target, device, artifact, tmp_path, monkeypatch):
    """``mxc generate ART`` with no --device runs a --target cuda artifact on the GPU (it was --device cpu, refused
    with a hint to pass --device cuda) and a cpu one on the CPU."""
    import torch

    from mxc import cli
    from mxc.runtime import artifact as runtime_artifact

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    if target == "cuda":
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["target"].update(name="cuda", arch="sm_90")
        manifest["options"]["target"] = "cuda"
        (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    checked, ran = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime_artifact, "check_generate_device", lambda name, m, p: checked.append(name))
    monkeypatch.setattr(cli, "_generate_and_print", lambda rank, world, name, args, ids: ran.append(name))
    assert cli.main(["generate", str(art), "--ids", "1"]) in (0, None)
    assert checked == ran == [device]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mxc {mxc.__version__}\n"
    assert main(["--version", "build"]) == 0  # as argparse's version action: before the subcommand is parsed
    assert capsys.readouterr().out == f"mxc {mxc.__version__}\n"


def test_generate_defaults_to_16_greedy_tokens(artifact, capsys):
    assert main(["generate", str(artifact), "--ids", "1,2,3"]) == 0
    got = json.loads(capsys.readouterr().out)["ids"]
    assert got == mxc.load(artifact).generate([[1, 2, 3]], max_new_tokens=16)[0].tolist()


def test_models_lists_every_registry_architecture_sorted_and_marks_the_aliases(capsys):
    from mxc.models import registry

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    archs = [ln.split()[0] for ln in lines]
    assert archs == sorted(registry())
    for ln in lines:
        alias = ln.split()[0] in ("AquilaForCausalLM", "XverseForCausalLM", "InternLMForCausalLM")
        assert ("not parity-tested" in ln) == alias, ln


def test_build_options_reach_the_build(tmp_path, capsys):
    assert main(["build", "llama.yaml", "--out", str(tmp_path / "a"), "--max-batch", "4", "--max-seq-len", "64"]) == 0
    options = json.loads((tmp_path / "a" / "manifest.json").read_text())["options"]
    assert (options["max_batch"], options["max_seq_len"]) == (4, 64)
    build_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "b", "--tp-allreduce", "push"],
                 "--tp-allreduce push: the peer-memory all-reduce needs --target cuda")


def test_build_progress_bars_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    """The weight conversion's (and kernel compiling's) progress bars go to a terminal; stderr into a log or a pipe
    gets the build's phase lines only (a bar's redraws there were one ever longer line of carriage returns)."""
    assert main(["build", "llama.yaml", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "converting weights" not in err and "\r" not in err
    assert err.splitlines()[-1] == f"mxc: wrote {tmp_path / 'a'}"

    import mxc.builder

    asked = []
    monkeypatch.setattr(mxc.builder, "build", lambda *a, **kw: asked.append(kw["progress"]))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["build", "llama.yaml", "--out", str(tmp_path / "b")]) == 0
    assert asked == [True]


def test_interrupt_exits_130_with_one_line(monkeypatch, capsys):
    import mxc.builder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(mxc.builder, "build", interrupted)
    assert main(["build", "llama.yaml"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["mxc: interrupted"]


def test_signal_handlers_are_restored_after_a_command(capsys):
    import signal

    def mine(signum, frame):
        pass
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        assert main(["models"]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_main_runs_outside_the_main_thread(capsys):
    """Signal handlers can only be set from the main thread: from another one main() runs without them."""
    import threading

    result = []
    t = threading.Thread(target=lambda: result.append(main(["models"])))
    t.start()
    t.join(60)
    assert result == [0]
    assert "LlamaForCausalLM" in capsys.readouterr().out


@pytest.mark.parametrize("ids, says", [
    ("1,,2", "item 2 is empty"), (",1", "item 1 is empty"), ("1,", "item 2 is empty"),
    ("+1", "item 1 '+1' is not an integer"), ("1_000", "item 1 '1_000' is not an integer"),
    ("\u0661,\u0662", "item 1 '\u0661' is not an integer"), ("1 2", "item 1 '1 2' is not an integer"),
])
def test_ids_are_plain_comma_separated_integers(artifact, capsys, ids, says):
    """Python's int() takes '+1', '1_000' and other scripts' digits, and empty items were skipped: none is a token
    id list a user meant."""
    user_error(capsys, ["generate", artifact, "--ids", ids],
               f"--ids {ids!r}: {says}; expected comma-separated integers like 1,2,3")


def test_ids_may_have_spaces_around_the_numbers(artifact, capsys):
    assert main(["generate", str(artifact), "--ids", " 1 , 2 ", "--max-new-tokens", "3"]) == 0
    spaced = capsys.readouterr().out
    assert main(["generate", str(artifact), "--ids", "1,2", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == spaced


@pytest.mark.parametrize("argv, says", [
    (["build", ""], "SOURCE '': empty; give a path (a bundled definition such as llama.yaml"),
    (["build", "llama.yaml", "--checkpoint", ""], "--checkpoint '': empty; give a path, or leave --checkpoint out for "
                                                  "deterministic random weights"),
    (["build", "llama.yaml", "--config", " "], "--config ' ': empty; give a path, or leave --config out"),
    (["build", "llama.yaml", "--dump-ir", ""], "--dump-ir '': empty; give a path, or leave --dump-ir out"),
])
def test_an_empty_path_is_refused_by_its_flag(argv, says, tmp_path, capsys, monkeypatch):
    """An unset shell variable ("--checkpoint $CKPT") was taken as no flag at all: a random-weights build."""
    monkeypatch.chdir(tmp_path)
    user_error(capsys, argv + ["--out", tmp_path / "art"], says)
    assert not (tmp_path / "art").exists() and not (tmp_path / "build").exists()


@pytest.mark.parametrize("argv, says", [
    (["--max-seq-len", "1"], "--max-seq-len 1: a sequence needs room for a prompt token and a new one; give at "
                             "least 2"),
    (["--target", "cuda", "--max-batch", "1000000000"],
     "--max-batch 1000000000 / --max-seq-len 512: the KV cache would hold 1000000001 x 512 rows a layer (the scratch "
     "slot included), past the 2147483647 the cuda kernels address; lower one"),
    (["--target", "cuda", "--max-batch", "1", "--max-seq-len", str(2**30)], "past the 2147483647"),
    (["--quant-granularity", "channel"], "--quant-granularity channel: applies to fp8 weights; add --quant fp8"),
    (["--quant", "fp8", "--mlp-pair"], "--mlp-pair: the fused MLP kernel is a cuda kernel (got --target cpu)"),
    (["--target", "cuda", "--jobs", "0"], "--jobs 0: expected a positive number of processes"),
])
def test_build_sizes_and_options_that_cannot_run_are_refused_at_once(argv, says, tmp_path, capsys):
    """A billion-sequence cuda build ran out of the host's memory listing its buckets; --max-seq-len 1 built an
    artifact no prompt fits; an option the build ignores (a given granularity without fp8, the cuda MLP kernel on
    the cpu target) is refused as --pdl on the cpu is."""
    user_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "art", *argv], says)
    assert not (tmp_path / "art").exists()


def test_a_closed_stdout_ends_the_command_quietly(artifact, capsys, monkeypatch):
    """`mxc models | head -1`: the reader went away. Exit as a command killed by SIGPIPE would (141), with no
    traceback, and nothing more from the interpreter's exit flush (stdout then points at /dev/null)."""
    for argv in (["models"], ["--version"], ["inspect", str(artifact)]):
        read, write = os.pipe()
        os.close(read)
        with os.fdopen(write, "w") as closed:
            monkeypatch.setattr(sys, "stdout", closed)
            assert main(argv) == 141
            print("after", file=closed, flush=True)  # /dev/null now: no BrokenPipeError
        assert capsys.readouterr().err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_stdout_is_a_one_line_error(artifact, capsys, monkeypatch):
    for argv in (["models"], ["--version"], ["inspect", str(artifact)]):
        with open("/dev/full", "w") as full:  # closing flushes what is left into /dev/null, as the exit would
            monkeypatch.setattr(sys, "stdout", full)
            code = main(argv)
        assert_user_error(code, capsys.readouterr().err,
                          "standard output: cannot write the result (No space left on device)")
