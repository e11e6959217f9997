"""The one exception type for user-facing errors.

Anything a user can cause (a bad YAML file, a missing tensor, a tampered
artifact, an id outside the vocabulary) raises ``MxcError`` with a one-line,
actionable message: which file, which field, what was expected. The CLI prints
it as ``mxc: error: ...`` and exits non-zero; everything else is a bug and keeps
its traceback.
"""


class MxcError(Exception):
    """A user error with a one-line message."""
