"""What a checkpoint's files are before anything reads them, and reading its small JSON files.

A checkpoint directory is a user's, often a Hugging Face cache snapshot of symlinks: an entry may be a broken
symlink (an interrupted download), a directory, a FIFO or a device (``/dev/zero``) under a file's name. ``not_a_file``
says which, ``check_readable`` opens a file without blocking on a FIFO to report an OS error (no permission) as
the OS words it, and ``read_json`` reads config.json, generation_config.json and the shard indexes: a regular file
(symlinks followed) of at most ``MAX_JSON_BYTES``, UTF-8 JSON, nested as deep as Python parses. Each problem is a
one-line ``MxcError`` naming the file; nothing hangs or reads forever.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from mxc.errors import MxcError, first_line, size_text

MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON metadata: config.json is KiBs, a 1000-shard index a few MiB


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the ``st_mode`` is, as messages say it."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    what = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "something else")
    return f"is not a regular file ({what})"


def not_a_file(path: Path) -> str | None:
    """None where ``path`` is a regular file (symlinks followed); else why not: "does not exist", "is a broken
    symlink", "is a directory", "is not a regular file (a FIFO)", ..."""
    try:
        return _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "is a broken symlink" if os.path.islink(path) else "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"


def _open(path: Path, what: str) -> int:
    """A descriptor of the regular file ``path``, opened without blocking (a FIFO's open waits for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MxcError(f"{path}: cannot read it as {what} ({e.strerror})") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise MxcError(f"{path}: cannot read it as {what}: it {kind}")
    return fd


def check_readable(path: Path, what: str) -> None:
    """``path`` is a regular file this process may open, or a one-line error with the OS's reason."""
    os.close(_open(path, what))


def read_json(path: Path, what: str, missing: str) -> object:
    """The JSON value in the file ``path`` (``what`` it is, for messages: "a config.json"); ``missing`` is the advice
    when it does not exist."""
    if not os.path.lexists(path):
        raise MxcError(f"{path}: not found; {missing}")
    if os.path.islink(path) and not os.path.exists(path):
        raise MxcError(f"{path}: a broken symlink (an interrupted download?); {missing}")
    fd = _open(path, what)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        try:
            data = f.read(MAX_JSON_BYTES + 1) if size <= MAX_JSON_BYTES else b""
        except OSError as e:  # an I/O error of the disk or the network file system
            raise MxcError(f"{path}: cannot read it as {what} ({e.strerror})") from None
    if size > MAX_JSON_BYTES or len(data) > MAX_JSON_BYTES:
        raise MxcError(f"{path}: {size_text(max(size, len(data)))}, past the {size_text(MAX_JSON_BYTES)} mxc reads of "
                       f"JSON metadata; is it {what}?")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MxcError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise MxcError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise MxcError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise MxcError(f"{path}: not valid JSON ({first_line(e)})") from None
