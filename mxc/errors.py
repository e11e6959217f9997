"""The exception type for user-facing errors (``MxcError``, and its ``ConfigError``), and how their messages
write sizes (``size_text``) and quote a caught exception (``first_line``; ``typed_line`` with its type).

Anything a user can cause (a bad YAML file, a missing tensor, a tampered
artifact, an id outside the vocabulary) raises ``MxcError`` with a one-line,
actionable message: which file, which field, what was expected. The CLI prints
it as ``mxc: error: ...`` and exits non-zero; everything else is a bug and keeps
its traceback.
"""


class MxcError(Exception):
    """A user error with a one-line message."""


class ConfigError(MxcError):
    """An MxcError about a field of the model's config, raised where the file's path is unknown (RoPE's
    normalisation, the registry's resolvers): it reads ``config.json: ...`` until ``at(path)`` names the file."""

    def __init__(self, message: str, source: str = "config.json"):
        super().__init__(f"{source}: {message}")
        self.message = message

    def at(self, source: str) -> "ConfigError":
        return ConfigError(self.message, source)


def size_text(nbytes: int) -> str:
    """``nbytes`` as the error messages write sizes: GiB, MiB or KiB, one decimal."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def first_line(e: BaseException) -> str:
    """A caught exception as a one-line message quotes it: its message's first line, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def typed_line(e: BaseException) -> str:
    """``first_line`` after the exception's type name (``KeyError: 'x'``), or the type's name alone if it has no
    message."""
    return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__
