"""Triton kernels rendered from jinja2 templates, one module per specialisation.

The fused operations the IR presents (RMSNorm with or without the residual
add, q/k norm + RoPE + QKV split + KV-cache write, SiLU-and-mul, embedding
gather, the residual add, decode and prefill attention, the push all-reduce)
are written once as templates in ``mxc/kernels/templates/<name>.py.j2``. ``kernel(name, entry,
**params)`` renders one for a node's static parameters (sizes, head counts,
which fusions it carries, the sliding window): the sizes become literal
constexprs in the kernel body and the fusion variants template branches, so a
kernel takes only the pointers it reads and writes. Tile sizes a tuner may
change (splits, blocks) stay constexpr parameters of the rendered kernel.

A rendered module is named ``mxc_generated.<name>_<sha256 of its source>``:
the same source always gets the same name, so a launch's spec (and the key of
its cubin in the artifact) names the kernel source it was compiled from. The
inner loops shared by several kernels stay hand-written ``@triton.jit``
helpers in ``mxc.kernels``, which the templates import: they are not part of
the rendered source or its name. The module is executed from memory; its
source is registered with ``linecache`` (and its loader) so Triton and
tracebacks can read it. ``source(module)`` gives a rendered module's text: the
AOT build writes them into the artifact next to their cubins
(``code/kernels/src/``), with the template and parameters in the index, and
hands them to its compile workers. At load, ``pin`` makes the kernel
functions the artifact's stored sources rather than a fresh rendering, so a
later edit of a template does not change what an existing artifact runs.
The registry lives with the kernels, so their wrappers and the runtime's
launcher use it without reaching back into ``mxc.codegen``, which reads it to
write the sources into the artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import sys
import types
from pathlib import Path

import jinja2

from mxc.errors import MxcError

PACKAGE = "mxc_generated"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                          undefined=jinja2.StrictUndefined)
_ORIGINS: dict[str, tuple[str, dict]] = {}  # module name -> (template, params)
_PINNED: dict[tuple, str] = {}  # (template, params key) -> module name, from an artifact
_KERNELS: dict[tuple, object] = {}  # (pins in use, template, entry, params key) -> jit function
# the same by the call's parameters as given (their order and types; no sort): the lookup every launch makes
_FAST: dict[tuple, object] = {}
_STATE = {"use_pins": True}


class _SourceLoader:
    """Gives a rendered module's source to ``linecache``/``inspect`` (Triton reads kernels' source)."""

    def __init__(self, source: str):
        self.source = source

    def get_source(self, name: str) -> str:
        return self.source


def render(template: str, **params) -> str:
    """The source of ``templates/<template>.py.j2`` for ``params``."""
    return _ENV.get_template(f"{template}.py.j2").render(params=params, **params)


def load(module_name: str, source: str) -> types.ModuleType:
    """Execute a rendered ``source`` as ``module_name`` (once; later calls return the module)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    filename = f"{module_name}.py"  # no such file: linecache falls back to the loader (not for "<...>" names)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    module.__loader__ = _SourceLoader(source)  # lets linecache reload it if its cache is cleared
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own rendered template
    sys.modules[module_name] = module
    return module


def params_key(params: dict) -> tuple:
    """A hashable key of template parameters that tells 1, 1.0 and True apart (lists as tuples)."""
    return tuple(sorted((k, type(v).__name__, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


def pin(template: str, params: dict, module_name: str, source: str) -> None:
    """Make ``kernel(template, ..., **params)`` return the functions of ``source`` (an artifact's stored
    kernel module) instead of rendering the template: a loaded artifact runs the kernels it was built
    with, whatever this mxc's templates say now. Builds ignore pins (``unpinned``)."""
    digest = module_name.rpartition("_")[2]
    if hashlib.sha256(source.encode()).hexdigest()[:16] != digest:
        raise MxcError(f"the stored kernel source of {module_name} does not match its name (edited after the "
                       f"build?); rebuild the artifact")
    load(module_name, source)
    _ORIGINS[module_name] = (template, params)
    key = params_key(params)
    _PINNED[(template, key)] = module_name
    for k in [k for k in _KERNELS if k[0] and k[1] == template and k[3] == key]:
        del _KERNELS[k]  # looked up before this pin: look up again
    _FAST.clear()


@contextlib.contextmanager
def unpinned():
    """Render the templates as they are inside this block, whatever artifacts this process has loaded
    (the build: a new artifact is made from the current templates)."""
    previous, _STATE["use_pins"] = _STATE["use_pins"], False
    try:
        yield
    finally:
        _STATE["use_pins"] = previous


def _module(template: str, params: dict, use_pins: bool) -> types.ModuleType:
    pinned = _PINNED.get((template, params_key(params))) if use_pins else None
    if pinned is not None:
        return sys.modules[pinned]
    source = render(template, **params)
    name = f"{PACKAGE}.{template}_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    _ORIGINS.setdefault(name, (template, params))
    return load(name, source)


def kernel(template: str, entry: str, **params):
    """The ``@triton.jit`` function ``entry`` of ``template`` rendered for ``params`` (JSON values)."""
    use_pins = _STATE["use_pins"]
    try:  # 1, 1.0 and True hash alike: their types are in the key
        fast = (use_pins, template, entry, tuple(params.items()), tuple(map(type, params.values())))
        fn = _FAST.get(fast)
    except TypeError:  # a list value: only the sorted key
        fast, fn = None, None
    if fn is None:
        key = (use_pins, template, entry, params_key(params))
        fn = _KERNELS.get(key)
        if fn is None:
            fn = _KERNELS[key] = getattr(_module(template, params, use_pins), entry)
        if fast is not None:
            _FAST[fast] = fn
    return fn


def origin(module_name: str) -> tuple[str, dict] | None:
    """(template, params) a generated module was rendered from, if this process rendered or pinned it."""
    return _ORIGINS.get(module_name)


def is_generated(module_name: str) -> bool:
    return module_name.startswith(PACKAGE + ".")


def source(module_name: str) -> str:
    """The rendered source of a generated module (KeyError if this process has not rendered it)."""
    return sys.modules[module_name].__loader__.source
