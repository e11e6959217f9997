"""The artifact's tokenizer, when the checkpoint carried one.

Reads ``tokenizer/tokenizer.json`` with the ``tokenizers`` library (no
transformers at run time). Returns ``None`` when the artifact has none.
"""

from __future__ import annotations

from pathlib import Path

from mxc.errors import MxcError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(artifact: Path) -> Tokenizer | None:
    path = Path(artifact) / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(path)
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception on a bad file)
        raise MxcError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                       f"rebuild the artifact") from None
