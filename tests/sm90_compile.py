"""Compiling for sm_90 in another interpreter, with this environment's Triton or the GPU machines' (the
``MXC_GPU_TRITON`` directory): the environment every test that compiles kernels in a subprocess takes
(``compile_env``: the interpreter off), and the runner of the compile tests' scripts (``run_compile_script``: the
kernels' sm_90 checks, the PDL and descriptor checks, the Gluon labs' CPU tests). Another process, so that the
interpreter is off and another Triton can be put first on the path; a fork of a warm one (``tests/warm_python.py``),
so that torch and Triton are not imported again for each script."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tests import warm_python

ROOT = Path(__file__).resolve().parents[1]


def compile_env(triton_path: str | None = None) -> dict:
    """This environment without the interpreter (``TRITON_INTERPRET`` unset: kernels compile), with ``triton_path``
    and the repository first on the path if a Triton package folder is given."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_path:
        env["PYTHONPATH"] = os.pathsep.join([triton_path, str(ROOT)] + [v for v in [env.get("PYTHONPATH")] if v])
    return env


def run_compile_script(code: str, triton_path: str | None = None, args: Sequence[str] = ()) -> str:
    """``code``'s standard output, run with ``args`` (its ``sys.argv[1:]``) from the repository root in
    ``compile_env(triton_path)``; fails the test with its stderr if it fails."""
    r = warm_python.run([sys.executable, "-c", code, *args], cwd=ROOT, env=compile_env(triton_path), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
