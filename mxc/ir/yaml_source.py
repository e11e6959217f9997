"""YAML reading with source lines, for error messages that name file:line.

``load_yaml(path)`` parses with PyYAML's safe composer and returns plain
containers whose mappings, sequences and strings remember the line they came
from (``LDict.line``, ``LDict.key_line(k)``, ``LList.line``, ``LStr.line``).
``SourceError`` formats ``file:line: field: message``. Nothing here knows what
the YAML means.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mxc.errors import MxcError, first_line


class LStr(str):
    line: int = 0


class LList(list):
    line: int = 0


class LDict(dict):
    line: int = 0
    key_lines: dict

    def key_line(self, key) -> int:
        return getattr(self, "key_lines", {}).get(key, self.line)


class _DuplicateKey(ValueError):
    def __init__(self, line: int, key):
        super().__init__(f"duplicate key {key!r}")
        self.line = line


def _convert(node: yaml.Node, loader: yaml.SafeLoader):
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = LDict()
        out.line, out.key_lines = line, {}
        for k, v in node.value:
            key = _convert(k, loader)
            key = str(key) if isinstance(key, LStr) else key
            if key in out:
                raise _DuplicateKey(k.start_mark.line + 1, key)
            out[key] = _convert(v, loader)
            out.key_lines[key] = k.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        out = LList(_convert(v, loader) for v in node.value)
        out.line = line
        return out
    value = loader.construct_scalar(node)  # raw text
    resolved = loader.construct_object(node, deep=True)
    if isinstance(resolved, str):
        s = LStr(value)
        s.line = line
        return s
    return resolved


def load_yaml(path: Path | str, text: str | None = None):
    """Parse ``path`` (or ``text``, reported as ``path``) into line-aware containers."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text()
        except OSError as e:
            raise MxcError(f"{path}: cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise MxcError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise MxcError(f"{where}: malformed YAML: {e.problem}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow: a position, not a mark
        line = text.count("\n", 0, e.position) + 1
        raise MxcError(f"{path}:{line}: malformed YAML: unacceptable character #x{e.character:04x}") from None
    except yaml.YAMLError as e:
        raise MxcError(f"{path}: malformed YAML: {first_line(e)}") from None
    if node is None:
        raise MxcError(f"{path}: the file is empty")
    try:
        return _convert(node, yaml.SafeLoader(""))  # a loader a file: it keeps every scalar it constructed
    except _DuplicateKey as e:
        raise MxcError(f"{path}:{e.line}: {e}") from None


class SourceError:
    """Formats errors that point into one YAML file."""

    def __init__(self, path: Path | str):
        self.path = str(path)

    def __call__(self, line: int, field: str, message: str) -> MxcError:
        where = f"{self.path}:{line}" if line else self.path
        return MxcError(f"{where}: {field}: {message}")
