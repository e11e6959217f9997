"""What a build's command line names: the model file, its config.json and the checkpoint.

``resolve_source`` turns ``mxc build SOURCE [--checkpoint DIR | --config FILE]`` into a ``Source``: a bundled
definition (by name or by its path), a user's own YAML, or a checkpoint directory (or a Hub model id's snapshot in
the local Hugging Face cache, ``hub_snapshot``) whose config.json picks the definition through the registry; with no
checkpoint, the definition's tiny config or ``--config`` with random
weights. Bad paths and unreadable configs are one-line errors naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mxc.errors import MxcError
from mxc.ir.template import read_model_file
from mxc.loaders.files import read_json
from mxc.models import MODELS_DIR, Entry, architecture_of, lookup


@dataclass(frozen=True)
class Source:
    model_file: Path
    config: dict
    config_path: str
    checkpoint: Path | None
    entry: Entry | None


def _read_config(path: Path, what: str = "a config.json", missing: str | None = None) -> dict:
    if missing is None:
        missing = ("a checkpoint directory needs its config.json" if path.name == "config.json"
                   else "check the --config path")
    config = read_json(path, what, missing)
    if not isinstance(config, dict):
        raise MxcError(f"{path}: expected a JSON object")
    return config


def _is_bundled(src: Path) -> bool:
    """A bundled definition: its bare name (``llama.yaml``), or a path to the file itself (``mxc/models/llama.yaml``
    in a checkout), which takes the registry's settings for the checkpoint's architecture as the name does."""
    if src.exists():
        return src.is_file() and src.resolve().parent == MODELS_DIR.resolve()
    return src.name == str(src) and (MODELS_DIR / src.with_suffix(".yaml").name).exists()


_WEIGHT_NAMES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin")  # or any *.safetensors: what loaders.checkpoint.open_checkpoint looks for
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # a Hub model id: owner/name


def hub_snapshot(name: str) -> Path | None:
    """The local Hugging Face cache's snapshot of model ``name`` (an ``owner/name`` id; the revision ``main``
    points at), where it was downloaded (``hf download``, transformers' ``from_pretrained``), else None. mxc does
    not download: the cache is read as it is (``HF_HUB_CACHE`` or ``HF_HOME`` say where, as for transformers). A
    snapshot of config.json without weights is a one-line error saying to download the rest."""
    if not _REPO_ID.fullmatch(name):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(name, local_files_only=True, cache_dir=_hub_cache()))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None
    if not (path / "config.json").is_file():
        return None
    if not any(os.path.lexists(path / f) for f in _WEIGHT_NAMES) and not any(path.glob("*.safetensors")):
        # transformers' AutoConfig or AutoTokenizer caches config.json and the tokenizer alone
        raise MxcError(f"{name}: the Hugging Face cache's snapshot of it ({path}) holds no weights, only config.json "
                       f"and the like; download the rest: hf download {name}")
    return path


def _hub_cache() -> str:
    """The Hub cache's folder as huggingface_hub (and so transformers) finds it: ``HF_HUB_CACHE``, the legacy
    ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``/hub, ``XDG_CACHE_HOME``/huggingface/hub or ~/.cache/huggingface/hub, with
    ``~`` and ``$VAR`` expanded; read from the environment now, not as it was when huggingface_hub was imported."""
    env = os.environ.get
    expand = lambda p: os.path.expandvars(os.path.expanduser(p))  # noqa: E731
    home = expand(env("HF_HOME", os.path.join(env("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                                              "huggingface")))
    return expand(env("HF_HUB_CACHE", env("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))))


def checkpoint_name(path: Path) -> str:
    """How the manifest names a checkpoint: its folder's name (not its path: an artifact that is shipped tells
    neither where nor by whom it was built), or for a snapshot in the Hugging Face cache, its model id and commit."""
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return f"{path.parent.parent.name.removeprefix('models--').replace('--', '/')}@{path.name}"
    return path.name


def _download_hint(name: str, flag: str = "") -> str:
    """For a name that looks like a Hub model id: how to get the checkpoint mxc builds from (it does not download);
    ``flag``: the option that named it (``--checkpoint ``), which the local copy then takes."""
    if not _REPO_ID.fullmatch(name) or Path(name).suffix.lower() in (".yaml", ".yml", ".json"):
        return ""  # a definition's or a config's path, mistyped
    local = name.rsplit("/", 1)[1]
    use = f"pass {flag}{local}" if flag else f"mxc build {local}"
    return (f"; to build the Hugging Face Hub model {name}, download it first (hf download {name}, which mxc then "
            f"finds in the cache, or hf download {name} --local-dir {local} and {use})")


def resolve_source(source: str, checkpoint: str | None, config: str | None = None) -> Source:
    """Work out the model file, config and checkpoint from the command line.

    ``config`` (a config.json path, no checkpoint) builds that configuration
    with deterministic random weights: benchmarks at real shapes without a download.
    """
    if config is not None and checkpoint is not None:
        raise MxcError("--config is for random weights; a --checkpoint brings its own config.json")
    src = Path(source)
    if not src.exists() and not _is_bundled(src) and (cached := hub_snapshot(source)) is not None:
        src = cached  # a Hugging Face Hub model id, downloaded into the local cache
    if checkpoint is not None and not Path(checkpoint).exists() and (cached := hub_snapshot(checkpoint)) is not None:
        checkpoint = str(cached)
    if src.is_dir():
        if checkpoint is not None:
            raise MxcError(f"{source} is a checkpoint directory; do not also pass --checkpoint")
        if config is not None:  # it was left unread: the checkpoint's own config.json was built
            raise MxcError(f"--config is for random weights; {source} is a checkpoint directory, which brings its own "
                           f"config.json (build a config with random weights: mxc build llama.yaml --config FILE)")
        checkpoint, src = str(src), None
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and not ckpt.is_dir():
        raise MxcError(f"--checkpoint {checkpoint}: not a directory{_download_hint(checkpoint, '--checkpoint ')}")

    bundled = src is not None and _is_bundled(src)
    if src is not None and not src.exists() and not bundled:
        from mxc.models import model_files
        raise MxcError(f"{source}: no such file, and not a bundled definition ({', '.join(model_files())})"
                       f"{_download_hint(source)}")
    if src is not None and src.is_file() and src.suffix.lower() == ".json":  # model definitions are YAML
        what = "a config.json" if src.name == "config.json" else "a JSON file"
        raise MxcError(f"{source}: {what}, not a model definition; pass its folder (mxc build {src.parent}) or use "
                       f"--config")

    if ckpt is not None:
        config_path = ckpt / "config.json"
        config = _read_config(config_path)
        arch = architecture_of(config, str(config_path))
        if src is None or bundled:
            entry = lookup(arch, str(config_path))
            if bundled and entry.model != src.with_suffix(".yaml").name:
                raise MxcError(f"{config_path}: architecture {arch} is served by {entry.model}, not {src.name}")
            return Source(entry.path, config, str(config_path), ckpt, entry)
        return Source(src, config, str(config_path), ckpt, None)  # a user's own definition: no registry settings

    model_file = MODELS_DIR / src.with_suffix(".yaml").name if bundled else src
    if config is not None:
        config_path = Path(config)
    else:
        tiny = read_model_file(model_file).get("tiny_config")
        if tiny is None:
            raise MxcError(f"{model_file}: no --checkpoint given and the definition names no tiny_config")
        config_path = model_file.parent / str(tiny)
        if not config_path.exists():
            raise MxcError(f"{model_file}: tiny_config {tiny} not found (relative to {model_file.name}'s folder); "
                           f"pass --checkpoint or --config")
    config = _read_config(config_path)
    entry = lookup(architecture_of(config, str(config_path)), str(config_path)) if bundled else None
    return Source(model_file, config, str(config_path), None, entry)


def _as_list(eos) -> list:
    return list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])


def eos_ids(src: Source) -> list:
    """The end-of-sequence ids, in order: the checkpoint's generation_config.json's eos_token_id where it names
    some, as transformers' generate reads that file's alone (an id only config.json names does not stop it, and the
    first pads the rows that stopped), else config.json's (one id, a list or absent): transformers' too where the
    checkpoint has no generation_config.json (with one that names none, its generate would not stop at all)."""
    return _as_list(_generation_config(src).get("eos_token_id")) or _as_list(src.config.get("eos_token_id"))


def pad_id(src: Source) -> int | None:
    """The id that fills a row after its end-of-sequence token, as transformers' generate pads: generation_config.json's
    pad_token_id where the checkpoint has that file, else config.json's; None where that is unset (the runtime then
    pads with the first eos id, as transformers does) or not a token id (transformers would write it into the ids;
    some configs say -1)."""
    has_file = src.checkpoint is not None and os.path.lexists(src.checkpoint / "generation_config.json")
    pad = (_generation_config(src) if has_file else src.config).get("pad_token_id")
    vocab = src.config.get("vocab_size")
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0 or (isinstance(vocab, int) and pad >= vocab):
        return None
    return pad


def _generation_config(src: Source) -> dict:
    path = src.checkpoint / "generation_config.json" if src.checkpoint is not None else None
    if path is None or not os.path.lexists(path):  # optional; a broken symlink or a directory is named, not skipped
        return {}
    return _read_config(path, "a generation_config.json", "restore it, or remove it")


def check_eos(src: Source) -> None:
    """Each end-of-sequence id is a token id of the vocabulary, or a one-line error names the file that says it."""
    vocab = src.config.get("vocab_size")
    for where, config in ((src.config_path, src.config), (src.checkpoint and src.checkpoint / "generation_config.json",
                                                           _generation_config(src))):
        eos = config.get("eos_token_id")
        ok = all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (not isinstance(vocab, int) or t < vocab)
                 for t in _as_list(eos))
        if not ok:
            within = f" below vocab_size {vocab}" if isinstance(vocab, int) else ""
            raise MxcError(f"{where}: eos_token_id {eos!r}: expected a token id or a list of token ids{within}")
