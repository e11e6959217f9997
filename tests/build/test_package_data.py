"""What an installed mxc ships besides its modules: every data file of the package (templates, model files, the CUDA
sources and headers the builds compile) is matched by pyproject.toml's package-data, or a non-editable install
lacks it (``pip install .`` left out ``csrc/cutlass_silu_pair.cuh``, which every CUTLASS fp8 build reads)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_package_data_covers_every_data_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mxc"]
    shipped = {p.relative_to(ROOT / "mxc").as_posix() for g in globs for p in (ROOT / "mxc").glob(g)}
    tracked = subprocess.run(["git", "ls-files", "mxc"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    data = {f.removeprefix("mxc/") for f in tracked.stdout.splitlines() if not f.endswith(".py")}
    assert data, "git lists no data files under mxc/"
    assert sorted(data - shipped) == []
