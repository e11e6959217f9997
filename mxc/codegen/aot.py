"""Ahead-of-time compilation: the kernels a forward program launches -> cubins in the artifact.

``record(program, ...)`` runs the generated forward on ``meta`` tensors under
a recording launcher, once per token-count bucket the runtime will use, and
returns the set of launch specs (kernel, argument types, constexprs, warps,
stages). ``compile_specs`` compiles each with ``triton.compile`` for the
target (sm_90 by default; this works on a machine without a GPU, Triton ships
ptxas) and writes ``code/kernels/<key>.cubin`` plus ``index.json`` with what
the runtime's launcher needs: the entry name, shared memory, warps and the
exact parameter list read from the PTX (Triton appends scratch pointers whose
number depends on its version). Kernels rendered from templates
(``kernel_templates``) have their source written beside the cubins, in
``src/``, named in their index entry with the template and parameters it was
rendered from; the runtime executes those stored sources
(``kernel_templates.pin``), and ``record`` renders the current templates.
Pointer arguments are compiled as 16-byte aligned; the runtime checks that
before each launch. A host tensor descriptor argument (``launch.is_descriptor``) is compiled for TMA: its
PTX parameters are the 128-byte ``CUtensorMap`` (kind ``tmap``) and the tensor's shape and strides, and the
index entry keeps Triton's ``tensordesc_meta`` (swizzle, element type, the box each TMA copy moves), from which
the runtime encodes the map at launch (``runtime.cuda_launch``). A kernel compiled for programmatic dependent
launch is refused if its PTX touches, before ``griddepcontrol.wait``, a pointer argument it does not declare
(``mxc.codegen.pdl_check``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import re
import sys
import types
from pathlib import Path

from tqdm import tqdm

from mxc.codegen import pdl_check
from mxc.kernels import kernel_templates
from mxc.kernels.launch import descriptor_rank
from mxc.errors import MxcError

_PARAM_KINDS = [(r"\.align\s+64\s+\.b8\s+\w+\[128\]", "tmap"), (r"\.u64\s+\.ptr", "ptr"),
                (r"\.(u|s|b)64", "i64"), (r"\.(u|s|b)32", "i32"), (r"\.f32", "f32"),
                (r"\.f64", "f64"), (r"\.(u|s|b)8", "i8"), (r"\.(u|s|b)16", "i16")]


def ptx_params(ptx: str, name: str) -> list[str]:
    """Kinds of the entry's parameters, in order, from its PTX declaration."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise RuntimeError(f"entry {name} not found in PTX")
    kinds = []
    for decl in [d for d in m.group(1).split(",") if d.strip()]:
        for pattern, kind in _PARAM_KINDS:
            if re.search(r"\.param\s+" + pattern, decl):
                kinds.append(kind)
                break
        else:
            raise RuntimeError(f"unrecognised PTX parameter {decl.strip()!r} in {name}")
    return kinds


def param_names(signature: dict[str, str]) -> list[str]:
    """The runtime arguments' names as the PTX parameters list them: a descriptor is its map, then its shape
    and strides (``name.shape``, ``name.strides``, one a dimension)."""
    names = []
    for n, t in signature.items():
        if t == "constexpr":
            continue
        names.append(n)
        rank = descriptor_rank(t)
        if rank:
            names += [f"{n}.shape"] * rank + [f"{n}.strides"] * rank
    return names


def _jit_function(kernel: str, source: str | None = None):
    module, _, name = kernel.partition(":")
    if source is not None:  # a kernel rendered from a template: execute its source in this process
        kernel_templates.load(module, source)
    fn = getattr(importlib.import_module(module), name)
    if not hasattr(fn, "params"):
        raise MxcError("cannot compile kernels ahead of time under TRITON_INTERPRET=1; unset it and rebuild")
    return fn


@contextlib.contextmanager
def _without_line_info():
    """Compile with no source line info (``TRITON_DISABLE_LINE_INFO``, a key of Triton's cache): with it, every cubin
    carried the absolute directories of mxc's and Triton's sources on the build machine (``/home/<user>/...``), so
    builds of the same inputs from two checkouts or virtual environments differed, and an artifact told where it was
    built. The machine code is the same; the cubins lose their debug sections (line tables, the PTX text)."""
    key = "TRITON_DISABLE_LINE_INFO"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _compile_one(key: str, spec: dict, arch: int, source: str | None) -> tuple[str, bytes, dict]:
    """Compile one spec (in a worker process, or the caller's; ``source``: the rendered module of a generated
    kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(spec["kernel"], source)
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
               for n, t in spec["signature"].items() if t.startswith("*")}
    src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=aligned)
    with _without_line_info():
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                           "enable_fp_fusion": True})
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise MxcError(f"kernel {spec['kernel']} needs Triton scratch memory, which the AOT launcher does not provide")
    descriptors = [t for t in spec["signature"].values() if descriptor_rank(t)]
    tensordesc = [dict(m) for m in (getattr(md, "tensordesc_meta", None) or [])]
    if descriptors and len(tensordesc) != len(descriptors):
        raise MxcError(f"kernel {spec['kernel']}: its tensor descriptors were not lowered to TMA on sm_{arch} "
                       f"(Triton gave {len(tensordesc)} maps for {len(descriptors)} descriptors); the AOT launcher "
                       f"passes descriptors as TMA maps only")
    pdl = bool(spec["constexprs"].get("USE_PDL"))
    if pdl and "griddepcontrol.wait" not in compiled.asm["ptx"]:
        raise MxcError(f"kernel {spec['kernel']}: built with USE_PDL but its PTX has no griddepcontrol.wait")
    if pdl:
        found = pdl_check.violations(compiled.asm["ptx"], md.name, param_names(spec["signature"]),
                                     getattr(fn, "reads_before_wait", frozenset()))
        if found:
            raise MxcError(f"kernel {spec['kernel']} {found[0]}: under PDL the kernel ahead may still be running; "
                           f"move it after pdl_enter (a read of memory no kernel of the step writes may instead be "
                           f"declared with pdl.reads_before_wait)" + (f"; and {len(found) - 1} more" if found[1:] else ""))
    entry = {"kernel": spec["kernel"], "entry": md.name, "file": f"{key}.cubin", "shared": md.shared, "pdl": pdl,
             "num_warps": md.num_warps, "params": ptx_params(compiled.asm["ptx"], md.name),
             "args": [t for t in spec["signature"].values() if t != "constexpr"]}
    if tensordesc:
        entry["tensordesc"] = tensordesc
    return key, compiled.asm["cubin"], entry


@contextlib.contextmanager
def _workers_without_main():
    """While the pool starts its workers (on the submitting thread, ``spawn``): hide the caller's ``__main__``.
    A spawned process runs the parent's main script again (as ``__mp_main__``) so that functions defined there
    unpickle; the workers run mxc's own functions only. A script calling ``mxc.build`` without an
    ``if __name__ == "__main__":`` guard would otherwise run again in every worker, and fail there."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to re-run
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def compile_specs(specs: dict[str, dict], out_dir: Path, arch: int = 90, progress: bool = True,
                  workers: int | None = None) -> dict:
    """Compile every spec for sm_<arch> in ``workers`` processes (None: one a core; 1: in this process, with no
    pool to start, as when the caller runs several builds at once); write cubins, the rendered sources of
    generated kernels (``src/<module>.py``) and index.json; return the index. The files do not depend on
    ``workers``."""
    from concurrent.futures import ProcessPoolExecutor

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = {}  # generated module -> its rendered source, for the workers and the artifact
    for spec in specs.values():
        module = spec["kernel"].partition(":")[0]
        if kernel_templates.is_generated(module) and module not in sources:
            sources[module] = kernel_templates.source(module)
    if sources:
        (out_dir / "src").mkdir(exist_ok=True)
        for module, text in sources.items():
            (out_dir / "src" / f"{module.partition('.')[2]}.py").write_text(text)
    workers = workers or max(1, min(len(specs), os.cpu_count() or 1))
    args = [(key, spec, arch, sources.get(spec["kernel"].partition(":")[0])) for key, spec in sorted(specs.items())]
    index = {}

    def write(results):
        for key, cubin, entry in tqdm(results, total=len(args), desc=f"compiling kernels for sm_{arch}",
                                      unit="kernel", disable=not progress, leave=False):
            module = entry["kernel"].partition(":")[0]
            if module in sources:
                template, params = kernel_templates.origin(module)
                entry.update(source=f"src/{module.partition('.')[2]}.py", template=template,
                             template_params=params)
            (out_dir / f"{key}.cubin").write_bytes(cubin)
            index[key] = entry

    if workers == 1:
        write(_compile_one(*a) for a in args)
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            with _workers_without_main():  # the pool starts its processes as jobs are submitted
                jobs = [pool.submit(_compile_one, *a) for a in args]
            write(job.result() for job in jobs)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def triton_version() -> str:
    import triton

    return triton.__version__


def scenarios(max_batch: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) the runtime will run: decode per batch bucket, and prefills
    of T = 2^j + 1 tokens up to ``max_batch * max_seq_len`` (and that maximum itself).

    Kernels pick their configs by power-of-two token buckets (the GEMV's M, the fused MoE's
    BLOCK_M and sort chunk, attention tiles by prompt length), so one prefill in each bucket
    records every binary a prefill can need. A prefill longer than ``max_seq_len`` is spread over
    ``ceil(T / max_seq_len)`` sequences, which keeps B * S in T's bucket.
    """
    from mxc.runtime_buckets import batch_buckets

    decode = [(b, 1) for b in batch_buckets(max_batch)]
    most = max_batch * max_seq_len
    totals = sorted({t for t in (2 ** j + 1 for j in range(most.bit_length())) if t <= most} | {most} - {1})
    prefill = []
    for t in totals:
        b = -(-t // max_seq_len)
        prefill.append((b, -(-t // b)))
    return decode + prefill


def record(program, graph, max_batch: int, max_seq_len: int, pdl: bool = False,
           prefill_graph_tokens: int = 0) -> dict[str, dict]:
    """Every kernel launch the forward program makes in the runtime's scenarios, as specs.

    The KV cache has ``max_batch + 1`` slots: the last one absorbs the rows that
    pad a batch up to its bucket, and a short prompt up to its prefill graph's length (a second
    sequence: ``runtime.prefill_graphs``).
    """
    from mxc.kernels import launch
    from mxc.runtime_buckets import padded_prefill, prefill_graph_buckets

    forward = meta_forward(program, graph, max_batch, max_seq_len)
    recorder = launch.Recorder(pdl=pdl)
    # a build renders the current templates, whatever artifact this process has loaded
    with launch.using(recorder), kernel_templates.unpinned():
        for b, t in scenarios(max_batch, max_seq_len):
            # a prefill asks for the logits of every row (``Model.logits``) or of each sequence's
            # last row (generate: M = sequences, the decode scenarios' LM-head shapes)
            forward([t] * b, list(range(b)), b * t if t > 1 else b)
        for t in prefill_graph_buckets(prefill_graph_tokens, max_seq_len):  # the prompt's last row only
            seq_lens, _, slots = padded_prefill(t, t, max_batch)
            forward(seq_lens, slots, 1)
    return recorder.specs


def meta_forward(program, graph, max_batch: int, max_seq_len: int):
    """``forward(seq_lens, slots, rows)``: the program's forward on meta tensors (no memory, no work: the kernels'
    launches alone, for whatever launcher is current) for sequences of ``seq_lens`` new tokens in cache ``slots``,
    asking for ``rows`` logit rows, over a KV cache of ``max_batch + 1`` slots of ``max_seq_len`` rows."""
    import torch

    from mxc.artifact_format import WEIGHT_DTYPES as DTYPES
    from mxc.kernels.context import ForwardContext

    meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    w = {k: meta(v.shape, DTYPES[v.dtype]) for k, v in graph.weights.items()}
    layers, kv = [], None
    for rep in graph.repeats():
        layers = [{k: meta(v.shape, DTYPES[v.dtype]) for k, v in rep.weights.items()} for _ in range(rep.count)]
    for node, rep in graph.nodes():
        if node.op == "qkv_rope_cache":
            kv = (rep.count if rep else 1, node.attrs["kv_heads"], node.attrs["head_dim"])
    dtype = DTYPES[graph.dtype]

    def forward(seq_lens: list[int], slots: list[int], rows: int) -> None:
        b, t = len(seq_lens), sum(seq_lens)
        caches = [[meta((max_batch + 1, max_seq_len, kv[1], kv[2]), dtype) for _ in range(kv[0])]
                  for _ in range(2)] if kv else [None, None]
        ctx = ForwardContext(seq_lens, [0] * b, slots, caches[0], caches[1], cache_loc=meta((t,), torch.int64),
                             kv_lens=meta((b,), torch.int32), slots_t=meta((b,), torch.int32),
                             q_start=meta((b + 1,), torch.int32), max_q_len=max(seq_lens), decode=max(seq_lens) == 1)
        program.forward(w, layers, ctx, meta((t,), torch.int64), meta((t,), torch.int64), meta((rows,), torch.int64))

    return forward
