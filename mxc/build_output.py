"""Where a build writes: ``--out`` and ``--dump-ir`` checked before the long work (writable, never another
program's folder, never inside an artifact, room for the weights), and the swap at the end: the finished
temporary sibling directory replaces ``out`` with two renames (``replace_with``), and the next build cleans up
after one that was killed between them (``recover``)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

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
    free = usage.free
    if usage.total and need > free:  # a filesystem reporting no size at all (some pseudo mounts) is not judged
        raise MxcError(f"--out {out}: the artifact's weights take {'at least ' * at_least}{size_text(need)} and "
                       f"{base} has {size_text(free)} "
                       f"free; free some space or choose another --out")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(out: Path) -> None:
    """Clean up after builds that were killed: drop their partial output; if one died between
    its two renames, put the previous artifact back."""
    mine = re.compile(rf"\.{re.escape(out.name)}\.(building|old)-(\d+)")  # not another output's (art.v2)
    for leftover in out.parent.iterdir():
        found = mine.fullmatch(leftover.name)
        if not found or _pid_alive(int(found.group(2))):
            continue
        if found.group(1) == "old" and not out.exists():
            os.replace(leftover, out)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def replace_with(tmp: Path, out: Path) -> None:
    """Swap the finished ``tmp`` in for ``out`` with two renames."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)  # a leftover of a dead build whose pid this one reuses
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
