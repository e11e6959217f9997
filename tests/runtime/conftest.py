"""Fixtures of the runtime tests: a tiny artifact built once a module (``pristine``) and a fresh copy of it a test
(``art``), for tests that damage or edit it."""

from __future__ import annotations

import shutil

import pytest

import mxc


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return mxc.build("llama.yaml", out=tmp_path_factory.mktemp("pristine") / "art", progress=False,
                     log=lambda m: None)


@pytest.fixture
def art(pristine, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(pristine, copy)
    return copy
