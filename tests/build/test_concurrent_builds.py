"""Builds into the same --out at once take turns at the swap (``build_output.swap_lock``): the later one replaces the
earlier one's artifact, neither fails on the other's renames, and nothing is left beside the artifact; a swap whose
rename fails is one line and keeps the previous artifact."""

from __future__ import annotations

import errno
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
