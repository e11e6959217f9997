"""Running tensor-parallel ranks (``mxc.runtime.ranks``): a rank's user error, a rank killed by a signal, stopping
the ranks on an interrupt or a SIGTERM, ranks ending with a parent killed outright, and the rendezvous port."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import mxc
from mxc.runtime.ranks import run_ranks


def _fail_on(rank, world_size, device, bad_rank, error):
    import torch.distributed as dist

    # every rank through its gloo handshake first, as a real rank's collectives make it: else a good rank 0 could
    # leave while rank 1 still connects, and rank 1 fail there, not where the test makes it (seen once in CI)
    dist.barrier()
    if rank == bad_rank and error is None:
        os._exit(3)  # dies without a word (a signal, a crash in native code)
    if rank == bad_rank:
        raise error(f"bad input on rank {rank}")


@pytest.mark.parametrize("world_size,bad_rank,message", [(1, 0, "bad input on rank 0"),
                                                         (2, 1, "rank 1: bad input on rank 1")])
def test_a_ranks_user_error_reaches_the_caller_as_one(world_size, bad_rank, message):
    """``run_ranks``: a rank's ``MxcError`` is raised in the caller as one line, naming the rank when there are
    several; another exception (a bug) is not turned into a user error; a rank that leaves with an exit status
    and no error is one line naming the rank and the status."""
    with pytest.raises(mxc.MxcError) as e:
        run_ranks(_fail_on, world_size, "cpu", bad_rank, mxc.MxcError)
    assert str(e.value) == message
    with pytest.raises(Exception, match="bad input on rank") as e:
        run_ranks(_fail_on, world_size, "cpu", bad_rank, RuntimeError)
    assert not isinstance(e.value, mxc.MxcError)
    with pytest.raises(mxc.MxcError, match=rf"^rank {bad_rank} exited with status 3 without an error message; ") as e:
        run_ranks(_fail_on, world_size, "cpu", bad_rank, None)
    assert "\n" not in str(e.value)


def _killed(rank, world_size, device, victim, sig, pids):
    import signal
    import time

    import torch.distributed as dist

    dist.barrier()  # both ranks up, as in _fail_on
    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    if rank == victim:
        os.kill(os.getpid(), getattr(signal, sig))  # the out-of-memory killer, a kill -9, a crash
    time.sleep(120)  # the other ranks: stopped by run_ranks, not waited for


@pytest.mark.parametrize("sig,why", [("SIGKILL", "out of memory?"), ("SIGSEGV", "a crash in native code")])
def test_a_rank_killed_by_a_signal_is_one_line_and_the_others_are_stopped(sig, why, tmp_path):
    """A rank ended by a signal (the out-of-memory killer's SIGKILL, ``kill -9``) is one line naming the rank and
    the signal, not torch's ProcessExitedException with its traceback; the other ranks are stopped."""
    import time

    t0 = time.monotonic()
    with pytest.raises(mxc.MxcError, match=rf"^rank 1 ended by {sig} \({why}") as e:
        run_ranks(_killed, 2, "cpu", 1, sig, str(tmp_path))
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 60
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert not [pid for pid in pids if _alive(pid)]


class _Rank:
    """A rank process as ``stop_ranks`` sees it: alive or not, ending on SIGTERM (``polite``) or only on SIGKILL."""

    def __init__(self, alive: bool, polite: bool):
        self.alive, self.polite, self.calls = alive, polite, []

    def is_alive(self):
        return self.alive

    def terminate(self):
        self.calls.append("terminate")
        self.alive = not self.polite

    def kill(self):
        self.calls.append("kill")
        self.alive = False

    def join(self, timeout=None):
        self.calls.append(("join", timeout))


def test_stop_ranks_terminates_then_kills_what_is_left_after_the_grace():
    """``stop_ranks``: SIGTERM to the ranks still running, then, once ``grace`` seconds are up, SIGKILL to those
    that ignored it; a rank already ended is left alone."""
    from mxc.runtime.ranks import stop_ranks

    done, polite, stubborn = _Rank(False, True), _Rank(True, True), _Rank(True, False)
    stop_ranks([done, polite, stubborn], grace=2.0)
    assert [c for c in done.calls if c in ("terminate", "kill")] == []
    assert polite.calls[0] == "terminate" and "kill" not in polite.calls
    assert stubborn.calls[0] == "terminate" and stubborn.calls[-2:] == ["kill", ("join", None)]
    waited = [c[1] for c in stubborn.calls if isinstance(c, tuple) and c[1] is not None]
    assert len(waited) == 1 and 1.0 < waited[0] <= 2.0  # the rest of the grace, not no wait at all


def test_stop_ranks_kills_at_once_when_its_wait_is_interrupted():
    """A second Ctrl-C while ``stop_ranks`` waits out the grace: the ranks still running get SIGKILL before the
    interrupt goes on (a rank left running would keep the command from exiting)."""
    from mxc.runtime.ranks import stop_ranks

    class Interrupted(_Rank):
        def join(self, timeout=None):
            super().join(timeout)
            if timeout is not None:
                raise KeyboardInterrupt

    first, stubborn = Interrupted(True, False), _Rank(True, False)
    with pytest.raises(KeyboardInterrupt):
        stop_ranks([first, stubborn], grace=60.0)
    for rank in (first, stubborn):
        assert rank.calls[0] == "terminate" and rank.calls[-2:] == ["kill", ("join", None)], rank.calls


def test_run_ranks_interrupted_while_starting_them_stops_those_started(monkeypatch):
    """Ctrl-C or SIGTERM while ``run_ranks`` is still starting the ranks: those already started are stopped, not
    left waiting for the others at the rendezvous (the command's exit would wait for them)."""
    import multiprocessing
    import time

    import torch.multiprocessing as tmp

    from mxc.runtime import ranks

    started = []

    def start_one_then_interrupted(*args, **kwargs):
        p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
        p.start()
        started.append(p)
        raise KeyboardInterrupt

    monkeypatch.setattr(tmp, "start_processes", start_one_then_interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ranks.run_ranks(_fail_on, 2, "cpu", 0, None)
    assert len(started) == 1 and not started[0].is_alive() and time.monotonic() - t0 < 60


def test_cli_generate_starts_the_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items()}
    one = mxc.build("llama.yaml", out=tmp_path / "one", progress=False, log=lambda m: None)
    two = mxc.build("llama.yaml", out=tmp_path / "two", tp=2, progress=False, log=lambda m: None)
    expected = mxc.load(one).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6)[0].tolist()
    proc = subprocess.run([sys.executable, "-m", "mxc", "generate", str(two), "--ids", "1,2,3",
                           "--max-new-tokens", "6"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == {"ids": expected}


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` and their command lines (from /proc; psutil is not a dependency)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read().replace("\0", " ")
        except OSError:  # gone meanwhile
            continue
        if int(ppid) == pid and state != "Z":
            found[int(entry)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_ended(pids: list[int], within: float = 5.0) -> None:
    """The processes ``pids`` end within ``within`` seconds (a moment for the kernel to deliver and reap)."""
    import time

    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def _kill_left(proc: subprocess.Popen, ranks: list[int]) -> None:
    """A failed test's command and ranks, killed: none outlives the test."""
    import signal

    for pid in [proc.pid] + ranks:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(5)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the rank processes through /proc")
def test_sigterm_to_generate_ends_its_ranks(tmp_path):
    """SIGTERM to ``mxc generate`` alone (not its process group, as a service manager or ``kill`` sends it) on a
    tp=2 artifact: the command ends its ranks, which would decode on, and exits 143 with its one line."""
    import signal
    import time

    art = mxc.build("llama.yaml", out=tmp_path / "tp2", tp=2, max_seq_len=100_000, progress=False,
                    log=lambda m: None)
    proc = subprocess.Popen([sys.executable, "-m", "mxc", "generate", str(art), "--ids", "1",
                             "--max-new-tokens", "99000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        deadline = time.monotonic() + 20
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            ranks = [pid for pid, cmd in _children(proc.pid).items() if "spawn_main" in cmd]
            time.sleep(0.1)
        assert len(ranks) == 2, proc.stderr.read() if proc.poll() is not None else "no ranks in 20 s"
        time.sleep(3)  # the ranks load the artifact and decode
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + signal.SIGTERM and err.strip() == "mxc: terminated (SIGTERM)", err
        _assert_ended(ranks)  # reaped by the parent before it exits
    finally:
        _kill_left(proc, ranks)


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment holds ``MXC_TEST_RUN=tag``: whatever a command started with it started,
    seen or not while it ran (a rank that fails at once can start and end between two looks)."""
    mark, found = f"MXC_TEST_RUN={tag}".encode(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and mark in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):
                found.append(int(entry))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


def _generate_watching(art, until, args=("--ids", "1", "--max-new-tokens", "99000")):
    """``mxc generate art`` in a subprocess, every process it starts noted while it runs; ``until(ranks)`` is called
    with the rank pids until it returns True. Returns (exit status, stdout, stderr, the children seen: pid -> command
    line, and after it ended those still alive of every process it started: ``_tagged``)."""
    import time
    import uuid

    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "mxc", "generate", str(art), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MXC_TEST_RUN": tag})
    seen, done = {}, False
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(_children(proc.pid))
            ranks = sorted(pid for pid, cmd in seen.items() if "spawn_main" in cmd)
            done = done or until(ranks)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=30)
        seen.update({pid: "" for pid in _tagged(tag) if pid not in seen})  # started and not seen: still alive
    finally:
        _kill_left(proc, list(seen))
    return proc.returncode, out, err, seen


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the rank processes through /proc")
def test_cli_generate_with_a_rank_failing_or_killed_is_one_line_and_leaves_no_process(tmp_path):
    """``mxc generate`` on a tp=2 artifact one of whose ranks fails with a user error (rank 1's weights file changed
    since the build: rank 1 hashes its own weights), or one of whose ranks a signal from another process ends
    mid-decode: one line on stderr, nothing on stdout, exit status 2, and every process the command started (the
    ranks, multiprocessing's resource tracker) gone."""
    import shutil
    import signal
    import time

    art = mxc.build("llama.yaml", out=tmp_path / "tp2", tp=2, max_seq_len=100_000, progress=False,
                    log=lambda m: None)
    damaged = tmp_path / "damaged"
    shutil.copytree(art, damaged)
    with open(damaged / "weights" / "rank1.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\x7f\xff\x7f")
    code, out, err, started = _generate_watching(damaged, lambda ranks: False, ("--ids", "1", "--max-new-tokens", "4"))
    assert (code, out) == (2, ""), err
    assert re.fullmatch(rf"mxc: error: rank 1: {re.escape(str(damaged))}: weights/rank1\.safetensors was modified "
                        rf"since the build \(sha256 mismatch\); rebuild the artifact\n", err), err
    _assert_ended(list(started))  # every process it started (seen, or still alive after it: _tagged)

    t0 = []

    def sigterm_one_decoding(ranks):
        if len(ranks) == 2 and not t0:
            t0.append(time.monotonic())
        if t0 and time.monotonic() - t0[0] > 3:  # the ranks load the artifact and decode
            os.kill(ranks[-1], signal.SIGTERM)
            return True
        return False

    code, out, err, started = _generate_watching(art, sigterm_one_decoding)
    assert t0 and (code, out) == (2, ""), err
    assert re.fullmatch(r"mxc: error: rank [01] ended by SIGTERM \(sent by another process; the other ranks were "
                        r"stopped\)\n", err), err
    _assert_ended(list(started))


def test_a_rank_ended_by_a_signal_python_has_no_name_for_is_named_by_number():
    """A real-time signal (SIGRTMIN+6, 40 on Linux) has no ``signal.Signals`` member: its number is named."""
    from mxc.runtime.ranks import exit_error

    assert exit_error(1, -40) == "rank 1 ended by signal 40 (sent by another process; the other ranks were stopped)"


_SLEEPING_RANK = """
import os, time

def sleep(rank, world_size, device, pids):
    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a rank follows its parent's death on Linux only")
def test_ranks_end_when_the_command_is_killed(tmp_path):
    """The command killed with SIGKILL (the out-of-memory killer, ``kill -9``) cannot stop its ranks: they end on
    their own within moments, not left to init decoding on for ever. Its SIGINT ignored, as a shell script's
    background job (``mxc generate ... &``) starts it: torch's own death signal, SIGINT, is then lost."""
    import signal
    import time

    (tmp_path / "sleeping_rank.py").write_text(_SLEEPING_RANK)
    pids = tmp_path / "pids"
    pids.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sleeping_rank; "
            f"from mxc.runtime.ranks import run_ranks; run_ranks(sleeping_rank.sleep, 2, 'cpu', {str(pids)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            ranks = [int(p.read_text()) for p in pids.iterdir() if p.read_text()]
        assert len(ranks) == 2, proc.communicate()[1][-2000:] if proc.poll() is not None else "no ranks in 60 s"
        proc.kill()
        proc.wait()
        _assert_ended(ranks)
    finally:
        _kill_left(proc, ranks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a rank follows its parent's death on Linux only")
def test_a_rank_whose_parent_died_before_it_followed_it_ends_at_once():
    """The parent dead before the rank's ``prctl`` (the kernel would then never send the signal): the rank sees it
    is another process's child and ends as the signal would have ended it."""
    import signal

    code = "from mxc.runtime.ranks import _follow_parent; _follow_parent(-1); print('ran on')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM and "ran on" not in proc.stdout, proc.stderr[-2000:]


def test_the_rendezvous_port_stays_taken_while_the_ranks_run():
    """``run_ranks``' rendezvous store holds its port from bind to the end: another job cannot take it between the
    choice and the ranks' connect (a port picked free and released could be: a CI run's ranks once met a stranger)."""
    import socket

    from mxc.runtime.ranks import rendezvous_store

    store = rendezvous_store()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    store.set("k", "v")
    assert store.get("k") == b"v"
