"""``mxc generate --prompt``: the artifact's tokenizer encodes the prompt as transformers' ``tok(TEXT)`` does, the
new tokens are decoded without special tokens, and what the artifact lacks for it is said in one line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import mxc
from mxc.cli import main
from tests.cli.helpers import signed, user_error


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

    user_error(capsys, ["generate", artifact, "--prompt", "hello world"], "--prompt needs a tokenizer")
    user_error(capsys, ["generate", out, "--prompt", ""], "encodes to no tokens")
    (out / "tokenizer" / "tokenizer.json").write_text("{damaged")
    user_error(capsys, ["generate", out, "--prompt", "hello world"], "tokenizer.json: not a readable tokenizer")


def test_prompt_is_encoded_whole_whatever_truncation_or_padding_tokenizer_json_kept(hf_checkpoint, tmp_path, capsys,
                                                                                     monkeypatch):
    """A tokenizer.json saved after a truncating, padding call keeps those settings, which transformers' tok(TEXT)
    turns off: --prompt too (the prompt was cut to max_length, a short one padded with pad tokens)."""
    import mxc.cli
    from tokenizers import Tokenizer

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.enable_truncation(max_length=2)
    tok.enable_padding(pad_id=0, pad_token="[UNK]", length=6)
    tok.save(str(ckpt / "tokenizer.json"))
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    started = []
    monkeypatch.setattr(mxc.cli, "_generate_and_print", lambda rank, world, device, args, ids: started.append(ids))
    for prompt in ("hello world w1 w2", "hello"):
        assert main(["generate", str(art), "--prompt", prompt]) == 0
    assert started == [[[1, 2, 4, 5]], [[1]]]


def test_text_leaves_out_special_tokens(hf_checkpoint, tmp_path, capsys):
    """"text" is the new tokens decoded without special tokens (transformers' tok.decode(new,
    skip_special_tokens=True)): the end-of-sequence token --prompt stops at is in "ids", not in "text"."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    words = [f"w{i}" for i in range(256)]
    art = mxc.build(str(ckpt), out=tmp_path / "plain", progress=False, log=lambda m: None)
    greedy = mxc.load(art).generate([[1, 2]], max_new_tokens=6)[0].tolist()
    eos = greedy[2]
    assert eos not in greedy[:2]
    words[eos] = "<eos>"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    capsys.readouterr()
    assert main(["generate", str(art), "--prompt", "w1 w2", "--max-new-tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {"ids": greedy[:3], "text": " ".join(words[t] for t in greedy[:2])}


def test_a_prompt_of_bytes_that_are_not_text_is_one_line(hf_checkpoint, tmp_path, capsys):
    """A Latin-1 é in a UTF-8 locale's command line reaches Python as a lone surrogate ("caf\\udce9"), which the
    tokenizer refused with a traceback (TypeError: TextInputSequence must be str)."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    capsys.readouterr()  # drop transformers' save progress bar
    enc = sys.getfilesystemencoding()
    user_error(capsys, ["generate", art, "--prompt", "caf\udce9"],
               f"--prompt: byte 0xe9 at character 4 is not {enc} text; give the prompt in {enc} (e.g. iconv -t {enc})")


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


def test_several_prompts_print_a_line_each_ending_at_their_own_eos(hf_checkpoint, tmp_path, capsys):
    """--prompt (or --ids) given more than once: the prompts, of different lengths, generated together, one JSON line
    each in order; with --prompt each line ends at its own end-of-sequence token (the padding after it, while
    another row runs on, is not printed)."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    prompts = [[1, 2, 4], [8]]  # "hello world w1", "w5"
    greedy = mxc.load(art).generate(prompts, max_new_tokens=8).tolist()
    assert main(["generate", str(art), "--ids", "1,2,4", "--ids", "8", "--max-new-tokens", "8"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"ids": row} for row in greedy]

    eos = greedy[1][1]
    ends = [row.index(eos) + 1 if eos in row else len(row) for row in greedy]
    assert ends[1] <= 2 < ends[0]  # row 1 stops first, row 0 runs on
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["runtime"]["eos_token_id"] = [eos]
    (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    assert main(["generate", str(art), "--prompt", "hello world w1", "--prompt", "w5", "--max-new-tokens", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["ids"] for line in lines] == [row[:end] for row, end in zip(greedy, ends)]
    assert lines[1]["text"].split() == [WORDS[i] for i in greedy[1][:ends[1]] if i < len(WORDS)]


def test_prompt_on_a_sentencepiece_only_checkpoint_says_so(hf_checkpoint, tmp_path, capsys):
    """A checkpoint with tokenizer.model (sentencepiece) and no tokenizer.json: --prompt names what it had."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    (ckpt / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")
    art = mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None)
    assert (art / "tokenizer" / "tokenizer.model").is_file()
    capsys.readouterr()  # drop transformers' save progress bar
    user_error(capsys, ["generate", art, "--prompt", "hello"],
               f"{art}: --prompt needs tokenizer.json; the checkpoint had only tokenizer.model, which mxc cannot read; "
               f"use --ids")


def test_prompt_without_tokenizer_json_names_the_tokenizer_files_the_checkpoint_had(tmp_path):
    """A GPT-2 style checkpoint (vocab.json and merges.txt, no tokenizer.json) is named as such; none at all too."""
    from mxc.tokenizer import missing_reason

    (tmp_path / "tokenizer").mkdir()
    assert missing_reason(tmp_path) == "--prompt needs a tokenizer, and the checkpoint it was built from had none"
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "tokenizer" / name).write_text("{}")
    assert missing_reason(tmp_path) == ("--prompt needs tokenizer.json; the checkpoint had only vocab.json, "
                                        "merges.txt, which mxc cannot read")


def test_a_tokenizer_json_damaged_after_the_build_says_to_rebuild(tmp_path):
    """The build read the artifact's tokenizer.json: unreadable at --prompt, it changed since, and a rebuild helps."""
    from mxc.tokenizer import load_tokenizer

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


def test_prompt_on_an_artifact_whose_tokenizer_went_missing_says_to_rebuild(hf_checkpoint, tmp_path, capsys):
    """The manifest lists tokenizer/tokenizer.json: the checkpoint had one, and the artifact lost it."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    _save_tokenizer(ckpt)
    art = tmp_path / "art"
    assert main(["build", str(ckpt), "--out", str(art)]) == 0
    (art / "tokenizer" / "tokenizer.json").unlink()
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello"],
               f"{art}: tokenizer/tokenizer.json is missing; the artifact is incomplete, rebuild it; use --ids")
