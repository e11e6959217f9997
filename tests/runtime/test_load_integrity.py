"""What ``mxc.load`` checks beyond the manifest: an artifact rebuilt in place while it loads, a weight file's tensor
names, dtypes and shapes against graph.yaml (with ``verify=False`` too), and an empty path."""

from __future__ import annotations

import json
import re

import pytest

import mxc
from mxc.errors import MxcError
from tests.runtime.helpers import refused


def _rebuild_during(monkeypatch, step: str, out, **build):
    """Make load's ``step`` (a function of mxc.runtime.artifact) rebuild the artifact at ``out`` in place (as
    ``mxc build --out`` does: the new directory swapped in by rename) before it runs."""
    from mxc.runtime import artifact

    original = getattr(artifact, step)

    def rebuilding(*args, **kwargs):
        monkeypatch.setattr(artifact, step, original)  # once
        mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None, **build)
        return original(*args, **kwargs)

    monkeypatch.setattr(artifact, step, rebuilding)


@pytest.mark.parametrize("step, verify", [("_exec_program", True), ("_load_weights", False), ("verify_files", True),
                                          ("verify_files", False)])
def test_an_artifact_rebuilt_while_it_loads_isrefused(tmp_path, monkeypatch, step, verify):
    """A rebuild landing between load's reads of the manifest, the program and the weights (here a float16 build
    swapped in for a float32 one) would pair one build's manifest or program with the other's weights, silently or
    in an error blaming a modified file: one line says what happened instead, and loading again gets the new
    build."""
    out = tmp_path / "art"
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    _rebuild_during(monkeypatch, step, out, dtype="float16")
    msg = refused(out, r"the artifact was rebuilt while it was being loaded; load it again$", verify=verify)
    assert msg.startswith(str(out))
    model = mxc.load(out)  # the float16 build, whole
    assert model.manifest["runtime"]["dtype"] == "float16" and model.logits([[1, 2]]).shape == (1, 2, 256)


def test_a_rebuild_of_the_same_build_while_it_loads_isrefused(tmp_path, monkeypatch):
    """The same manifest again, in another directory swapped in: the files read may come from either (a rebuild,
    then another, back to the first manifest, would pass a manifest-only check), so it is refused too."""
    out = tmp_path / "art"
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    _rebuild_during(monkeypatch, "_load_weights", out)
    refused(out, r"the artifact was rebuilt while it was being loaded; load it again$")


def _damage_weights_header(art, old: bytes, new: bytes):
    """Replace ``old`` with ``new`` (as long) in the first weight file's header: it still parses."""
    path = art / "weights" / "rank0.safetensors"
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1
    path.write_bytes(data.replace(old, new))


@pytest.mark.parametrize("old, new, pattern", [
    (b'"layers.0.ln1"', b'"layers.0.lnX"', r"has no tensor layers\.0\.ln1, which the program reads; the artifact is "
                                           r"damaged, rebuild it$"),
    (b'"norm_f"', b'"norm_g"', r"has no tensor norm_f, which the program reads"),
    (b'"norm_f":{"dtype":"F32"', b'"norm_f":{"dtype":"I32"', r"tensor norm_f is int32 \[64\], the program expects "
                                                             r"float32 \[64\]; the artifact is damaged, rebuild it$"),
])
def test_damaged_weight_names_and_dtypes_are_named_without_verify(art, old, new, pattern):
    """With verify=False (no hashes), a weight file whose header was damaged but still parses (a tensor renamed, or
    retyped, in as many bytes) is refused in one line naming the file and the tensor, where the program failed in a
    KeyError: 'ln1'. verify=True says the file was modified."""
    _damage_weights_header(art, old, new)
    msg = refused(art, pattern, verify=False)
    assert msg.startswith(str(art / "weights" / "rank0.safetensors"))
    refused(art, r"weights/rank0\.safetensors was modified since the build")


def test_an_unexpected_weight_is_named(art):
    """A tensor the program does not read (names checked both ways: the file is the build's, whole)."""
    from mxc.runtime import artifact

    expected = artifact._expected_weights(art, json.loads((art / "manifest.json").read_text()))
    with pytest.raises(MxcError, match=r"rank0\.safetensors: tensor extra is not one the program reads"):
        artifact._check_weight_names(art / "rank0.safetensors", set(expected) | {"extra"}, expected)


def test_a_damaged_graph_is_refused_without_verify(art):
    """The weights are checked against graph.yaml, which is checked against the manifest's ir_sha256 first."""
    path = art / "graph.yaml"
    path.write_text(path.read_text().replace("shape: [64]", "shape: [65]", 1))
    refused(art, r"graph\.yaml: does not match the ir_sha256 the manifest records for it", verify=False)


@pytest.mark.parametrize("path", ["", " ", "\t"])
def test_an_empty_path_isrefused(art, monkeypatch, path):
    """Path("") is the current directory: an empty path loaded whatever artifact the process was started in."""
    monkeypatch.chdir(art)
    refused(path, rf"^path {re.escape(repr(path))}: empty; give the artifact directory$")


@pytest.mark.parametrize("text, pattern", [
    ("family: !!python/object/apply:os.system ['true']\n", r"YAMLError|ConstructorError: could not determine a "
                                                            r"constructor for the tag"),
    ("- 1\n- 2\n", r"TypeError: "),
    ("", r"TypeError: "),
    ("a: [\n", r"(ParserError|ScannerError): "),
    (None, r"KeyError: 'float64'"),
], ids=["yaml-tag", "a-list", "empty", "not-yaml", "unknown-dtype"])
def test_a_graph_that_is_not_one_is_named(art, text, pattern):
    """A graph.yaml that parses to no graph (or uses a YAML tag: safe_load refuses it) under a manifest re-signed
    over it is refused in one line naming the file, with or without verify (was a traceback)."""
    import hashlib

    from mxc.artifact_format import manifest_digest

    graph = art / "graph.yaml"
    if text is None:  # a weight dtype this mxc does not know
        text = graph.read_text().replace("dtype: float32", "dtype: float64")
    graph.write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    m = json.loads((art / "manifest.json").read_text())
    m["ir_sha256"] = m["files"]["graph.yaml"] = digest
    (art / "manifest.json").write_text(json.dumps({**m, "manifest_sha256": manifest_digest(m)}))
    for verify in (True, False):
        msg = refused(art, rf"graph\.yaml: not a graph this mxc can read \(({pattern}).*\); the artifact was written "
                           rf"by another tool or damaged, rebuild it$", verify=verify)
        assert msg.startswith(str(graph))
