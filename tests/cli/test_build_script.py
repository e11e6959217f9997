"""``build.py`` (the build without installing) must survive being imported again: kernel compilation
runs in spawned processes, which import the parent's ``__main__`` file as ``__mp_main__``."""

import runpy
from pathlib import Path

import mxc.cli

ROOT = Path(__file__).resolve().parents[2]


def test_build_script_runs_no_build_when_a_spawned_process_imports_it(monkeypatch):
    calls = []
    monkeypatch.setattr(mxc.cli, "main", lambda argv: calls.append(argv) or 0)
    runpy.run_path(str(ROOT / "build.py"), run_name="__mp_main__")
    assert calls == []


def test_build_script_builds_when_run(monkeypatch):
    calls = []
    monkeypatch.setattr(mxc.cli, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr("sys.argv", ["build.py", "llama.yaml", "--out", "x"])
    try:
        runpy.run_path(str(ROOT / "build.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code == 0
    assert calls == [["build", "llama.yaml", "--out", "x"]]
