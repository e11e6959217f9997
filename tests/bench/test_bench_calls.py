"""Every call a bench/ script makes into mxc, read from its source, binds to the current signature
(``inspect.signature(...).bind``) with the positional arguments and keywords the script passes, and every mxc name
it reaches (kernel module functions and constants, the loaded model's ``_decoder`` and its buckets,
``ForwardContext.build``...) exists: a benchmark failing on the GPU machine because an mxc internal changed wastes
that machine's scarce time. Read from the scripts, so a script edited later is checked as it then is."""


from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
import types
from pathlib import Path

import pytest

import mxc

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
# the benches whose calls into mxc internals must be found (the labs' are checked too)
MAIN_BENCHES = ["decode.py", "moe.py", "decode_ab.py", "ablate.py", "profile_step.py", "prefill_host.py",
                "prefill_gaps.py", "decode_tp.py"]

# --- the mxc names each script uses, against the current source ---------------------------------------------------
def _classes():
    from mxc.runtime.cuda_launch import CubinLauncher
    from mxc.runtime.decode_graphs import CudaDecoder, _Bucket
    from mxc.runtime.model import Model
    from mxc.runtime.prefill_graphs import PrefillGraph

    return Model, CudaDecoder, _Bucket, PrefillGraph, CubinLauncher


def _wrapped():
    """Public entry points that forward ``**kwargs``: checked against the function they forward to."""
    from mxc import builder
    from mxc.runtime import artifact

    return {mxc.build: builder.build, mxc.load: artifact.load}


MODEL_NAMES = {"model", "single", "head_model"}  # a loaded mxc Model wherever a script uses these names (HF's: hf_*)


def instance_attrs(cls) -> set[str]:
    """What an instance of ``cls`` has: its class's attributes, dataclass fields and every ``self.X = ...`` of its
    (and its bases') methods."""
    names = set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", {}))
    for klass in cls.__mro__:
        if klass.__module__.startswith("mxc"):
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            names.add(e.attr)
    return names


class _Inst:
    """An instance of ``cls`` (a script's loaded model, its decoder, a bucket...), or with ``items`` a dict of them."""

    def __init__(self, cls, items: bool = False):
        self.cls, self.items = cls, items


class Uses:
    """Walks one script: resolves every expression that reaches mxc (modules, their functions, classes and constants;
    the loaded model and what hangs off it), records a problem for a missing name or a call that does not bind."""

    def __init__(self, script: str, source: str | None = None):
        self.script = script
        self.tree = ast.parse(source if source is not None else (BENCH / script).read_text())
        self.problems: list[str] = []
        self.checked: set[str] = set()  # "qualified name" of every call bound
        Model, CudaDecoder, Bucket, PrefillGraph, CubinLauncher = _classes()
        self.attr_types = {(Model, "_decoder"): _Inst(CudaDecoder), (Model, "_launcher"): _Inst(CubinLauncher),
                           (CudaDecoder, "buckets"): _Inst(Bucket, True),
                           (CudaDecoder, "prefill_graphs"): _Inst(PrefillGraph, True)}
        self.Model = Model
        self.modules = self._imports()
        self.dicts = self._dict_literals()
        self._attrs: dict = {}

    # names
    def _imports(self) -> dict:
        names = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "mxc":
                        importlib.import_module(a.name)
                        names[a.asname or a.name.split(".")[0]] = sys.modules[a.asname and a.name or "mxc"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mxc":
                mod = importlib.import_module(node.module)
                for a in node.names:
                    try:
                        obj = getattr(mod, a.name) if hasattr(mod, a.name) else \
                            importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        self.problems.append(f"line {node.lineno}: from {node.module} import {a.name}: no such name")
                        continue
                    names[a.asname or a.name] = obj
        return names

    def _dict_literals(self) -> dict[str, set[str] | None]:
        """Names assigned ``dict(k=...)`` or ``{"k": ...}`` anywhere in the script: the keys (None: not all known)."""
        out: dict[str, set[str] | None] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                v, name = node.value, node.targets[0].id
                keys = None
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict" and not v.args:
                    keys = {k.arg for k in v.keywords} if all(k.arg for k in v.keywords) else None
                elif isinstance(v, ast.Dict) and all(isinstance(k, ast.Constant) for k in v.keys):
                    keys = {k.value for k in v.keys}
                else:
                    continue
                out[name] = keys if name not in out or out[name] == keys else None
        return out

    # types of local names, per function
    def _scope_types(self, fn, outer: dict) -> dict:
        types_ = dict(outer)
        if fn is not None:
            for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
                types_.pop(a.arg, None)
                if a.arg in MODEL_NAMES and not fn.name.startswith("hf_"):
                    types_[a.arg] = _Inst(self.Model)
        body = fn.body if fn is not None else self.tree.body
        for node in _walk_scope(body):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    names = [t] if isinstance(t, ast.Name) else [e for e in getattr(t, "elts", [])
                                                                    if isinstance(e, ast.Name)]
                    for n in names:
                        types_.pop(n.id, None)
                    if isinstance(t, ast.Name):
                        kind = self._value(node.value, types_, check=False)
                        if isinstance(kind, _Inst) and not kind.items:
                            types_[t.id] = kind
                    elif isinstance(t, ast.Tuple) and t.elts and isinstance(t.elts[0], ast.Name) \
                            and t.elts[0].id in MODEL_NAMES:  # model, ids = a bench helper(...)
                        types_[t.elts[0].id] = _Inst(self.Model)
        return types_

    def _value(self, e, types_: dict, check: bool = True):
        """What ``e`` evaluates to where it reaches mxc: a Python object (module, function, class, constant), an
        ``_Inst``, or None (not mxc's, or not known)."""
        if isinstance(e, ast.Name):
            return types_[e.id] if e.id in types_ else self.modules.get(e.id)
        if isinstance(e, ast.Attribute):
            base = self._value(e.value, types_, check)
            if base is None:
                return None
            if isinstance(base, _Inst):
                if base.items:
                    return None
                if e.attr not in self._instance_attrs(base.cls):
                    self._problem(check, e, f"{base.cls.__name__} has no attribute {e.attr}")
                    return None
                kind = self.attr_types.get((base.cls, e.attr))
                if kind is not None:
                    return kind
                return getattr(base.cls, e.attr, None) if callable(getattr(base.cls, e.attr, None)) else None
            if not _is_mxc(base):
                return None
            if not hasattr(base, e.attr):
                if isinstance(base, types.ModuleType):
                    try:
                        return importlib.import_module(f"{base.__name__}.{e.attr}")
                    except ImportError:
                        pass
                self._problem(check, e, f"{getattr(base, '__name__', base)} has no attribute {e.attr}")
                return None
            return getattr(base, e.attr)
        if isinstance(e, ast.Subscript):
            base = self._value(e.value, types_, check)
            return _Inst(base.cls) if isinstance(base, _Inst) and base.items else None
        if isinstance(e, ast.Call):
            if isinstance(e.func, ast.Name) and e.func.id == "type" and len(e.args) == 1:
                inst = self._value(e.args[0], types_, check)
                return inst.cls if isinstance(inst, _Inst) and not inst.items else None
            fn = self._value(e.func, types_, check)
            if fn is mxc.load or fn is _wrapped()[mxc.load]:
                return _Inst(self.Model)
        return None

    def _instance_attrs(self, cls) -> set[str]:
        if cls not in self._attrs:
            self._attrs[cls] = instance_attrs(cls)
        return self._attrs[cls]

    def _problem(self, check: bool, node, text: str) -> None:
        if check:
            self.problems.append(f"line {node.lineno}: {ast.unparse(node)[:100]}: {text}")

    def _bind(self, call: ast.Call, fn, types_: dict) -> None:
        fn = _wrapped().get(fn, fn) if _hashable(fn) else fn
        if not callable(fn) or not _is_mxc(fn):
            return
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        method = isinstance(call.func, ast.Attribute) and isinstance(self._value(call.func.value, types_, False),
                                                                     _Inst)
        args = [None] * (len(call.args) + method)
        kwargs, unknown = {}, any(isinstance(a, ast.Starred) for a in call.args)
        for k in call.keywords:
            if k.arg is not None:
                kwargs[k.arg] = None
            elif isinstance(k.value, ast.Name) and self.dicts.get(k.value.id) is not None:
                kwargs.update(dict.fromkeys(self.dicts[k.value.id]))
            else:
                unknown = True
        params = sig.parameters
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        for k in kwargs:
            if k not in named and not takes_kwargs:
                self._problem(True, call, f"{_qualname(fn)} takes no keyword {k} (takes {sig})")
                return
        if not unknown:
            try:
                sig.bind(*args, **kwargs)
            except TypeError as err:
                self._problem(True, call, f"{_qualname(fn)}{sig}: {err}")
                return
        self.checked.add(_qualname(fn))

    def run(self) -> "Uses":
        self._visit(self.tree.body, self._scope_types(None, {}))
        return self

    def _visit(self, body, types_: dict) -> None:
        for node in _walk_scope(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if isinstance(node, ast.Lambda):
                    continue
                self._visit(node.body, self._scope_types(node, types_))
            elif isinstance(node, ast.Attribute):
                self._value(node, types_)
            elif isinstance(node, ast.Call):
                fn = self._value(node.func, types_, check=False)
                if fn is not None and not isinstance(fn, _Inst):
                    self._bind(node, fn, types_)


def _walk_scope(body):
    """The nodes of ``body``, nested function definitions themselves but not their insides."""
    todo = list(reversed(body))
    while todo:  # in source order: a name's type comes from the assignments above its use
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(reversed(list(ast.iter_child_nodes(node))))


def _is_mxc(obj) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None) or ""
    return isinstance(name, str) and name.split(".")[0] == "mxc"


def _hashable(obj) -> bool:
    try:
        hash(obj)
        return True
    except TypeError:
        return False


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


# what each main bench's check must reach (a walk that lost track of the model would check nothing and pass)
MUST_BIND = {
    "decode.py": {"builder.build", "artifact.load", "Model.generate"},
    "moe.py": {"builder.build", "artifact.load", "Model.generate", "moe_ref.route", "moe_ref.fused_moe",
               "triton_moe.fused_moe", "triton_moe_decode.fused_moe"},
    "decode_ab.py": {"builder.build", "artifact.load", "Model.generate", "CudaDecoder.drop_graphs"},
    "ablate.py": {"builder.build", "artifact.load", "Model.generate", "CudaDecoder.drop_graphs", "_Bucket.step"},
    "profile_step.py": {"Model.generate", "CudaDecoder.drop_graphs", "_Bucket.step", "CubinLauncher.plain"},
    "prefill_host.py": {"builder.build", "artifact.load", "CudaDecoder.prefill"},
    "prefill_gaps.py": {"CudaDecoder.prefill", "PrefillGraph.run", "ForwardContext.build", "Model._run",
                        "context.host_arrays", "graph_capture.capture", "runtime_buckets.padded_prefill"},
    "decode_tp.py": {"builder.build", "artifact.load", "Model.generate", "ranks.run_ranks"},
}
assert set(MUST_BIND) == set(MAIN_BENCHES)


@pytest.fixture(scope="module")
def uses():
    return {script: Uses(script).run() for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_mxc_uses_bind(uses, script):
    """Every mxc name the script reaches exists, and every call of an mxc function, class or method binds to its
    current signature with the script's positional arguments and keywords."""
    u = uses[script]
    assert not u.problems, f"bench/{script} against the current mxc:\n" + "\n".join(u.problems)
    missing = {m for m in MUST_BIND.get(script, ()) if not any(c.endswith("." + m) for c in u.checked)}
    assert not missing, f"bench/{script}: calls not found (renamed in the script? update MUST_BIND): {missing}"


def test_mxc_uses_catches_a_changed_signature():
    """The walk itself: calls that no longer fit are reported (a keyword renamed, a positional too many, a method
    or a constant gone, a keyword of mxc.build misspelt, an attribute of the decoder gone)."""
    source = '''
import mxc
from mxc.runtime import decode_graphs
from mxc.kernels import moe_ref

def forward(model, ids2d):
    d = model._decoder
    d.prefill(ids2d, graph=False)
    d.prefill(ids2d, True, None, 1)
    d.prefill_gone(ids2d)
    bucket = d.buckets[1]
    bucket.begin_greedy(d, ids2d)
    return d.no_such_attr, decode_graphs.NO_SUCH_CONSTANT

def main():
    common = dict(target="cuda", dtpye="bfloat16")
    art = mxc.build("llama.yaml", out="x", **common)
    single = mxc.load(art, device="cuda", verfiy=False)
    single.generate([[1]], max_new=1)
    moe_ref.route(1, 2, renormalise=True)
'''
    problems = "\n".join(Uses("synthetic.py", source).run().problems)
    for text in ["graph=False", "prefill(ids2d, True, None, 1)", "prefill_gone", "begin_greedy(d, ids2d)",
                 "no_such_attr", "NO_SUCH_CONSTANT", "takes no keyword dtpye", "takes no keyword verfiy",
                 "takes no keyword max_new", "takes no keyword renormalise"]:
        assert text in problems, f"{text!r} not reported:\n{problems}"


