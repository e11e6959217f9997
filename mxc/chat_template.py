"""The artifact's chat template, for ``mxc generate --prompt TEXT --chat``: which one it is, and the ids it renders.

A checkpoint keeps its chat template in ``chat_template.jinja`` (the build copies it into ``tokenizer/``), named
ones beside it in ``additional_chat_templates/NAME.jinja`` (a "tool_use" template, say; copied too), or, an older
one, as ``chat_template`` in tokenizer_config.json: a string, or a list of ``{"name", "template"}``.
``chat_templates`` gathers them by name as transformers' ``from_pretrained`` does: the .jinja file is "default" and
the folder's files add their names (a folder's ``default.jinja`` replaces it); where there is any such file,
tokenizer_config.json's field is not read; else its string is the one template, "default", and its list names
them. ``load_chat_template`` picks one as transformers' ``get_chat_template`` does: the one named (``--chat-template
NAME``), else "default", an error where there is none. ``chat_ids`` gives what transformers'
``tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` gives, with
jinja2 and no transformers (``mxc.tokenizer``): the template rendered in transformers' environment (a sandbox with
trim_blocks, lstrip_blocks and loop controls; its ``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``; ``{% generation %}`` blocks as what they hold), given ``messages``, ``tools=None``, ``documents=None``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), then encoded
without adding special tokens: the template writes them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mxc.errors import MxcError, first_line, typed_line
from mxc.loaders.files import read_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' CHAT_TEMPLATE_DIR: NAME.jinja, a template each
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES); a tokenizer_config.json's other *_token keys too
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
NO_TEMPLATE = ("--chat needs a chat template and the checkpoint it was built from had none (no chat_template.jinja, "
               f"{CHAT_TEMPLATE_DIR}/*.jinja or chat_template in tokenizer_config.json); use --prompt without --chat")


class _Raised(Exception):
    """A template's own ``raise_exception(message)``."""


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Dict:
    """The template's ``dict``: ``dict(...)`` and ``dict.fromkeys(...)``, not the type (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's ``namespace``, refusing ``_``-prefixed attributes as transformers' TemplateNamespace does."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (where transformers finds the assistant's tokens): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _template_line(e: Exception) -> str:
    """``line N: `` of the template where rendering failed (jinja puts the template's frames in the traceback)."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f"line {line}: "


class ChatTemplate:
    def __init__(self, text: str, where: str, special_tokens: dict[str, str]):
        self.where = where  # the file (and field) it came from, which the errors name
        self.special_tokens = special_tokens
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise MxcError(f"{where}: the chat template does not parse (line {e.lineno}: {first_line(e)}); "
                           f"use --prompt without --chat") from None

    def render(self, messages: list[dict]) -> str:
        """``messages`` followed by the assistant's header (``add_generation_prompt``), as text."""
        try:
            return self._template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                         **self.special_tokens)
        except _Raised:
            raise
        except Exception as e:  # noqa: BLE001  (a template can fail in any way a Python expression can)
            raise MxcError(f"{self.where}: the chat template does not render ({_template_line(e)}"
                           f"{typed_line(e)}); use --prompt without --chat") from None


def chat_ids(tokenizer, template: ChatTemplate, prompt: str, system: str | None = None) -> list[int]:
    """The ids of ``prompt`` as a user message (after ``system`` as a system message), rendered by ``template``
    with the assistant's header and encoded without adding special tokens: transformers'
    ``tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``. A template's own
    ``raise_exception`` is its message, naming --system where the template takes the prompt without it."""
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    try:
        text = template.render(messages)
    except _Raised as e:
        if system is not None:
            try:
                template.render(messages[1:])
            except (_Raised, MxcError):
                pass
            else:
                raise MxcError(f"--system: the chat template refuses a system message: {first_line(e)} "
                               f"({template.where}); drop --system") from None
        raise MxcError(f"{template.where}: the chat template refuses the prompt: {first_line(e)}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    """One of the artifact's tokenizer JSON files as a mapping ({} where the checkpoint had none)."""
    if not path.is_file():
        return {}
    data = read_json(path, path.name, "rebuild the artifact")
    if not isinstance(data, dict):
        raise MxcError(f"{path}: expected a JSON object; rebuild the artifact, or use --prompt without --chat")
    return data


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_dir: Path, config: dict) -> dict[str, str]:
    """The template's special-token variables, as transformers' ``tok.special_tokens_map``: tokenizer_config.json's
    ``*_token`` entries, special_tokens_map.json's over them where the config has no ``added_tokens_decoder`` (its
    legacy read), and a dict of ``extra_special_tokens``."""
    found = dict(config)
    if "added_tokens_decoder" not in config:
        found.update(_read_json(tokenizer_dir / "special_tokens_map.json"))
    extra = found.get("extra_special_tokens")
    named = {**{k: v for k, v in found.items() if k.endswith("_token")}, **(extra if isinstance(extra, dict) else {})}
    tokens = {name: _token(value) for name, value in named.items()}
    return {name: text for name, text in tokens.items() if text is not None}


def folder_templates(directory: Path) -> list[str]:
    """The files transformers reads as named chat templates in the tokenizer (or checkpoint) ``directory``, relative
    to it: ``additional_chat_templates/*.jinja`` (its glob, sorted), whatever each is (a folder, a broken symlink)."""
    folder = Path(directory) / CHAT_TEMPLATE_DIR
    try:
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".jinja")) if folder.is_dir() else []
    except OSError as e:
        raise MxcError(f"{folder}: cannot list it ({e.strerror})") from None
    return [f"{CHAT_TEMPLATE_DIR}/{name}" for name in names]


def _names(templates) -> str:
    return ", ".join(sorted(repr(name) for name in templates)) or "none"


def chat_templates(artifact: Path, files=(), config: dict | None = None) -> dict[str, tuple[str, Path | str]]:
    """The artifact's chat templates by name, each ``(where, source)``: ``where`` names it in errors, ``source`` is
    its file (a Path) or its text (from tokenizer_config.json; ``config``: that file as read already, else read
    here where needed). Empty where it has none; a file the manifest (``files``) lists and the artifact lost is a
    one-line error."""
    directory = Path(artifact) / "tokenizer"
    rels = [CHAT_TEMPLATE_FILE, *folder_templates(directory)]  # in this order: a folder's default.jinja wins
    rels += [f[len("tokenizer/"):] for f in files if f.startswith(f"tokenizer/{CHAT_TEMPLATE_DIR}/")
             and f[len("tokenizer/"):] not in rels]
    found = {}
    for rel in rels:
        path = directory / rel
        if path.is_file():
            name = "default" if rel == CHAT_TEMPLATE_FILE else rel[len(CHAT_TEMPLATE_DIR) + 1:].removesuffix(".jinja")
            found[name] = (str(path), path)
        elif f"tokenizer/{rel}" in files:
            raise MxcError(f"{artifact}: tokenizer/{rel} is missing; the artifact is incomplete, rebuild it")
    if found:  # transformers reads tokenizer_config.json's chat_template only where there is no template file
        return found
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path) if config is None else config
    template, where = config.get("chat_template"), f"{config_path}: chat_template"
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t.get("name"): (f'{where} "{t.get("name")}"', t.get("template")) for t in template
                if isinstance(t, dict)}
    return {} if template is None else {"default": (where, template)}


def load_chat_template(artifact: Path, files=(), name: str | None = None) -> ChatTemplate:
    """The artifact's chat template named ``name`` (``--chat-template``), else its "default", or a one-line error
    saying it has none, or none of that name (``files``: the manifest's, which tell a template the artifact lost
    from one the checkpoint never had)."""
    directory = Path(artifact) / "tokenizer"
    config = _read_json(directory / "tokenizer_config.json")
    templates = chat_templates(artifact, files, config)
    if not templates:
        raise MxcError(f"{artifact}: {NO_TEMPLATE}")
    if name is not None and name not in templates:
        raise MxcError(f"--chat-template {name!r}: {artifact} has no chat template of that name; give one of "
                       f"{_names(templates)}")
    if name is None and "default" not in templates:
        raise MxcError(f"{artifact}: its chat templates are {_names(templates)} and none is \"default\", the one "
                       f"--chat uses; pick one with --chat-template NAME")
    where, template = templates["default" if name is None else name]
    if isinstance(template, Path):
        try:
            template = template.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise MxcError(f"{where}: not UTF-8 text ({first_line(e)}); use --prompt without --chat") from None
        except OSError as e:  # unreadable (its permissions, an I/O error): as the tokenizer's JSON files say it
            raise MxcError(f"{where}: cannot read it ({e.strerror or first_line(e)}); rebuild the artifact, or use "
                           f"--prompt without --chat") from None
    elif not isinstance(template, str):
        raise MxcError(f"{where}: expected a template (a string), got {type(template).__name__}; use --prompt "
                       f"without --chat")
    return ChatTemplate(template, where, special_tokens(directory, config))
