"""The compiler pipeline: one plain list of passes, run in order.

Each pass is a pure ``run(graph, options) -> Graph`` in ``passes/``. The
verifier runs after every pass; ``compile_graph`` can dump the IR after each
(``--dump-ir DIR``: ``00-bound.yaml``, ``01-merge_qkv.yaml``, ...). Optional passes
can be skipped (``--disable-pass``); the skipped ones leave no dump. The dumps of an earlier
build into the same DIR are removed first (a skipped pass's would read as this build's), and a
pass whose graph the verifier refuses has its dump written before the error: the last file is
where it broke.
"""

from __future__ import annotations

import re
from pathlib import Path

from mxc.compiler.options import BuildOptions
from mxc.errors import MxcError
from mxc.compiler.passes import (eliminate_dead_code, fuse_add_rms_norm, fuse_all_reduce, fuse_linear_all_reduce,
                                  fuse_linear_io, fuse_mlp, fuse_moe, fuse_norm_linear, fuse_norm_route, fuse_rope_cache,
                                  early_launch_o_proj, interleave_gate_up, merge_gate_up, merge_qkv, quantize,
                                  select_kernels, shard_tp)
from mxc.ir import Graph, VerifyError, dump_graph, verify

PIPELINE = [
    # fusion: fewer, larger GEMMs
    ("merge_qkv", merge_qkv.run),
    ("merge_gate_up", merge_gate_up.run),
    ("fuse_moe", fuse_moe.run),
    # parallelism: per-rank shapes, explicit all-reduce / all-gather (identity at tp=1)
    ("shard_tp", shard_tp.run),
    # fusion: fewer kernels and round trips through memory
    ("fuse_rope_cache", fuse_rope_cache.run),
    ("fuse_norm_linear", fuse_norm_linear.run),
    ("fuse_add_rms_norm", fuse_add_rms_norm.run),
    ("fuse_norm_route", fuse_norm_route.run),
    ("fuse_linear_io", fuse_linear_io.run),
    ("fuse_all_reduce", fuse_all_reduce.run),
    ("fuse_linear_all_reduce", fuse_linear_all_reduce.run),
    # quantization: fp8 weights + scales (identity without --quant)
    ("quantize", quantize.run),
    # fusion over quantized ops: the fp8 MLP as one op (SiLU in the gate/up GEMV's epilogue; --mlp-pair: one kernel)
    ("fuse_mlp", fuse_mlp.run),
    # layout: the fp8 MLP's gate and up rows interleaved, for SiLU-and-mul in the prefill GEMM's epilogue
    ("interleave_gate_up", interleave_gate_up.run),
    # launch order under PDL: the o projection's GEMV launched during the decode attention when it preloads
    ("early_launch_o_proj", early_launch_o_proj.run),
    # cleanup
    ("eliminate_dead_code", eliminate_dead_code.run),
    # lowering: every node claimed by a kernel for the target
    ("select_kernels", select_kernels.run),
]

# Passes that only make the program faster: ``--disable-pass NAME`` skips them (to measure a
# fusion's effect, or to work around one). The others carry meaning (sharding, quantization,
# kernel selection) and always run.
OPTIONAL = ("merge_qkv", "merge_gate_up", "fuse_moe", "fuse_rope_cache", "fuse_norm_linear",
            "fuse_add_rms_norm", "fuse_norm_route", "fuse_linear_io", "fuse_all_reduce",
            "fuse_linear_all_reduce", "fuse_mlp", "interleave_gate_up", "early_launch_o_proj",
            "eliminate_dead_code")


def check_disabled(names) -> tuple[str, ...]:
    """Validate ``--disable-pass`` names; return them as a sorted tuple."""
    for name in names:
        if name not in OPTIONAL:
            why = "it is required" if name in dict(PIPELINE) else "no such pass"
            raise MxcError(f"--disable-pass {name}: {why}; passes that can be disabled: {', '.join(OPTIONAL)}")
    return tuple(sorted(set(names)))


def compile_graph(graph: Graph, options: BuildOptions, dump_dir: Path | None = None) -> Graph:
    try:  # the bound graph is what the model file made of the config: a failure here is the user's input
        verify(graph)
    except VerifyError as e:
        raise MxcError(f"the model does not hold together with this config: {e}") from None
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        try:
            dump_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MxcError(f"--dump-ir {dump_dir}: cannot create the directory ({e.strerror})") from None
        _clear_dumps(dump_dir)
        _dump(dump_dir / "00-bound.yaml", graph)
    for i, (name, run) in enumerate(PIPELINE, start=1):
        if name in options.disable_passes:
            continue
        graph = run(graph, options)
        if dump_dir is not None:  # before verify: the graph a pass broke is the one to read
            _dump(dump_dir / f"{i:02d}-{name}.yaml", graph)
        verify(graph)
    return graph


def _clear_dumps(dump_dir: Path) -> None:
    """Remove an earlier build's dumps from ``dump_dir``: where this build skips a pass (``--disable-pass``) or
    stops early, its file would stay and read as this build's. Only ``NN-bound.yaml`` and ``NN-<pass>.yaml`` go:
    nothing else in the directory is touched."""
    dump_name = re.compile(r"\d{2}-(%s)\.yaml" % "|".join(map(re.escape, ["bound", *(n for n, _ in PIPELINE)])))
    try:
        for p in dump_dir.iterdir():
            if dump_name.fullmatch(p.name) and not p.is_dir():
                p.unlink()
    except OSError as e:
        raise MxcError(f"--dump-ir {dump_dir}: cannot remove an earlier build's dumps ({e.strerror or e})") from None


def _dump(path: Path, graph: Graph) -> None:
    try:
        path.write_text(dump_graph(graph))
    except OSError as e:
        raise MxcError(f"--dump-ir {path.parent}: cannot write {path.name} ({e.strerror or e})") from None
