"""Where a build writes: ``--out`` and ``--dump-ir`` checked before the long work (writable, never another
program's folder, never inside an artifact, room for the weights), and the swap at the end: the finished
temporary sibling directory replaces ``out`` with two renames (``replace_with``; an interrupt between them puts the
previous artifact back), and the next build cleans up after one that was killed between them (``recover``); builds
into the same ``out`` take their turns at both (``swap_lock``)."""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; builds into the same --out there are not kept apart
    fcntl = None

from mxc.artifact_format import is_artifact
from mxc.errors import MxcError, size_text


def check_out(out: Path) -> None:
    """``--out``: only an artifact is ever replaced, never a folder inside one, and the place must be writable."""
    if out.exists() and not is_artifact(out):
        raise MxcError(f"--out {out}: exists and is not an mxc artifact; choose another path or remove it")
    inside = next((p for p in out.absolute().parents if is_artifact(p)), None)
    if inside is not None:  # its manifest would not list the new files: it would no longer load
        raise MxcError(f"--out {out}: is inside the artifact {inside}; choose a path outside it")
    check_writable(out, "--out")


def check_writable(path: Path, flag: str) -> None:
    """Fail before the build's long work if ``path`` cannot become a directory: its nearest existing ancestor
    must be a writable directory (and ``path`` itself, if it exists, a directory)."""
    if path.exists() and not path.is_dir():
        raise MxcError(f"{flag} {path}: exists and is not a directory")
    base = path.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        why = "is not a directory" if not base.is_dir() else "is not writable"
        raise MxcError(f"{flag} {path}: cannot be created ({base} {why})")


def check_dump_dir(dump: Path, out: Path) -> None:
    """``--dump-ir``'s directory must be writable and neither an artifact (its manifest would not list the dumps:
    it would no longer load), nor inside one, nor inside ``--out`` (the finished build replaces ``out``: the dumps
    would go with it)."""
    check_writable(dump, "--dump-ir")
    where = dump.resolve()
    if where == out.resolve() or out.resolve() in where.parents:
        raise MxcError(f"--dump-ir {dump}: is inside --out {out}, which the build replaces when it ends; choose a "
                       f"directory outside it")
    artifact = next((p for p in (where, *where.parents) if is_artifact(p)), None)
    if artifact is not None:
        raise MxcError(f"--dump-ir {dump}: is {'the' if artifact == where else 'inside the'} artifact {artifact}; "
                       f"choose a directory outside it")


def check_space(out: Path, need: int, at_least: bool = False) -> None:
    """Fail before the build's long work if the disk ``out`` goes on has less room than the weights ``need``
    (bytes, or a lower bound of them: ``at_least``; the old artifact at ``out``, if any, is replaced only at the
    end, so it takes no part)."""
    base = out.absolute()
    while not base.exists():
        base = base.parent
    usage = shutil.disk_usage(base)
    # the partial output of builds into ``out`` that were killed (OOM, SIGKILL) is removed before this one writes
    # (``recover``): its room counts as free, or a rebuild after one killed late was refused for lack of it
    try:
        left = sum(_disk_bytes(p) for kind, p in _dead_builds(out) if kind == "building")
    except OSError:  # a folder that cannot be listed: recover says so when it gets there
        left = 0
    free = usage.free + left
    if usage.total and need > free:  # a filesystem reporting no size at all (some pseudo mounts) is not judged
        counted = f", counting the {size_text(left)} of killed builds' leftovers it removes first" if left else ""
        raise MxcError(f"--out {out}: the artifact's weights take {'at least ' * at_least}{size_text(need)} and "
                       f"{base} has {size_text(free)} "
                       f"free{counted}; free some space or choose another --out")


def _disk_bytes(path: Path) -> int:
    """Bytes a file or folder takes on its disk (its blocks: a sparse file's holes take none)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in (root, *(os.path.join(root, f) for f in files)):
            try:
                st = os.lstat(name)
            except OSError:  # gone meanwhile
                continue
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


LOCK_WAIT = 120.0  # seconds: a swap is two renames, recover some deletions; past this the holder is stuck


@contextmanager
def swap_lock(out: Path):
    """Hold ``out``'s lock: an advisory ``flock`` on ``.{out.name}.lock`` beside it (never inside: an artifact's
    files are listed and hashed), so that builds into the same ``out`` (two ``mxc build --out X`` at once) take turns
    at ``recover`` and the swap. Interleaved, one build found ``out`` gone (the other had just moved it aside) and
    renamed its own in, and the other's second rename then failed on the occupied name, leaving the previous
    artifact stranded beside it; now the later build waits and simply replaces the earlier one's artifact.

    The file is removed by its holder before it lets go, so none is left beside the artifact; a waiter that then
    gets the lock of the removed file tries again with the path's current one. Where locks are not to be had
    (no ``fcntl``, a filesystem without them, a directory the file cannot be made in) the swap goes on unlocked, as
    before (a lock file made for a refused ``flock`` removed at once), and a failing rename reports itself; a holder
    stuck for ``LOCK_WAIT`` seconds is an ``MxcError``."""
    path = out.parent / f".{out.name}.lock"
    deadline = time.monotonic() + LOCK_WAIT
    fd = None
    while fcntl is not None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            break
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # another build is swapping: its turn first
                    if time.monotonic() > deadline:
                        raise MxcError(f"--out {out}: another build into it has held {path} for over "
                                       f"{LOCK_WAIT:.0f} s; let it finish (or remove {path} if no build is "
                                       f"running) and try again") from None
                    time.sleep(0.02)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
        except OSError:  # no locks on this filesystem (ENOLCK, EOPNOTSUPP): unlocked, no file left
            os.close(fd)
            fd = None
            try:
                os.unlink(path)
            except OSError:
                pass
            break
        except BaseException:
            os.close(fd)
            raise
        if current:
            break
        os.close(fd)  # its holder removed it after we opened it: lock the one there now
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)


def recover(out: Path) -> None:
    """Clean up after builds that were killed: drop their partial output; if one died between
    its two renames, put the previous artifact back. Under ``out``'s lock (``swap_lock``)."""
    with swap_lock(out):
        _recover(out)


def _dead_builds(out: Path) -> list[tuple[str, Path]]:
    """What builds into ``out`` that died left beside it: ("building", their partial output) and ("old", the previous
    artifact one moved aside before its second rename)."""
    if not out.parent.is_dir():
        return []
    mine = re.compile(rf"\.{re.escape(out.name)}\.(building|old)-(\d+)")  # not another output's (art.v2)
    found = [(mine.fullmatch(p.name), p) for p in out.parent.iterdir()]
    return [(m.group(1), p) for m, p in found if m and not _pid_alive(int(m.group(2)))]


def _recover(out: Path) -> None:
    for kind, leftover in _dead_builds(out):
        if kind == "old" and not out.exists():
            os.replace(leftover, out)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def replace_with(tmp: Path, out: Path) -> None:
    """Swap the finished ``tmp`` in for ``out`` with two renames, under ``out``'s lock (``swap_lock``; what dead
    builds left is cleaned up first, as ``recover`` does). A rename that fails is an ``MxcError`` that leaves the
    previous artifact at ``out``, or, if it cannot be put back, says where it is."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with swap_lock(out):
        try:
            _recover(out)
            if old.exists() and not out.exists():  # this process's swap interrupted between its renames, or a dead
                os.replace(old, out)               # build's whose pid it reuses: the previous artifact, put back
        except OSError:  # leftovers that cannot be cleaned up do not stop this build
            pass
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
        moved = out.exists()
        try:
            _swap(tmp, out, old, moved)
        except BaseException:  # an interrupt (Ctrl-C) between the renames: the previous artifact goes back first
            if moved and old.exists() and not out.exists():
                try:
                    os.replace(old, out)
                except OSError:
                    pass  # said by _swap's error; else the next build into out puts it back (recover)
            raise
    shutil.rmtree(old, ignore_errors=True)  # outside the lock: the next build's turn need not wait for it


def _swap(tmp: Path, out: Path, old: Path, moved: bool) -> None:
    """The two renames: ``out`` (if ``moved``) aside to ``old``, then ``tmp`` to ``out``; a failure as one line."""
    if moved:
        try:
            os.replace(out, old)
        except OSError as e:
            raise MxcError(f"--out {out}: cannot move the previous artifact aside to put the new one there "
                           f"({e.strerror or e}); it is left in place; fix that and build again") from None
    try:
        os.replace(tmp, out)
    except OSError as e:
        why = e.strerror or str(e)
        if moved:
            try:
                os.replace(old, out)
            except OSError:
                raise MxcError(f"--out {out}: cannot move the new artifact there ({why}), nor the previous one "
                               f"back; it is in {old}: move it back to {out} by hand") from None
        kept = "; the previous artifact is left in place" if moved else ""
        raise MxcError(f"--out {out}: cannot move the new artifact there ({why}){kept}; fix that and build "
                       f"again") from None
