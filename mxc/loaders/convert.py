"""Streaming weight conversion: checkpoint tensors -> the artifact's rank shard.

For every weight of the final graph (layers expanded), reads its checkpoint
parts one at a time, checks their shapes, applies the transforms the passes
declared (concatenate ``segments`` along dim 0, cast to the weight's dtype)
and writes it straight into a ``SafetensorsWriter`` whose header was computed
from the IR. Peak memory is about one weight. Before any data moves, the
checkpoint's names are checked against the graph: a missing, unexpected or
mis-shaped tensor fails with its name and the shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tqdm import tqdm

from mxc.errors import MxcError
from mxc.ir import Graph, Weight
from mxc.loaders.safetensors_writer import SafetensorsWriter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parts(w: Weight) -> list[tuple[str, tuple[int, ...]]]:
    rows = w.segments or (w.shape[0],)
    return [(hf, (r,) + w.shape[1:]) for hf, r in zip(w.hf, rows)]


def _ignored(patterns: tuple[str, ...]) -> re.Pattern:
    regex = "|".join(re.escape(p).replace(re.escape("{i}"), r"\d+") for p in patterns) or r"(?!)"
    return re.compile(f"^(?:{regex})$")


def check_names(graph: Graph, ckpt) -> None:
    """Fail on a checkpoint tensor that is missing, unexpected or mis-shaped."""
    where = ckpt.directory
    have = set(ckpt.names())
    wanted: dict[str, tuple[tuple[int, ...], str]] = {}
    for w in graph.all_weights():
        for hf, shape in _parts(w):
            wanted[hf] = (shape, w.name)
    missing = [n for n in wanted if n not in have]
    if missing:
        shape, used_by = wanted[missing[0]]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MxcError(f"{where}: missing tensor {missing[0]!r} (expected shape {list(shape)}, "
                       f"for weight {used_by}){more}")
    ignored = _ignored(graph.ignore)
    unexpected = sorted(n for n in have if n not in wanted and not ignored.match(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise MxcError(f"{where}: unexpected tensor {unexpected[0]!r}{more}: the {graph.source} definition "
                       f"neither maps nor ignores it (wrong architecture, or a variant mxc does not support?)")
    for name, (shape, used_by) in wanted.items():
        got = tuple(ckpt.shape(name))
        if got != shape:
            raise MxcError(f"{where}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                           f"(for weight {used_by}; does config.json match the weights?)")


def write_weights(graph: Graph, ckpt, path: Path, metadata: dict[str, str] | None = None,
                  progress: bool = True) -> None:
    """Write every weight of ``graph`` into the safetensors file ``path``, one tensor at a time."""
    check_names(graph, ckpt)
    weights = list(graph.all_weights())
    specs = {w.name: (DTYPES[w.dtype], w.shape) for w in weights}
    with SafetensorsWriter(path, specs, metadata) as out:
        for w in tqdm(weights, desc="converting weights", unit="tensor", disable=not progress, leave=False):
            parts = [ckpt.get(hf) for hf, _ in _parts(w)]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            out.write(w.name, tensor.to(DTYPES[w.dtype]).contiguous())
            del parts, tensor
