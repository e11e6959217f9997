"""Helpers of the command-line tests: running ``mxc`` in a subprocess, re-signing an edited manifest, and checking
that a user error is one ``mxc: error:`` line."""

from __future__ import annotations

import os
import subprocess
import sys

from mxc.cli import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}



def run_mxc(*args, exe=None):
    cmd = [exe] if exe else [sys.executable, "-m", "mxc"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=ENV, timeout=120)



def signed(manifest: dict) -> dict:
    """An edited manifest with its manifest_sha256 made to match: what the checks behind the digest see."""
    from mxc.artifact_format import manifest_digest

    return {**manifest, "manifest_sha256": manifest_digest(manifest)}



def assert_user_error(code, err, pattern=""):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxc: error: "), err
    assert pattern in lines[0], lines[0]



def user_error(capsys, argv, pattern):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert_user_error(code, captured.err, pattern)
    assert captured.out == ""



def build_error(capsys, argv, pattern):
    """A user error from ``mxc build`` after its progress lines: the last line is the one-line error."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("mxc: error: ") and pattern in err.splitlines()[-1], err

