"""``load_yaml``: line-aware containers, and one-line errors that name the file (and line where there is one)."""

from __future__ import annotations

import pytest

from mxc.errors import MxcError
from mxc.ir.yaml_source import SourceError, load_yaml


def test_lines_of_mappings_keys_sequences_and_strings():
    data = load_yaml("m.yaml", "top:\n  seq:\n    - a\n    - 2\n  name:\n    x\n")
    top = data["top"]
    assert (data.line, top.line) == (1, 2)
    assert top.key_line("seq") == 2 and top["seq"].line == 3  # a key's line, not its block value's
    assert top.key_line("name") == 5 and top["name"].line == 6
    assert top["seq"][0] == "a" and top["seq"][0].line == 3 and top["seq"][1] == 2
    assert top.key_line("absent") == top.line  # a missing key points at its mapping
    assert all(type(k) is str for k in top)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_file_is_named(text):
    with pytest.raises(MxcError, match=r"^m\.yaml: the file is empty$"):
        load_yaml("m.yaml", text)


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(MxcError, match="nosuch.yaml: cannot read"):
        load_yaml(tmp_path / "nosuch.yaml")
    with pytest.raises(MxcError, match="cannot read"):
        load_yaml(tmp_path)  # a directory


def test_control_character_is_a_user_error_naming_the_file():
    """A character YAML does not allow (PyYAML's reader error, which has no mark): MxcError, no traceback."""
    with pytest.raises(MxcError, match=r"^m\.yaml:1: malformed YAML: unacceptable character #x0007$"):
        load_yaml("m.yaml", "family: llama\x07\n")


def test_control_character_error_is_one_line_with_the_line():
    with pytest.raises(MxcError) as exc:
        load_yaml("m.yaml", "family: llama\nparams: x\x07\n")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("m.yaml:2: ")



def test_source_error_names_file_line_and_field():
    err = SourceError("m.yaml")
    assert str(err(7, "params.x", "bad")) == "m.yaml:7: params.x: bad"
    assert str(err(0, "params.x", "bad")) == "m.yaml: params.x: bad"  # no line known: no ":0"
