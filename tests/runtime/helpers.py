"""Helpers of the runtime tests."""

from __future__ import annotations

import pytest

import mxc
from mxc.errors import MxcError


def refused(path, pattern, **kw) -> str:
    """``mxc.load(path, **kw)`` fails with a one-line MxcError matching ``pattern``; its message."""
    with pytest.raises(MxcError, match=pattern) as e:
        mxc.load(path, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)
