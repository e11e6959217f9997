"""Each part of ``bench/gpu_session.sh`` run with ``python3`` faked: the scripts it names exist, their options
parse with the script's own parser (``decode_ab.py``'s ``--variant`` patches name attributes that exist), the test
paths exist, and ``ablate --skip`` names kernels that exist."""


from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxc.errors import MxcError


ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

# --- bench/gpu_session.sh -----------------------------------------------------------------------------------------
SESSION = BENCH / "gpu_session.sh"
# parts run again with the settings their comments name
SESSION_EXTRA = [("lab", ["--all"], {}), ("moe", [], {"MOE_ARGS": "--batch1-only"}), ("gemvs", [], {"GEMVS_BF16": "0"}),
                 ("moelab", [], {"MOELAB_ARGS": "--skip moe,gemv"})]


def _session_parts() -> list[str]:
    text = SESSION.read_text()
    case = text[text.index('case "${1:-}" in'):]
    return [line.split(")")[0].strip() for line in case.splitlines()[1:]
            if line[:2] == "  " and line[2:3] != " " and ")" in line and line.split(")")[0].strip().isidentifier()]


@pytest.fixture(scope="module")
def session_calls(tmp_path_factory):
    """Every part of gpu_session.sh run by bash with ``python3``, ``rm`` and ``compute-sanitizer`` faked: the
    ``python3`` command lines each part runs, by part."""
    tmp = tmp_path_factory.mktemp("session")
    fake = tmp / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\037" "$a"; done >> "$CALLS"\n'
                                  'echo >> "$CALLS"\n')
    (fake / "rm").write_text("#!/bin/sh\nexit 0\n")  # its artifacts' scratch folders are on the GPU machine
    (fake / "compute-sanitizer").write_text('#!/bin/sh\nwhile [ "$1" != python3 ]; do shift; done\nexec "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    calls = {}
    for part, extra, env_extra in [(p, [], {}) for p in _session_parts()] + SESSION_EXTRA:
        log = tmp / f"calls_{part}_{len(calls)}"
        log.touch()
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp / "logs"), "CALLS": str(log),
               **env_extra}
        r = subprocess.run(["bash", str(SESSION), part, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=30)
        # sanitize stops after its positive control (the fake sanitizer reports nothing): the control's calls count
        assert r.returncode == 0 or part == "sanitize", f"gpu_session.sh {part}: {r.stdout}{r.stderr}"
        calls[(part, *extra, *env_extra.values())] = [line.split("\037")[:-1]
                                                      for line in log.read_text().splitlines()]
    return calls


def test_session_usage_names_every_part():
    usage = SESSION.read_text().split("usage: bash bench/gpu_session.sh ")[1].split()[0].strip("\"").split("|")
    assert sorted(usage) == sorted(_session_parts())
    header = SESSION.read_text().split("\nset -u")[0]
    for part in _session_parts():  # each part is described in the header
        assert f"#   {part} " in header or f"#   {part}\n" in header, part


class _Parsed(Exception):
    pass


def _parse(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """``bench/script``'s own parser over ``argv``: its ``main`` run up to its first benchmark work (decode_ab.py and
    ablate.py up to their build, through ``mxc.build``'s own option checks: the options they pass it must be ones
    it accepts), or an assertion naming what the parser or the build refused."""
    mod = importlib.import_module(script.removesuffix(".py"))
    checks_after = script in ("decode_ab.py", "ablate.py")
    seen = {}
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        seen["args"] = real(self, args, namespace)
        if not checks_after:
            raise _Parsed
        return seen["args"]

    def stop(*args, **kwargs):
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    if checks_after:
        from mxc import builder
        monkeypatch.setattr(mod, "copy_bandwidth", lambda: 3e12)
        monkeypatch.setattr(builder, "BuildOptions", stop)  # made once every option check has passed
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        mod.main()
    except _Parsed:
        return seen["args"]
    except SystemExit as e:
        raise AssertionError(f"bench/{script} {' '.join(argv)}: refused (exit {e.code}); see the captured stderr")
    except MxcError as e:
        raise AssertionError(f"bench/{script} {' '.join(argv)}: the build refused its options: {e}")
    raise AssertionError(f"bench/{script}: main() returned without parsing its options")


def test_session_parts_name_scripts_and_options_that_exist(session_calls, monkeypatch):
    import torch
    from decode_ab import parse_variant, patched

    from mxc.kernels import triton_moe_decode

    seen_scripts = set()
    for part, calls in session_calls.items():
        assert calls, f"gpu_session.sh {part}: runs nothing"
        for argv in calls:
            if argv[:2] == ["-m", "pytest"]:
                paths = [a for a in argv[2:] if a.startswith("tests")]
                assert paths, (part, argv)
                for path in paths:
                    assert (ROOT / path.split("::")[0]).exists(), f"gpu_session.sh {part}: no {path}"
                continue
            assert argv[0].startswith("bench/") and (ROOT / argv[0]).is_file(), f"gpu_session.sh {part}: {argv}"
            script = Path(argv[0]).name
            seen_scripts.add(script)
            with monkeypatch.context() as m:
                args = _parse(script, argv[1:], m)
            for text in getattr(args, "variant", None) or []:  # the patches' values fit what they patch
                _, patches = parse_variant(text)
                with patched(patches):
                    for key in triton_moe_decode.OVERRIDES:
                        triton_moe_decode.config_for(key[0], key[1], torch.bfloat16)
    # every bench the session names is checked here; the labs it runs too
    assert {"decode.py", "moe.py", "decode_ab.py", "ablate.py", "prefill_gaps.py", "decode_tp.py"} <= seen_scripts


def _kernel_params(name: str) -> str | None:
    """The parameter list of the kernel ``name`` (a Triton function in mxc/kernels or its templates), or None."""
    import re

    for path in [*(ROOT / "mxc" / "kernels").glob("*.py"), *(ROOT / "mxc" / "kernels" / "templates").glob("*.j2")]:
        m = re.search(rf"\ndef {re.escape(name)}\((.*?)\):", path.read_text(), re.S)
        if m:
            return m.group(1)
    return None


def test_session_ablate_skips_name_kernels_that_exist(session_calls):
    """ablate.py's --skip entries name kernels (and constexprs) mxc has: a misspelt one exits only after the build
    and a round on the GPU."""
    import re

    from ablate import GEMVS, GROUPS

    entries = {e for calls in session_calls.values() for argv in calls if argv[0] == "bench/ablate.py"
               for flag, value in zip(argv, argv[1:]) if flag == "--skip" for e in value.partition("=")[2].split("+")}
    assert entries
    for entry in sorted(entries - GROUPS) + sorted(GEMVS):
        name, *conds = entry.split(":")
        params = _kernel_params(name)
        assert params is not None, f"ablate --skip {entry}: no kernel {name} in mxc/kernels"
        for c in conds:
            assert re.search(rf"\b{c.partition('=')[0]}\b", params), f"ablate --skip {entry}: {name} has no {c}"


# --- the benches' own hooks into mxc, run on the CPU ----------------------------------------------------------------
