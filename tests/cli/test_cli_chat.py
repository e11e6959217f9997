"""``mxc generate --prompt TEXT --chat [--chat-template NAME] [--system TEXT]``: the prompt rendered with the
artifact's chat template is the ids transformers' ``tok.apply_chat_template(messages, add_generation_prompt=True,
tokenize=True[, chat_template=NAME])`` gives, for a template in chat_template.jinja or additional_chat_templates/
(which the build copies), in tokenizer_config.json, or in its legacy list form; what the artifact or its template
lacks is said in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mxc
from mxc.cli import main
from tests.cli.helpers import ENV, user_error

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

# Qwen2.5's template (its tool-call branches cut): ChatML, a default system message where none is given
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3's template, which starts with bos_token, and a raise_exception of its own
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")

# Gemma's refusal of a system message
NO_SYSTEM = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot_id|>"
             "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant\n{% endif %}")

BOS = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
       "single_word": False, "special": True}  # as transformers saves a special token


# a template of another name (a checkpoint's additional_chat_templates/tool_use.jinja): other text around the messages
TOOL_USE = ("{{ bos_token }}<|start_header_id|>tools<|end_header_id|>\n\n[]<|eot_id|>{% for m in messages %}"
            "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _checkpoint(hf_checkpoint, config: dict, jinja: str | None = None, named: dict | None = None) -> Path:
    """A tiny checkpoint with a byte-level BPE tokenizer (trained here; the chat tokens special, as in Qwen's and
    Llama 3's), its tokenizer_config.json ``config``, given ``jinja``, a chat_template.jinja and, given ``named``,
    additional_chat_templates/NAME.jinja of each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ckpt, _ = hf_checkpoint("LlamaForCausalLM", vocab_size=320)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["You are a helpful assistant. The user says hello world to the system."] * 8, trainer)
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (ckpt / "chat_template.jinja").write_text(jinja)
    for name, text in (named or {}).items():
        (ckpt / "additional_chat_templates").mkdir(exist_ok=True)
        (ckpt / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return ckpt


def _build(ckpt: Path, out: Path) -> Path:
    return mxc.build(str(ckpt), out=out, progress=False, log=lambda m: None)


def _check_ids_match_transformers(ckpt: Path, art: Path, systems=(None, "You are terse."), name=None) -> list[int]:
    """mxc's ids for a --chat prompt (with the template ``name``: --chat-template), with and without a system
    message, are transformers' on the checkpoint."""
    from transformers import AutoTokenizer

    from mxc.chat_template import chat_ids, load_chat_template
    from mxc.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(str(ckpt))
    tokenizer, template = load_tokenizer(art), load_chat_template(art, name=name)
    for system in systems:
        messages = [{"role": "system", "content": system}] * (system is not None) + \
            [{"role": "user", "content": "hello world"}]
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                      chat_template=name)
        assert chat_ids(tokenizer, template, "hello world", system) == want, hf.decode(want)
        assert want != hf("hello world").input_ids
    return want


def test_a_qwen_style_chat_template_jinja_is_copied_and_rendered_as_transformers_does(hf_checkpoint, tmp_path):
    """chat_template.jinja goes to the artifact's tokenizer/, listed in the manifest (transformers loads it from
    there: a runtime importing the artifact has the template), and --chat renders it as apply_chat_template."""
    from transformers import AutoTokenizer

    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, jinja=QWEN)
    art = _build(ckpt, tmp_path / "art")
    copied = art / "tokenizer" / "chat_template.jinja"
    assert copied.read_text() == QWEN and not copied.is_symlink()
    assert "tokenizer/chat_template.jinja" in json.loads((art / "manifest.json").read_text())["files"]
    assert AutoTokenizer.from_pretrained(str(art / "tokenizer")).chat_template == QWEN
    ids = _check_ids_match_transformers(ckpt, art)
    assert ids[0] == SPECIAL.index("<|im_start|>")  # the template's special tokens are one id each


def test_a_llama3_style_template_in_tokenizer_config_uses_its_bos_token(hf_checkpoint, tmp_path):
    """A chat_template string in tokenizer_config.json, with bos_token saved as an AddedToken's dict."""
    ckpt = _checkpoint(hf_checkpoint, {"bos_token": BOS, "eos_token": "<|eot_id|>", "chat_template": LLAMA3})
    ids = _check_ids_match_transformers(ckpt, _build(ckpt, tmp_path / "art"))
    assert ids[0] == SPECIAL.index("<|begin_of_text|>")


def test_the_legacy_list_of_templates_uses_the_default_one_or_the_one_named(hf_checkpoint, tmp_path):
    templates = [{"name": "tool_use", "template": "{{ bos_token }}tools{{ messages[0]['content'] }}"},
                 {"name": "default", "template": LLAMA3}]
    ckpt = _checkpoint(hf_checkpoint, {"bos_token": "<|begin_of_text|>", "chat_template": templates})
    art = _build(ckpt, tmp_path / "art")
    ids = _check_ids_match_transformers(ckpt, art)
    assert ids[:2] == [SPECIAL.index("<|begin_of_text|>"), SPECIAL.index("<|start_header_id|>")]
    assert _check_ids_match_transformers(ckpt, art, systems=[None], name="tool_use") != ids


def _chat_argv(art: Path, *flags: str) -> list[str]:
    return ["generate", str(art), "--prompt", "hello world", "--chat", *flags, "--max-new-tokens", "2"]


def _cli_ids(art: Path, monkeypatch, *flags: str) -> list[int]:
    """The ids ``mxc generate ART --prompt "hello world" --chat FLAGS...`` generates from (the generation left out)."""
    import mxc.cli

    started = []
    monkeypatch.setattr(mxc.cli, "_generate_and_print", lambda rank, world, device, args, ids: started.append(ids))
    assert main(_chat_argv(art, *flags)) == 0
    [[ids]] = started
    return ids


def test_named_templates_are_copied_listed_and_picked_with_chat_template(hf_checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    """additional_chat_templates/tool_use.jinja (a symlink, as in a Hub cache snapshot) goes to the artifact's
    tokenizer/additional_chat_templates/ as a file, listed in the manifest and checked by its sha256 (transformers
    loads both templates from the artifact's tokenizer/); --chat-template tool_use renders it as
    apply_chat_template(..., chat_template="tool_use"), and without it the default is chat_template.jinja. What is
    not a template file there is left out; a name of neither template, and the lost file, are one line each."""
    import hashlib
    import os

    from transformers import AutoTokenizer

    from mxc.runtime.artifact import read_manifest, verify_files

    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>", "bos_token": "<|begin_of_text|>"}, jinja=QWEN)
    folder = ckpt / "additional_chat_templates"
    folder.mkdir()
    (tmp_path / "blob").write_text(TOOL_USE)
    os.symlink(tmp_path / "blob", folder / "tool_use.jinja")
    (folder / "README.md").write_text("not a template")  # neither transformers nor the build reads these
    (folder / "old.jinja").mkdir()
    os.mkfifo(folder / "pipe.jinja")
    art = _build(ckpt, tmp_path / "art")
    copied = art / "tokenizer" / "additional_chat_templates"
    assert sorted(p.name for p in copied.iterdir()) == ["tool_use.jinja"]
    assert (copied / "tool_use.jinja").read_text() == TOOL_USE and not (copied / "tool_use.jinja").is_symlink()
    files = read_manifest(art)["files"]
    assert files["tokenizer/additional_chat_templates/tool_use.jinja"] == hashlib.sha256(TOOL_USE.encode()).hexdigest()
    assert AutoTokenizer.from_pretrained(str(art / "tokenizer")).chat_template == {"default": QWEN,
                                                                                    "tool_use": TOOL_USE}
    verify_files(art, read_manifest(art))
    _check_ids_match_transformers(ckpt, art)
    _check_ids_match_transformers(ckpt, art, name="tool_use")
    default = _check_ids_match_transformers(ckpt, art, systems=[None])  # the ids of "hello world" alone
    tool_use = _check_ids_match_transformers(ckpt, art, systems=[None], name="tool_use")
    assert default[0] == SPECIAL.index("<|im_start|>") and tool_use[0] == SPECIAL.index("<|begin_of_text|>")
    assert _cli_ids(art, monkeypatch) == _cli_ids(art, monkeypatch, "--chat-template", "default") == default
    assert _cli_ids(art, monkeypatch, "--chat-template", "tool_use") == tool_use
    capsys.readouterr()
    user_error(capsys, _chat_argv(art, "--chat-template", "tools"),
               f"mxc: error: --chat-template 'tools': {art} has no chat template of that name; give one of "
               f"'default', 'tool_use'")
    (copied / "tool_use.jinja").write_text(TOOL_USE + " ")
    with pytest.raises(mxc.MxcError, match="tool_use.jinja was modified since the build"):
        verify_files(art, read_manifest(art))
    (copied / "tool_use.jinja").unlink()
    user_error(capsys, _chat_argv(art, "--chat-template", "tool_use"),
               f"mxc: error: {art}: tokenizer/additional_chat_templates/tool_use.jinja is missing; the artifact is "
               f"incomplete, rebuild it")


# (chat_template.jinja, additional_chat_templates/NAME.jinja, tokenizer_config.json's chat_template): the names
# transformers gives them and the default
LAYOUTS = [
    # the folder alone, tokenizer_config.json's template not read (there is a template file)
    pytest.param(None, {"default": LLAMA3, "tool_use": TOOL_USE}, QWEN, id="folder-with-default"),
    # the folder's default.jinja over chat_template.jinja
    pytest.param(QWEN, {"default": LLAMA3}, None, id="folder-default-over-jinja"),
    pytest.param(None, {"tool_use": TOOL_USE}, QWEN, id="folder-without-default"),
    pytest.param(None, None, [{"name": "tool_use", "template": TOOL_USE}], id="list-without-default"),
]


@pytest.mark.parametrize("jinja, named, field", LAYOUTS)
def test_the_templates_and_the_default_are_transformers(jinja, named, field, hf_checkpoint, tmp_path, capsys):
    """Which templates an artifact has, by name, and which is the default, are transformers' for the checkpoint:
    each named one renders its ids; where there are templates and none is "default" (transformers raises), --chat
    without --chat-template is a one-line error naming them and the flag."""
    from transformers import AutoTokenizer

    from mxc.chat_template import chat_templates, load_chat_template

    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    ckpt = _checkpoint(hf_checkpoint, {**config, **({"chat_template": field} if field else {})}, jinja, named)
    art = _build(ckpt, tmp_path / "art")
    hf = AutoTokenizer.from_pretrained(str(ckpt)).chat_template
    if isinstance(hf, str):  # one template, "default" to mxc (transformers would render the name as a template)
        assert set(chat_templates(art)) == {"default"} and load_chat_template(art, name="default").where == \
            load_chat_template(art).where
        assert _check_ids_match_transformers(ckpt, art, systems=[None])[0] == SPECIAL.index("<|begin_of_text|>")
        return
    assert set(chat_templates(art)) == set(hf)
    for name in hf:
        _check_ids_match_transformers(ckpt, art, systems=[None], name=name)
    if "default" in hf:
        assert _check_ids_match_transformers(ckpt, art, systems=[None]) == \
            _check_ids_match_transformers(ckpt, art, systems=[None], name="default")
        return
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        AutoTokenizer.from_pretrained(str(ckpt)).get_chat_template()
    capsys.readouterr()
    user_error(capsys, _chat_argv(art),
               f"mxc: error: {art}: its chat templates are 'tool_use' and none is \"default\", the one --chat uses; "
               f"pick one with --chat-template NAME")


def test_a_broken_symlink_among_the_named_templates_is_refused_by_the_build(hf_checkpoint, tmp_path):
    import os

    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>"}, jinja=QWEN)
    (ckpt / "additional_chat_templates").mkdir()
    os.symlink(tmp_path / "gone", ckpt / "additional_chat_templates" / "tool_use.jinja")
    with pytest.raises(mxc.MxcError, match=r"additional_chat_templates/tool_use\.jinja: is a broken symlink; expected "
                                           r"the checkpoint's additional_chat_templates/tool_use\.jinja there"):
        _build(ckpt, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_generate_with_chat_prints_json_for_the_rendered_prompt(hf_checkpoint, tmp_path, monkeypatch):
    """End to end: --prompt X --chat --system S generates from apply_chat_template's ids and prints a JSON line,
    without importing transformers (the runtime does not)."""
    import mxc.cli
    from transformers import AutoTokenizer

    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>"}, jinja=QWEN)
    art = _build(ckpt, tmp_path / "art")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    want = AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=True, return_dict=False)
    argv = ["generate", str(art), "--prompt", "hello world", "--chat", "--system", "Be brief.", "--max-new-tokens", "3"]
    code = ("import json, sys; from mxc.cli import main; status = main(sys.argv[1:]); "
            "print(json.dumps([status, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')]))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=ENV, timeout=120)
    assert len(done.stdout.splitlines()) == 2, done.stdout + done.stderr
    line, status = done.stdout.splitlines()
    assert json.loads(status) == [0, []]
    result = json.loads(line)
    assert set(result) == {"ids", "text"}
    assert result["ids"] == mxc.load(art).generate([want], max_new_tokens=3)[0].tolist()
    started = []
    monkeypatch.setattr(mxc.cli, "_generate_and_print", lambda rank, world, device, args, ids: started.append(ids))
    assert main(argv) == 0
    assert started == [[want]]


def test_chat_on_an_artifact_without_a_template_says_so(hf_checkpoint, tmp_path, capsys):
    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>"})
    art = _build(ckpt, tmp_path / "art")
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat"],
               f"mxc: error: {art}: --chat needs a chat template and the checkpoint it was built from had none (no "
               f"chat_template.jinja, additional_chat_templates/*.jinja or chat_template in tokenizer_config.json); "
               f"use --prompt without --chat")
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat", "--chat-template", "tool_use"],
               "had none")


@pytest.mark.parametrize("text, error", [("{\"chat_template\": ", "not valid JSON (line 1: Expecting value)"),
                                         ("[]", "expected a JSON object; rebuild the artifact, or use --prompt "
                                                "without --chat")])
def test_an_unreadable_tokenizer_config_is_one_line(text, error, hf_checkpoint, tmp_path, capsys):
    ckpt = _checkpoint(hf_checkpoint, {"eos_token": "<|im_end|>"})
    art = _build(ckpt, tmp_path / "art")
    (art / "tokenizer" / "tokenizer_config.json").write_text(text)
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat"],
               f"mxc: error: {art / 'tokenizer' / 'tokenizer_config.json'}: {error}")


def test_a_template_file_that_cannot_be_read_is_one_line(hf_checkpoint, tmp_path, capsys, monkeypatch):
    """chat_template.jinja unreadable (its permissions, an I/O error): one line naming it, not a traceback."""
    ckpt = _checkpoint(hf_checkpoint, {"bos_token": "<|begin_of_text|>"}, jinja=LLAMA3)
    art = _build(ckpt, tmp_path / "art")
    read_text = Path.read_text

    def denied(self, *a, **k):
        if self.name == "chat_template.jinja":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat"],
               f"mxc: error: {art / 'tokenizer' / 'chat_template.jinja'}: cannot read it (Permission denied); "
               f"rebuild the artifact, or use --prompt without --chat")


def test_a_templates_raise_exception_is_its_message(hf_checkpoint, tmp_path, capsys):
    """A template that refuses a system message (Gemma's): --system is named; without it the prompt renders."""
    ckpt = _checkpoint(hf_checkpoint, {"bos_token": "<|begin_of_text|>"}, jinja=NO_SYSTEM)
    art = _build(ckpt, tmp_path / "art")
    _check_ids_match_transformers(ckpt, art, systems=[None])
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat", "--system", "Be brief."],
               "mxc: error: --system: the chat template refuses a system message: System role not supported "
               f"({art / 'tokenizer' / 'chat_template.jinja'}); drop --system")
    (art / "tokenizer" / "chat_template.jinja").write_text("{{ raise_exception('This model does not chat') }}")
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat"],
               f"mxc: error: {art / 'tokenizer' / 'chat_template.jinja'}: the chat template refuses the prompt: This "
               f"model does not chat")


@pytest.mark.parametrize("text, error", [
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "does not parse (line 2: unexpected '}')"),
    ("{{ bos_token }}\n{{ messages[0].content + 1 }}",
     "does not render (line 2: TypeError: can only concatenate str (not \"int\") to str)"),
])
def test_a_template_that_fails_names_its_file_and_the_jinja_error(text, error, hf_checkpoint, tmp_path, capsys):
    ckpt = _checkpoint(hf_checkpoint, {"bos_token": "<|begin_of_text|>"}, jinja=text)
    art = _build(ckpt, tmp_path / "art")
    capsys.readouterr()
    user_error(capsys, ["generate", art, "--prompt", "hello", "--chat"],
               f"mxc: error: {art / 'tokenizer' / 'chat_template.jinja'}: the chat template {error}; use --prompt "
               f"without --chat")


@pytest.mark.parametrize("flags, error", [
    (["--prompt", "hello", "--system", "Be brief."], "--system: the system message of a --chat prompt; add --chat"),
    (["--ids", "1,2", "--chat"], "--chat: renders --prompt text with the chat template; give --prompt, not --ids"),
    (["--ids", "1,2", "--chat", "--system", "x"], "--chat: renders --prompt text"),
    (["--ids", "1,2", "--system", "x"], "--system: renders --prompt text with the chat template; give --prompt"),
    (["--prompt", "hello", "--chat-template", "tool_use"],
     "--chat-template: picks the chat template a --chat prompt is rendered with; add --chat"),
    (["--ids", "1,2", "--chat-template", "tool_use"],
     "--chat-template: renders --prompt text with the chat template; give --prompt, not --ids"),
])
def test_chat_system_and_chat_template_need_prompt_and_chat(flags, error, artifact, capsys):
    user_error(capsys, ["generate", artifact, *flags], f"mxc: error: {error}")
