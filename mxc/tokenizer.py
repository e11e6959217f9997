"""The artifact's tokenizer, when the checkpoint carried one: shared by the build, which checks the checkpoint's
before it copies it, and the runtime, which reads the artifact's for ``--prompt``.

Reads ``tokenizer/tokenizer.json`` with the ``tokenizers`` library (no
transformers at run time). Returns ``None`` when the artifact has none, and
says why ``--prompt`` cannot run then (``missing_reason``). The build reads the
checkpoint's ``tokenizer.json`` the same way (``read_tokenizer``) before it
copies it, so an unreadable one is refused there, not at ``--prompt``.

tokenizer.json is taken as written, as the tokenizers library and transformers 4
read it. transformers 5 rebuilds the pipeline of some tokenizer classes over the
file's vocabulary (``LlamaTokenizer`` with ``legacy`` false or unset: no "▁"
after a special token in the text, so "<s>[INST]" encodes differently), a change
reported upstream as mangling some checkpoints (huggingface/transformers#48206);
mxc keeps the file's pipeline, the one the checkpoint shipped.
"""

from __future__ import annotations

from pathlib import Path

from mxc.errors import MxcError, first_line

UNREADABLE = ("tokenizer.model", "vocab.json", "merges.txt")  # tokenizer files the build copies, mxc cannot read


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        # A tokenizer.json saved after a truncating or padding call carries those settings: transformers' tokenizer
        # (``tok(text)``) turns them off, so the prompt is neither cut to max_length nor padded with pad tokens here
        self._tok.no_truncation()
        self._tok.no_padding()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, special tokens (a BOS) added as tokenizer.json's post-processor says unless
        ``add_special_tokens`` is false (a chat template writes its own): transformers' ``tok(text).input_ids``."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` without special tokens (the end-of-sequence token a --prompt stops at included):
        transformers' ``tok.decode(ids, skip_special_tokens=True)``."""
        return self._tok.decode(ids, skip_special_tokens=True)


def read_tokenizer(path: Path, fix: str) -> Tokenizer:
    """The tokenizer.json at ``path``, or a one-line error saying why it cannot be read, then ``fix``."""
    try:
        return Tokenizer(path)
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception on a bad file)
        raise MxcError(f"{path}: not a readable tokenizer ({first_line(e)}); "
                       f"{fix}") from None


def load_tokenizer(artifact: Path) -> Tokenizer | None:
    path = Path(artifact) / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        return None
    return read_tokenizer(path, "rebuild the artifact")  # the build read it: it changed since


def missing_reason(artifact: Path, files=()) -> str:
    """Why ``--prompt`` cannot run on ``artifact``, which has no tokenizer.json (what the build copied says; the
    manifest's ``files`` tell a build that had a tokenizer from one that had none)."""
    if "tokenizer/tokenizer.json" in files:
        return "tokenizer/tokenizer.json is missing; the artifact is incomplete, rebuild it"
    only = [f for f in UNREADABLE if (Path(artifact) / "tokenizer" / f).is_file()]
    if only:
        return f"--prompt needs tokenizer.json; the checkpoint had only {', '.join(only)}, which mxc cannot read"
    return "--prompt needs a tokenizer, and the checkpoint it was built from had none"
