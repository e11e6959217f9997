"""Helpers of the build tests: a quiet build, one-line error checks, checkpoint and model-file edits."""

from __future__ import annotations

import json

import mxc

DROPPED = "model.layers.1.mlp.up_proj.weight"
ROPE_LINE = "      - q, k = rope(q, k, positions, spec=rope)\n"


def build(source, out, **kw):
    return mxc.build(str(source), out=out, progress=False, log=lambda m: None, **kw)


def edit_tensors(ckpt, edit):
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def build_edited(tmp_path, old: str, new: str, *more: tuple[str, str], **fields):
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
