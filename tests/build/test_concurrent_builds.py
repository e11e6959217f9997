"""Builds into the same --out at once take turns at the swap (``build_output.swap_lock``): the later one replaces the
earlier one's artifact, neither fails on the other's renames, and nothing is left beside the artifact; a swap whose
rename fails is one line and keeps the previous artifact."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mxc
from mxc.errors import MxcError
from tests.build.helpers import build, one_line

# another build, in its own process, whose finished output waits at argv[1]: it swaps it in for argv[2] when told
OTHER_BUILD = ("import sys; from pathlib import Path; from mxc.build_output import replace_with; "
               "print('ready', flush=True); sys.stdin.readline(); replace_with(Path(sys.argv[1]), Path(sys.argv[2]))")


def _leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.glob(".art.*"))


def test_a_build_swapping_in_while_another_does_waits_its_turn(tmp_path, monkeypatch):
    """Another build's swap started just after this one moved the previous artifact aside: it used to find --out
    gone, rename its own in, and this one's second rename then died on `Directory not empty` (a raw OSError), the
    previous artifact left as `.art.old-PID`. Now the other waits for this swap to end, then replaces it."""
    out = tmp_path / "art"
    build("llama.yaml", out)
    staged = build("llama.yaml", tmp_path / "staged", max_seq_len=64)  # the other build's output, ready to go in
    theirs = (staged / "manifest.json").read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(mxc.__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    other = subprocess.Popen([sys.executable, "-c", OTHER_BUILD, str(staged), str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "ready", other.communicate()[1][-2000:]
        replace, raced = os.replace, []

        def replace_then_the_other_swaps(src, dst):
            replace(src, dst)
            if Path(src) == out and not raced:  # the previous artifact just moved aside: the other build's turn
                raced.append(dst)
                other.stdin.write("go\n")
                other.stdin.flush()
                try:
                    other.wait(2)  # unlocked, its swap is done by then; locked, it waits for this one to finish
                except subprocess.TimeoutExpired:
                    pass

        monkeypatch.setattr(os, "replace", replace_then_the_other_swaps)
        build("llama.yaml", out)  # no OSError
        assert raced
        _, err = other.communicate(timeout=60)
        assert other.returncode == 0 and "Traceback" not in err, err
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert (out / "manifest.json").read_bytes() == theirs  # the later swap's
    assert mxc.load(out).vocab_size == 256  # complete: load checks every file's sha256 against the manifest
    assert _leftovers(tmp_path) == [] and not staged.exists()


@pytest.mark.parametrize("restore_fails", [False, True], ids=["put-back", "not-put-back"])
def test_a_failed_swap_keeps_the_previous_artifact_and_says_so(tmp_path, monkeypatch, restore_fails):
    """The new artifact's rename into --out fails (EXDEV here: any OSError): one line, the previous artifact moved
    back to --out, nothing else left; if even that fails, the line says where the previous artifact is."""
    out = tmp_path / "art"
    build("llama.yaml", out)
    manifest = (out / "manifest.json").read_bytes()
    replace = os.replace

    def replace_failing(src, dst):
        if Path(dst) == out and (".building-" in Path(src).name or restore_fails):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_failing)
    with pytest.raises(MxcError) as e:
        build("llama.yaml", out, max_seq_len=64)
    message = one_line(e)
    assert message.startswith(f"--out {out}: cannot move the new artifact there (Invalid cross-device link)")
    monkeypatch.undo()
    if restore_fails:
        (old,) = tmp_path.glob(".art.old-*")
        assert f"it is in {old}: move it back to {out} by hand" in message
        assert (old / "manifest.json").read_bytes() == manifest and not out.exists()
        old.rename(out)
    else:
        assert message.endswith("; the previous artifact is left in place; fix that and build again")
    assert (out / "manifest.json").read_bytes() == manifest
    mxc.load(out)
    assert _leftovers(tmp_path) == []


def test_builds_wait_for_the_lock_and_leave_no_lock_file(tmp_path, monkeypatch):
    """``swap_lock``: a second holder waits while the first holds it (here: gives up after LOCK_WAIT, one line
    naming the lock), and the file goes with its last holder."""
    from mxc import build_output

    out = tmp_path / "art"
    monkeypatch.setattr(build_output, "LOCK_WAIT", 0.3)
    with build_output.swap_lock(out):
        assert (tmp_path / ".art.lock").exists()
        with pytest.raises(MxcError) as e:
            with build_output.swap_lock(out):
                pass
        assert one_line(e).startswith(f"--out {out}: another build into it has held {tmp_path / '.art.lock'} for "
                                      f"over 0 s; ")
    assert _leftovers(tmp_path) == []
    with build_output.swap_lock(out):  # free again
        pass
    assert _leftovers(tmp_path) == []


def _no_lock_file():
    """``os.open`` that cannot make ``.art.lock`` (a directory of that name, a read-only bind mount of the file)."""
    opened = os.open

    def refused(path, flags, mode=0o777, *, dir_fd=None):
        if Path(path).name == ".art.lock":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return opened(path, flags, mode, dir_fd=dir_fd)

    return refused


@pytest.mark.parametrize("without", ["fcntl", "ENOLCK", "EOPNOTSUPP", "lock-file"])
def test_without_locks_the_swap_goes_on_unlocked_and_leaves_nothing_beside(tmp_path, monkeypatch, without):
    """Where locks are not to be had (no ``fcntl``: Windows; a filesystem refusing ``flock``: NFS without a lock
    daemon, some FUSE mounts; a lock file that cannot be made), the swap goes on unlocked, as documented: the new
    artifact replaces the previous one, and nothing is left beside it (the lock file made for a refused ``flock``
    was left there, for good)."""
    from types import SimpleNamespace

    from mxc import build_output

    out = tmp_path / "art"
    build("llama.yaml", out)
    if without == "fcntl":
        monkeypatch.setattr(build_output, "fcntl", None)
    elif without == "lock-file":
        monkeypatch.setattr(os, "open", _no_lock_file())
    else:
        def flock(fd, op):
            raise OSError(getattr(errno, without), os.strerror(getattr(errno, without)))

        monkeypatch.setattr(build_output, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=2, LOCK_NB=4))
    build("llama.yaml", out, max_seq_len=64)
    monkeypatch.undo()
    mxc.load(out)
    assert json.loads((out / "manifest.json").read_text())["options"]["max_seq_len"] == 64  # the new one
    assert _leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_previous_artifact_that_cannot_be_moved_aside_is_left_in_place(tmp_path, monkeypatch):
    """The first rename of the swap (the previous artifact aside) fails (EACCES here, as on a directory the user may
    not move, or EBUSY on a mount point): one line naming --out and why, the previous artifact in place and whole,
    and neither the new build's output nor the lock left beside it."""
    out = tmp_path / "art"
    build("llama.yaml", out)
    manifest = (out / "manifest.json").read_bytes()
    replace = os.replace

    def replace_failing(src, dst):
        if Path(src) == out:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_failing)
    with pytest.raises(MxcError) as e:
        build("llama.yaml", out, max_seq_len=64)
    monkeypatch.undo()
    assert one_line(e) == (f"--out {out}: cannot move the previous artifact aside to put the new one there "
                           f"(Permission denied); it is left in place; fix that and build again")
    assert (out / "manifest.json").read_bytes() == manifest
    mxc.load(out)
    assert _leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_waiter_whose_lock_file_was_removed_locks_the_one_there_now(tmp_path, monkeypatch):
    """``swap_lock``: a build waiting on the lock file gets it only once its holder has removed that file; it then
    locks the file at the path now (made afresh), so a third build waits for it rather than taking a lock of its own
    on a new file alongside; the last holder leaves no file."""
    import threading

    from mxc import build_output

    out = tmp_path / "art"
    monkeypatch.setattr(build_output, "LOCK_WAIT", 0.3)
    locked, release, ended = threading.Event(), threading.Event(), []

    def second():
        try:
            with build_output.swap_lock(out):
                locked.set()
                release.wait(30)
        finally:
            ended.append(True)

    waiter = threading.Thread(target=second)
    with build_output.swap_lock(out):
        waiter.start()
        assert not locked.wait(0.2)  # waiting, on the file this holder removes as it lets go
    try:
        assert locked.wait(10) and (tmp_path / ".art.lock").exists()
        with pytest.raises(MxcError, match="another build into it has held"):
            with build_output.swap_lock(out):
                pass
    finally:
        release.set()
        waiter.join(30)
    assert ended and _leftovers(tmp_path) == []


def test_an_artifact_this_process_left_between_the_two_renames_is_put_back_first(tmp_path):
    """This process's own earlier swap stopped between its renames (an interrupt: ``.art.old-PID`` of this pid and
    nothing at --out; a live pid's leftovers are not another build's to recover): the next build in the process
    puts it back before its swap, then replaces it, leaving nothing beside."""
    out = tmp_path / "art"
    build("llama.yaml", out)
    out.rename(tmp_path / f".art.old-{os.getpid()}")
    build("llama.yaml", out, max_seq_len=64)
    mxc.load(out)
    assert json.loads((out / "manifest.json").read_text())["options"]["max_seq_len"] == 64  # the new one
    assert _leftovers(tmp_path) == []


def test_an_interrupt_between_the_renames_puts_the_previous_artifact_back(tmp_path, monkeypatch):
    """Ctrl-C after the previous artifact was moved aside, before the new one was moved in: --out was left missing
    until the next build into it; now the previous artifact goes back before the interrupt propagates, and nothing
    is left beside it."""
    out = tmp_path / "art"
    build("llama.yaml", out)
    manifest = (out / "manifest.json").read_bytes()
    replace = os.replace

    def interrupted(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".art.building-"):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build("llama.yaml", out, max_seq_len=64)
    monkeypatch.undo()
    assert (out / "manifest.json").read_bytes() == manifest
    mxc.load(out)
    assert _leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["art"]
