"""The build's kernel-compiling workers (``aot.compile_specs``, spawned processes) start without the caller's main
script: a script that calls ``mxc.build(target="cuda")`` with no ``if __name__ == "__main__":`` guard ran again in
every worker (its prints repeated, its builds started twice) and the pool broke. One worker compiles in the
caller's process (``mxc build --jobs 1``), into the same files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.sm90_compile import compile_env

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
from pathlib import Path

print("body", flush=True)  # no __main__ guard, as a user's script
MAIN = sys.modules["__main__"]
from mxc.codegen import aot

spec = {"kernel": "mxc.kernels.triton_route:route_kernel",
        "signature": {n: "constexpr" for n in ("E", "K", "BLOCK_E", "BLOCK_K", "SIGMOID", "RENORMALIZE", "USE_PDL",
                                               "BITONIC")} | {"logits_ptr": "*bf16", "weights_ptr": "*bf16",
                                                              "ids_ptr": "*i64"},
        "constexprs": {"E": 8, "K": 2, "BLOCK_E": 8, "BLOCK_K": 2, "SIGMOID": False, "RENORMALIZE": True,
                       "USE_PDL": False, "BITONIC": False},
        "num_warps": 1, "num_stages": 1}
one = dict(spec, constexprs=dict(spec["constexprs"], K=1, BLOCK_K=1))
index = aot.compile_specs({"a": spec, "b": one}, Path(sys.argv[1]), progress=False, workers=2)
print("compiled", len(index), flush=True)
print("main script module kept:", sys.modules["__main__"] is MAIN, flush=True)  # put back once the workers start
# one worker compiles in this process, with no pool (``mxc build --jobs 1``): the same files
alone = Path(sys.argv[1] + "-alone")
aot.compile_specs({"a": spec, "b": one}, alone, progress=False, workers=1)
files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}  # noqa: E731
print("the same files from one process:", files(alone) == files(Path(sys.argv[1])), flush=True)
"""


def test_workers_do_not_run_the_callers_unguarded_script(tmp_path):
    script = tmp_path / "build_kernels.py"
    script.write_text(_SCRIPT)
    env = compile_env()  # compiles for sm_90, as a build does
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["body", "compiled 2", "main script module kept: True",
                                     "the same files from one process: True"]
    assert (tmp_path / "out" / "index.json").is_file()
