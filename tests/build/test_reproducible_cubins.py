"""The build's cubins hold no path of the machine that compiled them: the same build from another checkout or
virtual environment gives the same bytes, and an artifact does not tell where (or by whom: ``/home/<user>``) it
was built. Triton's line info recorded the absolute directories of the kernels' sources and of Triton's own."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.sm90_compile import compile_env

_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def row_sum(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + tl.program_id(0) * N + offs), axis=0))
"""

_COMPILE = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mxc.codegen import aot
spec = {"kernel": "sum_kernels:row_sum", "signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "N": "constexpr"},
        "constexprs": {"N": 64}, "num_warps": 4, "num_stages": 1}
_, cubin, _ = aot._compile_one("k", spec, 90, None)
Path(sys.argv[1], "k.cubin").write_bytes(cubin)
print(os.environ.get("TRITON_DISABLE_LINE_INFO"))
"""


def test_cubins_name_no_directory_of_the_build_machine(tmp_path):
    import triton

    (tmp_path / "sum_kernels.py").write_text(_KERNEL)
    env = {k: v for k, v in compile_env().items() if k != "TRITON_DISABLE_LINE_INFO"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache of earlier builds
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "None"  # the caller's environment is left as it was
    cubin = (tmp_path / "k.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    for directory in (tmp_path, os.path.dirname(triton.__file__)):  # the kernel's source, Triton's (tl.sum)
        assert str(directory).encode() not in cubin, directory
