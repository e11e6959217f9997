"""tests/warm_python.py: a command run in a fork of the warm interpreter ends as it does in a fresh process (exit
status, output, argv, working directory, atexit), leaves nothing behind for the next, and is killed at its timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests import warm_python

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
LIGHT = ("json",)  # a server that starts in a blink: these tests are about the forks, not the imports

CASES = {
    "output and argv": ("-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr)", "a", "b"),
    "exit status": ("-c", "import sys; sys.exit(3)"),
    "exit message": ("-c", "import sys; sys.exit('bad input')"),
    "exception": ("-c", "raise ValueError('boom')"),
    "signal": ("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"),
    "atexit": ("-c", "import atexit; atexit.register(print, 'at exit'); print('body')"),
    "working directory": ("-c", "import os; print(os.path.basename(os.getcwd()))"),
    "module": ("-m", "mxc", "--version"),
    "script": ("SCRIPT", "x"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fork_ends_as_a_fresh_process(case, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys, os\nprint(sys.argv, os.path.basename(sys.path[0]), __name__)\n")
    args = [sys.executable, *(str(script) if a == "SCRIPT" else a for a in CASES[case])]
    cwd = tmp_path if case == "working directory" else None
    fresh = subprocess.run(args, env=ENV, cwd=cwd, capture_output=True, text=True, timeout=60)
    warm = warm_python.run(args, env=ENV, cwd=cwd, timeout=60, preload=LIGHT)
    assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout)
    if case == "exception":  # the same traceback but for the line the fresh interpreter shows of its own source
        assert "ValueError: boom" in warm.stderr and "ValueError: boom" in fresh.stderr
    else:
        assert warm.stderr == fresh.stderr


def test_state_does_not_carry_from_one_command_to_the_next():
    set_it = "import json; json.LEFT_BEHIND = 1; print(hasattr(json, 'LEFT_BEHIND'))"
    read_it = "import json; print(hasattr(json, 'LEFT_BEHIND'))"
    assert warm_python.run([sys.executable, "-c", set_it], env=ENV, preload=LIGHT).stdout == "True\n"
    assert warm_python.run([sys.executable, "-c", read_it], env=ENV, preload=LIGHT).stdout == "False\n"


def test_a_command_past_its_timeout_is_killed_and_the_server_goes_on():
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                        env=ENV, timeout=1, preload=LIGHT)
    assert warm_python.run([sys.executable, "-c", "print('next')"], env=ENV, preload=LIGHT).stdout == "next\n"


def test_the_environment_is_the_servers():
    code = textwrap.dedent("""
        import os
        print(os.environ.get("MXC_WARM_TEST"))
    """)
    env = {**ENV, "MXC_WARM_TEST": "seen"}
    assert warm_python.run([sys.executable, "-c", code], env=env, preload=LIGHT).stdout == "seen\n"
    assert warm_python.run([sys.executable, "-c", code], env=ENV, preload=LIGHT).stdout == "None\n"


def test_a_variable_pytest_sets_a_test_is_the_commands_and_keeps_the_server():
    code = "import os; print(os.getppid(), os.environ['PYTEST_CURRENT_TEST'])"
    first, second = (warm_python.run([sys.executable, "-c", code], env={**ENV, "PYTEST_CURRENT_TEST": name},
                                     preload=LIGHT).stdout.split() for name in ("a", "b"))
    assert first[1:] == ["a"] and second[1:] == ["b"] and first[0] == second[0]


def test_other_commands_are_refused():
    with pytest.raises(ValueError, match="takes"):
        warm_python.run(["bash", "-c", "true"], env=ENV)
    with pytest.raises(ValueError, match="takes"):
        warm_python.run([sys.executable, "-X", "importtime", "-c", "pass"], env=ENV)
