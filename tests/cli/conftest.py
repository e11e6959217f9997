"""The command-line tests' shared artifact: the bundled tiny model, built once a test module."""

from __future__ import annotations

import pytest

import mxc


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return mxc.build("llama.yaml", out=tmp_path_factory.mktemp("cli") / "art", progress=False, log=lambda m: None)
