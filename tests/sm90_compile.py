"""Running a compile script in a fresh interpreter, with this environment's Triton or the GPU machines' (the
``MXC_GPU_TRITON`` directory): what the Gluon labs' CPU tests share (tests/bench/test_gemv_preload_lab.py,
test_moe_down_smem_lab.py). A fresh process, so that another Triton can be put first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compile_script(code: str, triton_path: str | None = None) -> str:
    """``code``'s standard output, run from the repository root without the interpreter (``TRITON_INTERPRET``
    unset), with ``triton_path`` ahead of everything if given; fails the test with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_path:
        env["PYTHONPATH"] = os.pathsep.join([triton_path, str(ROOT)])
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
