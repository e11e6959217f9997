"""A warm interpreter for the tests that run ``python -m mxc ...``, ``python -c SCRIPT`` or ``python bench/X.py`` in
a subprocess, most of them to compile kernels: torch (with torch._dynamo, which a build's first meta-device op
imports), Triton and mxc's build modules imported once an environment and pytest worker, then every command run in
a fork of it.

To the command the fork is a fresh process: its own module state (the server's is as the imports left it), its own
stdio, working directory, ``sys.argv``, exit status and atexit handlers. It skips only the imports, about 6.5 s of
each cold ``mxc build`` on the 2-core CI machine, where some forty such processes ran. ``run`` stands for
``subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``; a test that needs a
process started from nothing (another hash seed, a killed build) calls ``subprocess.run`` itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what a cuda build and the kernels' compile scripts import, the costly part first (python -X importtime)
PRELOAD = ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "triton", "triton.compiler",
           "mxc.cli", "mxc.builder", "mxc.codegen.aot", "mxc.kernels.cuda_ops")

_SERVE = r"""
import atexit, importlib, json, os, runpy, sys, traceback


def command(argv):
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:  # a script's path
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def child(req):
    os.dup2(devnull, 0)
    os.dup2(os.open(req["out"], os.O_WRONLY), 1)
    os.dup2(os.open(req["err"], os.O_WRONLY), 2)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])  # the server's but for the variables pytest changes a test (VOLATILE)
    code = 0
    try:
        command(req["argv"])
    except SystemExit as e:  # as the interpreter reads it
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


replies = os.fdopen(os.dup(1), "w", buffering=1)
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)  # the imports' stray output goes nowhere, and a fork inherits no buffered text
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # the command imports it again and meets the same error in its own output
        pass
sys.stdout.flush()
sys.stderr.flush()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class _Server:
    def __init__(self, env: dict, preload):
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, *preload], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read = b""  # replies read from the pipe, not yet returned (the pid's and the status's may come at once)

    def reply(self, timeout: float | None) -> dict:
        """The next reply line, read straight from the pipe's descriptor (a buffered reader could hold the second
        line where ``select`` does not see it); TimeoutError if none is whole within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._read:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended ({self.proc.poll()})")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# what pytest sets a test: a server per value would start one a test (and keep each with torch in memory)
VOLATILE = ("PYTEST_CURRENT_TEST",)
MAX_SERVERS = 4  # a worker's environments (this Triton and the GPU machines', and a few tests' own); the oldest goes
_SERVERS: dict[tuple, _Server] = {}


@atexit.register
def _close_all():
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def run(args, env: dict, cwd=None, timeout: float | None = None, preload=PRELOAD) -> subprocess.CompletedProcess:
    """``args`` (``[sys.executable, "-m", module, ...]``, ``[sys.executable, "-c", code, ...]`` or
    ``[sys.executable, script, ...]``) run in a fork of the warm interpreter for ``env`` and ``preload``; its output
    captured as text. Raises subprocess.TimeoutExpired after killing the command if it outlives ``timeout``."""
    args = [str(a) for a in args]
    if args[0] != sys.executable or len(args) < 2 or (args[1].startswith("-") and args[1] not in ("-m", "-c")):
        raise ValueError(f"warm_python.run takes [sys.executable, '-m', '-c' or a script, ...], got {args[:2]}")
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE)), tuple(preload))
    server = _SERVERS.pop(key, None)
    if server is None or server.proc.poll() is not None:
        while len(_SERVERS) >= MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()
        server = _Server(env, preload)
    _SERVERS[key] = server  # the most recently used last
    with tempfile.TemporaryDirectory(prefix="mxc_warm_") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        out.touch(), err.touch()
        request = {"argv": args[1:], "cwd": str(cwd or os.getcwd()), "env": env, "out": str(out), "err": str(err)}
        server.proc.stdin.write(json.dumps(request) + "\n")
        server.proc.stdin.flush()
        pid = server.reply(None)["pid"]
        try:
            rc = server.reply(timeout)["rc"]
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):  # it may have ended, and been reaped, just now
                os.kill(pid, signal.SIGKILL)
            server.reply(None)
            raise subprocess.TimeoutExpired(args, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(args, rc, out.read_text(errors="replace"), err.read_text(errors="replace"))
