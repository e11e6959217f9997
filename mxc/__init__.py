"""mxc: an ahead-of-time model builder for LLM inference.

Library entry points: ``mxc.build`` (model definition + checkpoint -> artifact)
and ``mxc.load`` (artifact -> runnable model).
"""

__version__ = "0.1.0"

from mxc.errors import MxcError


def load(path, device=None, **kwargs):
    """Load a built artifact; see :func:`mxc.runtime.artifact.load`."""
    from mxc.runtime.artifact import load as _load

    return _load(path, device=device, **kwargs)


def build(source, **kwargs):
    """Build an artifact; see :func:`mxc.builder.build`."""
    from mxc.builder import build as _build

    return _build(source, **kwargs)


__all__ = ["MxcError", "build", "load", "__version__"]
