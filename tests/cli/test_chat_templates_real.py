"""The chat templates popular instruct checkpoints ship (tests/cli/chat_templates/, each source named in CASES),
rendered by mxc's ``--chat`` (``chat_ids``, no transformers) and by transformers'
``apply_chat_template(add_generation_prompt=True)``: the same text and the same ids, with and without a system
message, on prompts with unicode, newlines, surrounding spaces, special-token text and Jinja-looking text; a template
that refuses a system message refuses it in both, and mxc's one line names --system. The tokenizer is a tiny
byte-level BPE trained here with the template's tokens added as special tokens and the checkpoint's bos/eos/pad/unk
(the template is what is compared: both sides encode with the same tokenizer.json). strftime_now's date is patched
on both sides."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from mxc.chat_template import chat_ids, load_chat_template
from mxc.errors import MxcError
from mxc.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None}
MISTRAL_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."

# name (tests/cli/chat_templates/NAME.jinja), special tokens, other added tokens, tokenizer_config.json's special
# tokens, the template's refusal of a system message (None: it takes one)
CASES = [
    # meta-llama/Llama-3.2-3B-Instruct (strftime_now for "Today Date", tools, custom_tools, date_string):
    # llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja (ye-NX/llama.cpp@b354d7c9; also
    # ggerganov/llama.cpp@7b5e0803)
    pytest.param("llama3.2-instruct", LLAMA3, [], LLAMA3_CONFIG, None, id="llama3.2-instruct"),
    # meta-llama/Llama-3.3-70B-Instruct, the Llama 3.1 family's template (date_string defaulting to "26 Jul 2024",
    # builtin_tools, tools): llama.cpp models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja
    # (ye-NX/llama.cpp@b354d7c9)
    pytest.param("llama3.3-instruct", LLAMA3, [], LLAMA3_CONFIG, None, id="llama3.3-instruct"),
    # Qwen/Qwen2.5-*-Instruct (tokenizer_config.json's chat_template: a default system message, tools): two identical
    # verbatim copies in public code, a NixOS llama-cpp service's chatTemplate for Qwen2.5-Coder-7B-Instruct and a Rust
    # test constant "copied from the model's own tokenizer_config.json" for Qwen2.5-Instruct
    pytest.param("qwen2.5-instruct", CHATML, ["<tool_call>", "</tool_call>"], QWEN_CONFIG, None, id="qwen2.5-instruct"),
    # Qwen/Qwen3-0.6B (namespace, a reversed loop, str.startswith/endswith/split/strip, enable_thinking):
    # llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja (ye-NX/llama.cpp@b354d7c9)
    pytest.param("qwen3", CHATML, ["<tool_call>", "</tool_call>", "<think>", "</think>"], QWEN_CONFIG, None,
                 id="qwen3"),
    # google/gemma-2-2b-it (bos_token, raise_exception on a system message and on roles that do not alternate, trim):
    # llama.cpp models/templates/google-gemma-2-2b-it.jinja (ye-NX/llama.cpp@b354d7c9)
    pytest.param("gemma2-it", ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], [],
                 {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
                 "System role not supported", id="gemma2-it"),
    # mistralai/Mistral-7B-Instruct-v0.1 ([INST] as text, raise_exception when roles do not alternate, so on a system
    # message): the entry "// mistralai/Mistral-7B-Instruct-v0.1" of mistral.rs's chat template test table (the same
    # text as vLLM logs it as a default chat template)
    pytest.param("mistral-7b-instruct-v0.1", ["<unk>", "<s>", "</s>"], [], MISTRAL_CONFIG, ALTERNATE,
                 id="mistral-7b-instruct-v0.1"),
    # mistralai/Mistral-Nemo-Instruct-2407 (the system message folded into the last [INST], namespace, selectattr,
    # control tokens): llama.cpp models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja (ye-NX/llama.cpp@b354d7c9;
    # also ggerganov/llama.cpp@7b5e0803)
    pytest.param("mistral-nemo-instruct-2407",
                 ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"], [], MISTRAL_CONFIG, None,
                 id="mistral-nemo-instruct-2407"),
    # microsoft/Phi-3.5-mini-instruct (an empty system message dropped, eos_token without a generation prompt):
    # llama.cpp models/templates/microsoft-Phi-3.5-mini-instruct.jinja (ye-NX/llama.cpp@b354d7c9; also
    # ggerganov/llama.cpp@7b5e0803)
    pytest.param("phi3.5-mini-instruct", ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>",
                                          "<|system|>", "<|user|>"], [],
                 {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
                 None, id="phi3.5-mini-instruct"),
    # HuggingFaceH4/zephyr-7b-beta's and TinyLlama/TinyLlama-1.1B-Chat-v1.0's (newlines between the tags: trim_blocks
    # matters), as quoted identically in several public files, e.g. a Rust test's "ACTUAL template from the TinyLlama
    # GGUF header" and a C# alias table naming it "zephyr"
    pytest.param("zephyr", ["<unk>", "<s>", "</s>"], [], MISTRAL_CONFIG, None, id="zephyr"),
]
PROMPTS = ["hello world", "héllo wörld — 你好 🙂 naïve café", "line one\nline two\n\n  indented\t tab\r\nend",
           "{{ x }} {% if y %}z{% endif %} {# c #} {{- '<' }} {%- raw %}", "  padded  ",
           "<|im_end|> [INST] <start_of_turn> <|eot_id|> <s>"]
SYSTEMS = [pytest.param(None, id="no-system"), pytest.param("You are terse.", id="system"),
           pytest.param("Réponds en français.\n{{ system }} ✓", id="system-unicode-jinja"),
           pytest.param("", id="system-empty")]
TODAY = datetime.datetime(2025, 3, 7, 12, 0)


class _Today(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return TODAY


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    """strftime_now (Llama 3.2's "Today Date") reads the same clock on both sides."""
    import transformers.utils.chat_template_utils

    import mxc.chat_template

    monkeypatch.setattr(transformers.utils.chat_template_utils, "datetime", _Today)
    monkeypatch.setattr(mxc.chat_template, "datetime", _Today)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (artifact, transformers' tokenizer, mxc's tokenizer, mxc's template), built once per template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    base.train_from_iterator(["You are a helpful assistant. The user says hello world to the system."] * 8, trainer)
    built = {}

    def make(name, special, added, config):
        if name not in built:
            from transformers import AutoTokenizer

            art = tmp_path_factory.mktemp(name.replace(".", "_"))
            directory = art / "tokenizer"
            directory.mkdir()
            tok = Tokenizer.from_str(base.to_str())
            tok.add_special_tokens(special)
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
            tok.save(str(directory / "tokenizer.json"))
            (directory / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
            (directory / "chat_template.jinja").write_bytes((TEMPLATES / f"{name}.jinja").read_bytes())
            built[name] = (art, AutoTokenizer.from_pretrained(str(directory)), load_tokenizer(art),
                           load_chat_template(art))
        return built[name]

    return make


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("name, special, added, config, refusal", CASES)
def test_a_real_chat_template_gives_transformers_text_and_ids(name, special, added, config, refusal, system, made):
    from jinja2.exceptions import TemplateError

    art, hf, tokenizer, template = made(name, special, added, config)
    for prompt in PROMPTS:
        messages = [{"role": "system", "content": system}] * (system is not None) + \
            [{"role": "user", "content": prompt}]
        if refusal is not None and system is not None:
            with pytest.raises(TemplateError, match=re.escape(refusal)):
                hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            with pytest.raises(MxcError) as refused:
                chat_ids(tokenizer, template, prompt, system)
            assert str(refused.value) == (f"--system: the chat template refuses a system message: {refusal} "
                                          f"({art / 'tokenizer' / 'chat_template.jinja'}); drop --system")
            continue
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert template.render(messages) == text
        assert chat_ids(tokenizer, template, prompt, system) == want, text
        assert prompt.strip() in text and len(want) > len(hf(prompt.strip()).input_ids)  # the prompt, and a header


def test_llama_3_2_dates_its_system_header_with_strftime_now(made):
    """The date is strftime_now's (patched here: a template falling back to its fixed "26 Jul 2024" would differ)."""
    _, hf, tokenizer, template = made(*CASES[0].values[:4])
    text = template.render([{"role": "user", "content": "hello"}])
    assert "Cutting Knowledge Date: December 2023\nToday Date: 07 Mar 2025\n\n<|eot_id|>" in text
    assert chat_ids(tokenizer, template, "hello") == hf.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("text, rendered", [
    ("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ namespace(self=3).self }}", "2|3"),
    ("{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 2) | tojson }}", '{"a": 1}{"x": 2}'),
    ("{% set ns = namespace(_n=1) %}{{ ns._n }}", None),  # transformers' namespace refuses _-prefixed attributes
    ("{% set ns = namespace(n=1) %}{% set ns._m = 2 %}{{ ns.n }}", None),
])
def test_namespace_and_dict_are_transformers(text, rendered, made):
    """Qwen3's and Nemo's ``namespace`` (and ``dict``) are transformers' own: what it renders, and what it refuses."""
    from jinja2.exceptions import SecurityError

    from mxc.chat_template import ChatTemplate

    hf = made(*CASES[3].values[:4])[1]
    messages = [{"role": "user", "content": "hello"}]
    template = ChatTemplate(text, "chat_template.jinja", {})
    if rendered is None:
        try:  # transformers before its TemplateNamespace (5.17 has none) renders these; mxc refuses as 5.25 does
            hf.apply_chat_template(messages, chat_template=text, tokenize=False)
        except SecurityError as refused:
            assert "underscore-prefixed" in str(refused)
        with pytest.raises(MxcError, match=r"^chat_template\.jinja: the chat template does not render \(line 1: "
                                           r"SecurityError: Chat templates cannot store underscore-prefixed"):
            template.render(messages)
    else:
        assert template.render(messages) == hf.apply_chat_template(messages, chat_template=text, tokenize=False)
        assert template.render(messages) == rendered
