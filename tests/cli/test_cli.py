"""The ``mxc`` command line: build / generate / inspect / models, one-line user errors, --prompt."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxc
from mxc.cli import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run(*args, exe=None):
    cmd = [exe] if exe else [sys.executable, "-m", "mxc"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=ENV, timeout=120)


def signed(manifest: dict) -> dict:
    """An edited manifest with its manifest_sha256 made to match: what the checks behind the digest see."""
    from mxc.artifact_format import manifest_digest

    return {**manifest, "manifest_sha256": manifest_digest(manifest)}


def _assert_user_error(code, err, pattern=""):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxc: error: "), err
    assert pattern in lines[0], lines[0]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return mxc.build("llama.yaml", out=tmp_path_factory.mktemp("cli") / "art", progress=False, log=lambda m: None)


def test_build_and_generate_subprocess(tmp_path):
    out = tmp_path / "art"
    r = _run("build", "llama.yaml", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert (out / "manifest.json").is_file()

    r = _run("generate", out, "--ids", "1,2,3", "--max-new-tokens", "5")
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
    r = _run("generate", tmp_path / "plain", "--ids", "1,2", exe=exe)
    _assert_user_error(r.returncode, r.stderr, "not an mxc artifact")
    assert r.stdout == ""


def test_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        line = next(ln for ln in out.splitlines() if ln.split()[0] == arch)
        assert "llama.yaml" in line and "not parity-tested" not in line


def test_inspect(artifact, capsys):
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
    manifest = json.loads((artifact / "manifest.json").read_text())
    for rel in manifest["files"]:
        assert rel in out
    assert manifest["ir_sha256"][:16] in out
    assert "TRUNCATED" not in out and "MISSING" not in out


def test_inspect_flags_damaged_weight_files(tmp_path, capsys):
    """A weight file cut short (a partial copy) or grown shows in the listing, from its header: no hashing."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    weights = art / "weights" / "rank0.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    assert main(["inspect", str(art)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "rank0.safetensors" in ln)
    assert "TRUNCATED" in line and "its header says" in line
    with open(weights, "ab") as f:
        f.write(b"\0" * 200)
    main(["inspect", str(art)])
    assert "OVERSIZED" in capsys.readouterr().out
    weights.write_bytes(b"not a safetensors file")
    main(["inspect", str(art)])
    assert "DAMAGED" in capsys.readouterr().out


def test_inspect_flags_a_damaged_kernel_index(tmp_path, capsys):
    """A cuda artifact's code/kernels/index.json that is damaged shows as DAMAGED, as a weight file does: no
    traceback (inspect reads the index whenever present, so a cpu artifact stands in for a cuda build here)."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    (art / "code" / "kernels").mkdir()
    for damaged in ("{damaged", "[1]", '{"k": {"source": "x"}}', '{"k": 1}', b'{"\xff": 1}'):
        index = art / "code" / "kernels" / "index.json"
        index.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        assert main(["inspect", str(art)]) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        line = next(ln for ln in captured.out.splitlines() if ln.startswith("compiled"))
        assert "code/kernels/index.json  DAMAGED" in line, line
        assert "files" in captured.out.splitlines()


def test_generate_in_process_matches_library(artifact, capsys):
    assert main(["generate", str(artifact), "--ids", "4,5,6", "--max-new-tokens", "6", "--temperature", "0.9",
                 "--top-k", "40", "--top-p", "0.95", "--seed", "11"]) == 0
    got = json.loads(capsys.readouterr().out)["ids"]
    want = mxc.load(artifact).generate([[4, 5, 6]], max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    assert got == want[0].tolist()


def _build_error(capsys, argv, pattern):
    """A user error from ``mxc build`` after its progress lines: the last line is the one-line error."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("mxc: error: ") and pattern in err.splitlines()[-1], err


def _error(capsys, argv, pattern):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    _assert_user_error(code, captured.err, pattern)
    assert captured.out == ""


def test_user_errors(artifact, hf_checkpoint, tmp_path, capsys):
    _error(capsys, ["build", tmp_path / "nosuch.yaml", "--out", tmp_path / "o1"], "nosuch.yaml: no such file")
    _error(capsys, ["generate", artifact, "--ids", "1,x"], "--ids '1,x': expected comma-separated integers")
    _error(capsys, ["generate", artifact, "--ids", ","], "--ids: give at least one token id")
    _error(capsys, ["generate", artifact, "--ids", "1,256"], "token id 256")
    _error(capsys, ["generate", artifact, "--ids", "1,-3"], "token id -3")
    _error(capsys, ["generate", artifact], "give exactly one of --ids or --prompt")
    _error(capsys, ["generate", artifact, "--ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1")
    (tmp_path / "plain").mkdir()
    _error(capsys, ["generate", tmp_path / "plain", "--ids", "1"], "not an mxc artifact")
    _error(capsys, ["inspect", tmp_path / "plain"], "not an mxc artifact")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "plain"], "exists and is not an mxc artifact")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o3", "--disable-pass", "shard_tp"],
           "--disable-pass shard_tp: it is required; passes that can be disabled: merge_qkv")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o3", "--disable-pass", "fuse_everything"],
           "--disable-pass fuse_everything: no such pass")

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # drop transformers' save progress bar
    _error(capsys, ["build", ckpt, "--out", tmp_path / "o2"], "'FooForCausalLM' is not supported")
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("field,value,pattern", [
    ("tie_word_embeddings", "no", "tie_word_embeddings = 'no': expected true or false"),
    ("rms_norm_eps", "abc", "rms_norm_eps = 'abc': expected a number"),  # its default, 1e-6, is a string to YAML
    ("hidden_act", "gelu", "hidden_act = 'gelu': llama.yaml supports 'silu' or 'swish' only"),
    ("num_key_value_heads", 3, "the model does not hold together with this config"),
    ("max_position_embeddings", "x", "max_position_embeddings 'x': expected a positive integer"),
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
    _build_error(capsys, ["build", ckpt, "--out", tmp_path / "o"], pattern)
    assert not (tmp_path / "o").exists()


def test_config_errors_name_the_file_given(tmp_path, capsys):
    """``--config FILE``: errors about its fields name FILE, not config.json."""
    config = json.loads((Path(mxc.__file__).parent / "models" / "configs" / "tiny-llama.json").read_text())
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "mine.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    _build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "cfgs" / "mine.json", "--out", tmp_path / "o"],
           "mine.json: field hidden_size = '64': expected an integer >= 1")
    (tmp_path / "cfgs" / "rope.json").write_text(json.dumps({**config, "rope_theta": -1.0}))
    _build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "cfgs" / "rope.json", "--out", tmp_path / "o"],
           "rope.json: rope_theta must be positive")
    _build_error(capsys, ["build", "llama.yaml", "--config", tmp_path / "nope.json", "--out", tmp_path / "o"],
                 "nope.json: not found; check the --config path")


def test_empty_out_is_refused_and_a_long_max_seq_len_noted(tmp_path, capsys):
    _build_error(capsys, ["build", "llama.yaml", "--out", ""], "--out '': give the artifact directory")
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
    _build_error(capsys, ["build", ckpt, "--out", tmp_path / "o"], f"{name} is stored as torch.int32")
    assert not (tmp_path / "o").exists()


def test_bad_paths_devices_sampling_and_manifests(artifact, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    _error(capsys, ["build", "llama.yaml", "--config", tmp_path], "cannot read it as a config.json")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "afile" / "sub"], "afile is not a directory")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--dump-ir", tmp_path / "afile"],
           "--dump-ir {}: exists and is not a directory".format(tmp_path / "afile"))
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--quant-lm-head"], "--quant-lm-head: applies to fp8")
    _error(capsys, ["build", "llama.yaml", "--out", tmp_path / "o", "--quant-granularity", "block128"],
           "--quant-granularity block128: applies to fp8 weights; add --quant fp8")
    _error(capsys, ["generate", artifact, "--ids", "1", "--temperature", "nan"], "temperature must be a finite number >= 0")
    _error(capsys, ["generate", artifact, "--ids", "1", "--temperature", "inf"], "temperature must be a finite number")
    _error(capsys, ["generate", artifact, "--ids", "1", "--device", "foo"], "--device foo: expected cpu, cuda")
    if not torch.cuda.is_available():
        _error(capsys, ["generate", artifact, "--ids", "1", "--device", "cuda"], "no CUDA GPU is usable here")
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
        _error(capsys, ["generate", edited, "--ids", "1"], pattern)
        _error(capsys, ["inspect", edited], pattern)


WORDS = ["[UNK]", "hello", "world"] + [f"w{i}" for i in range(197)]  # 200 words < vocab_size 256


def _save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def test_generate_with_prompt(artifact, hf_checkpoint, tmp_path, capsys):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    out = tmp_path / "art"
    assert main(["build", str(ckpt), "--out", str(out)]) == 0
    capsys.readouterr()
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert "tokenizer/tokenizer.json" in json.loads((out / "manifest.json").read_text())["files"]

    assert main(["generate", str(out), "--prompt", "hello world", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1, captured.out
    result = json.loads(lines[0])
    assert set(result) == {"ids", "text"}
    assert result["ids"] == mxc.load(out).generate([[1, 2]], max_new_tokens=4)[0].tolist()
    known = [WORDS[i] for i in result["ids"] if i < len(WORDS)]  # ids past the tokenizer's vocab decode to nothing
    assert result["text"].split() == known

    _error(capsys, ["generate", artifact, "--prompt", "hello world"], "--prompt needs a tokenizer")
    _error(capsys, ["generate", out, "--prompt", ""], "encodes to no tokens")
    (out / "tokenizer" / "tokenizer.json").write_text("{damaged")
    _error(capsys, ["generate", out, "--prompt", "hello world"], "tokenizer.json: not a readable tokenizer")


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
    r = _run("generate", out, "--ids", "1", "--top-k", "0")
    _assert_user_error(r.returncode, r.stderr, "top_k must be an integer >= 1, got 0")
    r = _run("generate", out, "--ids", "1", "--seed", "1" + "0" * 30, "--temperature", "1")
    _assert_user_error(r.returncode, r.stderr, "seed must be an integer in [-2**63, 2**64)")
    r = _run("generate", out, "--ids", "1", "--max-new-tokens", "1000000000")
    _assert_user_error(r.returncode, r.stderr, "exceeds what the artifact was built for (--max-seq-len 512)")
    r = _run("generate", out, "--ids", "1", "--seed", "1" + "0" * 30, "--temperature", "1")
    _assert_user_error(r.returncode, r.stderr, "seed must be an integer in [-2**63, 2**64)")
    if not torch.cuda.is_available():
        r = _run("generate", out, "--ids", "1", "--device", "cuda")
        _assert_user_error(r.returncode, r.stderr, "no CUDA GPU is usable here")
    with open(out / "weights" / "rank1.safetensors", "r+b") as f:
        f.truncate(1000)
    r = _run("generate", out, "--ids", "1")
    _assert_user_error(r.returncode, r.stderr, "weights/rank1.safetensors was modified since the build")
    assert r.stdout == ""


def test_inspect_heads_query_then_kv(tmp_path, capsys):
    """`mxc inspect` prints the heads as config.json names them: query heads / kv heads."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    c = json.loads((art / "manifest.json").read_text())["config"]
    assert c["num_attention_heads"] != c["num_key_value_heads"]  # GQA: the order shows
    assert main(["inspect", str(art)]) == 0
    assert f"heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv" in capsys.readouterr().out


def test_help_states_the_defaults_the_parser_has():
    """Every option whose --help names a default ("(default N)") has that default."""
    from mxc.cli import parser

    sub = next(a for a in parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    stated = [(name, a, m) for name, p in sub.choices.items() for a in p._actions
              if (m := re.search(r"\(default (\d+)\)", a.help or ""))]
    assert stated  # --max-batch's at least
    for name, action, m in stated:
        assert int(m.group(1)) == action.default, (name, action.dest)


def _inspect_copy(artifact, tmp_path, edit=None):
    """A copy of ``artifact`` (its manifest edited by ``edit``) and what `mxc inspect` prints for it."""
    art = tmp_path / "copy"
    shutil.copytree(artifact, art)
    if edit is not None:
        manifest = json.loads((art / "manifest.json").read_text())
        edit(manifest)
        (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    return art


def _inspect_lines(art, capsys):
    assert main(["inspect", str(art)]) == 0
    return capsys.readouterr().out.splitlines()


def test_inspect_sizes_in_binary_units():
    from mxc.inspect import _size

    assert _size(0) == "0 B" and _size(1023) == "1023 B"
    assert _size(1024) == "1.0 KB" and _size(1536) == "1.5 KB"
    assert _size(1024**2) == "1.0 MB" and _size(5 * 1024**3) == "5.0 GB"
    assert _size(2048 * 1024**3) == "2048.0 GB"  # GB is the largest unit


def test_inspect_kernel_choice_per_token_bucket():
    from mxc.inspect import _kernel

    assert _kernel("triton.rms_norm") == "triton.rms_norm"
    assert _kernel([[16, "gemv"], [None, "gemm"]]) == "gemv (<= 16 tokens) / gemm"


def test_inspect_of_a_healthy_cpu_artifact(artifact, capsys):
    """A fresh cpu build: no kernel index line, no flag on any file, each file's size in KB; the build line says
    quant none, the rope line its theta, the weights line where they came from."""
    lines = _inspect_lines(artifact, capsys)
    manifest = json.loads((artifact / "manifest.json").read_text())
    rope = manifest["config"]["rope"]
    assert not any(ln.startswith("compiled") or ln.startswith("cuda ") for ln in lines), lines
    assert f"rope         {rope['type']} (theta {rope['theta']})" in lines
    assert any(ln.startswith("build        target cpu,") and ln.endswith("quant none") for ln in lines), lines
    assert "weights      dummy" in lines
    for rel in manifest["files"]:
        size = (artifact / rel).stat().st_size
        assert 1024 <= size < 1024**2, rel  # in KB: the tiny model's files
        line = next(ln for ln in lines if ln.split()[0] == rel)
        assert line.split()[1:] == [f"{size / 1024:.1f}", "KB"], line


def test_inspect_reads_a_weight_file_with_metadata(artifact, tmp_path, capsys):
    """A safetensors header's __metadata__ entry is no tensor: a file that has one is read as whole, not DAMAGED."""
    from safetensors.torch import load_file, save_file

    art = _inspect_copy(artifact, tmp_path)
    weights = art / "weights" / "rank0.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt"})
    line = next(ln for ln in _inspect_lines(art, capsys) if "rank0.safetensors" in ln)
    assert line.split()[1:] == [f"{weights.stat().st_size / 1024:.1f}", "KB"], line

def test_inspect_marks_a_missing_file(artifact, tmp_path, capsys):
    art = _inspect_copy(artifact, tmp_path)
    (art / "graph.yaml").unlink()
    lines = _inspect_lines(art, capsys)
    assert next(ln for ln in lines if "graph.yaml" in ln).split() == ["graph.yaml", "MISSING"]


def test_inspect_names_the_checkpoint_the_weights_came_from(artifact, tmp_path, capsys):
    source = {"weights": "checkpoint", "checkpoint": "/ck/pt"}
    art = _inspect_copy(artifact, tmp_path, lambda m: m.update(source=source))
    assert "weights      checkpoint from /ck/pt" in _inspect_lines(art, capsys)


def test_inspect_shows_a_cuda_artifacts_runtime_options(artifact, tmp_path, capsys):
    """A --target cuda manifest (a cpu artifact relabelled: inspect reads only the manifest and the index): the KV
    cache size, the prefill graphs and PDL."""
    def cuda(**options):
        def edit(m):
            m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
            m["options"].update(target="cuda", max_batch=4, max_seq_len=256, **options)
        return edit

    art = _inspect_copy(artifact, tmp_path, cuda(prefill_graph_tokens=0, pdl=False))
    assert ("cuda         KV cache 4 x 256 tokens (decode graphs per batch bucket), prefill graphs off, PDL off"
            in _inspect_lines(art, capsys))
    shutil.rmtree(art)
    art = _inspect_copy(artifact, tmp_path, cuda(prefill_graph_tokens=64, pdl=True))
    assert ("cuda         KV cache 4 x 256 tokens (decode graphs per batch bucket), prefill graphs up to 64 tokens, "
            "PDL on" in _inspect_lines(art, capsys))


def test_inspect_lists_the_kernels_rendered_from_templates(artifact, tmp_path, capsys):
    """The kernel index: every cubin counted, the rendered sources listed by template name with sorted params."""
    art = _inspect_copy(artifact, tmp_path)
    (art / "code" / "kernels").mkdir()
    (art / "code" / "kernels" / "index.json").write_text(json.dumps({
        "k1": {"file": "k1.cubin"},
        "k2": {"file": "k2.cubin", "source": "src/zeta.py", "template": "zeta", "template_params": {"b": 2, "a": 1}},
        "k3": {"file": "k3.cubin", "source": "src/alpha.py", "template": "alpha", "template_params": {}},
    }))
    lines = _inspect_lines(art, capsys)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("compiled"))
    assert lines[at:at + 3] == ["compiled     3 cubins (2 kernel modules rendered from templates)",
                                "  alpha()  code/kernels/src/alpha.py",
                                "  zeta(a=1, b=2)  code/kernels/src/zeta.py"]


def test_inspect_flags_a_weight_file_whose_header_is_not_an_object(artifact, tmp_path, capsys):
    import struct

    art = _inspect_copy(artifact, tmp_path)
    (art / "weights" / "rank0.safetensors").write_bytes(struct.pack("<Q", 3) + b"[1]")
    line = next(ln for ln in _inspect_lines(art, capsys) if "rank0.safetensors" in ln)
    assert "DAMAGED (no readable safetensors header)" in line


def test_inspect_a_manifest_whose_kernel_is_null(artifact, tmp_path, capsys):
    art = _inspect_copy(artifact, tmp_path, lambda m: m["kernels"][0].update(kernel=None))
    mxc.load(art)  # the runtime accepts the manifest
    lines = _inspect_lines(art, capsys)
    assert any(ln.startswith("kernels ") for ln in lines)
    assert any("(none)" in ln for ln in lines)


def test_no_subcommand_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    _assert_user_error(exc.value.code, capsys.readouterr().err)


def test_help_exits_zero_and_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("build", "generate", "inspect", "models"))


def test_ids_and_prompt_together_are_refused(artifact, capsys):
    _error(capsys, ["generate", artifact, "--ids", "1", "--prompt", "hello"], "give exactly one of --ids or --prompt")


def test_generate_arguments_are_checked_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    """At --tp 2 the command checks the token ids (first bad one named, with the vocabulary's range) and the
    sampling arguments itself, before it starts any rank; ids 0 and vocab-1 are in range."""
    import mxc.runtime.ranks

    art = mxc.build("llama.yaml", out=tmp_path / "tp2", tp=2, progress=False, log=lambda m: None)
    vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
    started = []
    monkeypatch.setattr(mxc.runtime.ranks, "run_ranks", lambda fn, tp, device, args, ids: started.append(ids))
    _error(capsys, ["generate", art, "--ids", f"1,{vocab},-1"], f"token id {vocab} is outside the vocabulary "
                                                                 f"(0..{vocab - 1})")
    _error(capsys, ["generate", art, "--ids", "-1"], "token id -1 is outside")
    _error(capsys, ["generate", art, "--ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1")
    _error(capsys, ["generate", art, "--ids", "1,2", "--max-new-tokens", "511"],
           "batch 1 x 513 tokens (2 prompt + 511 new) exceeds what the artifact was built for (--max-seq-len 512); "
           "ask for at most 510 new tokens, or rebuild with --max-seq-len 513")
    assert started == []
    assert main(["generate", str(art), "--ids", f"0,{vocab - 1}"]) == 0
    assert started == [[0, vocab - 1]]


def test_ids_print_no_text_and_do_not_stop_at_eos(hf_checkpoint, tmp_path, capsys):
    """--ids on an artifact that has a tokenizer: one JSON line of ids only, all --max-new-tokens of them, the
    end-of-sequence token included (only --prompt decodes and stops there)."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    greedy = mxc.load(art).generate([[1, 2]], max_new_tokens=6)[0].tolist()
    eos = greedy[0]
    assert any(t != eos for t in greedy[1:])  # an eos stop would change the output
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["runtime"]["eos_token_id"] = [eos]
    (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    assert main(["generate", str(art), "--ids", "1,2", "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ids": greedy}
    assert main(["generate", str(art), "--prompt", "hello world", "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] != greedy  # the contrast: --prompt stops at the eos


def test_generate_length_is_held_to_the_max_seq_len_built_for(artifact, capsys):
    """Prompt + --max-new-tokens beyond the artifact's --max-seq-len (512): one line with both counts and the
    limit, on the CPU too (a billion new tokens crashed allocating the KV cache; 2000 decoded past the limit)."""
    for n in (10**9, 2000):
        _error(capsys, ["generate", artifact, "--ids", "1", "--max-new-tokens", n],
               f"batch 1 x {n + 1} tokens (1 prompt + {n} new) exceeds what the artifact was built for "
               f"(--max-seq-len 512); ask for at most 511 new tokens, or rebuild with --max-seq-len {n + 1}")
    assert main(["generate", str(artifact), "--ids", "1,2", "--max-new-tokens", "510"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 510


@pytest.mark.parametrize("flag,value", [("--top-k", "5"), ("--top-p", "0.9"), ("--seed", "0")])
def test_sampling_flags_need_a_temperature(artifact, capsys, flag, value):
    """--top-k, --top-p and --seed shape sampling: greedy decoding (no --temperature, or 0) would ignore them."""
    _error(capsys, ["generate", artifact, "--ids", "1", flag, value],
           f"{flag} needs --temperature > 0 (greedy decoding does not sample)")
    _error(capsys, ["generate", artifact, "--ids", "1", flag, value, "--temperature", "0"],
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
            _error(capsys, ["generate", art, "--ids", "1", "--device", device],
                   f"{art}: built for --target cuda, and no CUDA GPU is usable here (torch.cuda.is_available() is "
                   f"false); run it on a machine with one, or rebuild with --target cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, --device cpu
    _error(capsys, ["generate", art, "--ids", "1"], f"{art}: built for --target cuda; run it with --device cuda "
                                                    f"(or rebuild with --target cpu)")


def test_prompt_on_a_sentencepiece_only_checkpoint_says_so(hf_checkpoint, tmp_path, capsys):
    """A checkpoint with tokenizer.model (sentencepiece) and no tokenizer.json: --prompt names what it had."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    (ckpt / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert (art / "tokenizer" / "tokenizer.model").is_file()
    capsys.readouterr()  # drop transformers' save progress bar
    _error(capsys, ["generate", art, "--prompt", "hello"], f"{art}: --prompt needs tokenizer.json; the checkpoint had "
                                                          f"only tokenizer.model, which mxc cannot read; use --ids")


def test_prompt_without_tokenizer_json_names_the_tokenizer_files_the_checkpoint_had(tmp_path):
    """A GPT-2 style checkpoint (vocab.json and merges.txt, no tokenizer.json) is named as such; none at all too."""
    from mxc.runtime.tokenizer import missing_reason

    (tmp_path / "tokenizer").mkdir()
    assert missing_reason(tmp_path) == "--prompt needs a tokenizer, and the checkpoint it was built from had none"
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "tokenizer" / name).write_text("{}")
    assert missing_reason(tmp_path) == ("--prompt needs tokenizer.json; the checkpoint had only vocab.json, "
                                        "merges.txt, which mxc cannot read")


def test_a_tokenizer_json_damaged_after_the_build_says_to_rebuild(tmp_path):
    """The build read the artifact's tokenizer.json: unreadable at --prompt, it changed since, and a rebuild helps."""
    from mxc.runtime.tokenizer import load_tokenizer

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "mod')
    with pytest.raises(mxc.MxcError, match=r"tokenizer\.json: not a readable tokenizer \(.+\); rebuild the artifact$"):
        load_tokenizer(tmp_path)


def test_an_unreadable_tokenizer_json_is_refused_at_build(hf_checkpoint, tmp_path, capsys):
    """A damaged tokenizer.json in the checkpoint stops the build (before its long work), naming the file: at
    --prompt it would say to rebuild, which cannot help."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    (ckpt / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text()[:40])
    capsys.readouterr()
    assert main(["build", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "compiling" not in err, err
    assert re.fullmatch(rf"mxc: error: {re.escape(str(ckpt / 'tokenizer.json'))}: not a readable tokenizer \(.+\); "
                        r"replace it with a good copy, or remove it to build without a tokenizer \(then generate with "
                        r"--ids\)", err.splitlines()[-1]), err
    assert not (tmp_path / "o").exists()
    (ckpt / "tokenizer.json").unlink()
    assert main(["build", str(ckpt), "--out", str(tmp_path / "o")]) == 0


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
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
    _build_error(capsys, ["build", "llama.yaml", "--out", tmp_path / "b", "--tp-allreduce", "push"],
                 "--tp-allreduce push: the peer-memory all-reduce needs --target cuda")


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
