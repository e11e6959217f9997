"""The index math of tensor-parallel sharding, shared by the shard pass and the loader.

``rank_slices(spec, size, tp, rank)`` says which ranges of the split
dimension rank ``rank`` holds: each segment (merged part) is split on its
own, in whole units; a segment with fewer units than ranks is replicated so
that every rank gets the unit its heads use; a vocabulary is padded to a
multiple of the ranks (``padded_vocab``). ``ShardError`` explains a split
that cannot work, naming the model-file expression and the numbers.
"""

from __future__ import annotations

from mxc.ir.graph import ShardSpec


class ShardError(ValueError):
    pass


def _parts(spec: ShardSpec, size: int) -> list[tuple[int, str]]:
    segments = spec.segments or (size,)
    exprs = spec.exprs or ("",) * len(segments)
    return list(zip(segments, exprs))


def padded_vocab(spec: ShardSpec) -> bool:
    """A whole vocabulary (one part, single rows): split into ``ceil(size / tp)`` rows a rank, the last ranks'
    slices ending in zero rows (the loader fills them) whose logits ``all_gather``'s ``size`` drops; so 32001
    tokens split over --tp 2."""
    return spec.kind == "vocab" and not spec.segments[1:] and spec.unit == 1


def rank_slices(spec: ShardSpec, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) ranges along the split dim held by ``rank``, in order. A padded vocabulary's rank holds
    ``ceil(size / tp)`` rows, of which the range gives the real ones (maybe fewer, maybe none)."""
    if padded_vocab(spec):
        per = -(-size // tp)
        start = min(rank * per, size)
        return [(start, min(per, size - start))]
    out, base = [], 0
    for seg, expr in _parts(spec, size):
        if seg % spec.unit:
            raise ShardError(f"size {seg} ({expr or 'part'}) is not a whole number of units of {spec.unit}")
        units = seg // spec.unit
        if units % tp == 0:
            per = units // tp
            out.append((base + rank * per * spec.unit, per * spec.unit))
        elif tp % units == 0:  # fewer units than ranks: replicate, each rank the unit its group uses
            out.append((base + (rank * units // tp) * spec.unit, spec.unit))
        else:
            what = f"`{expr}` = {seg}" if expr else f"{seg}"
            unit = f" in units of {spec.unit}" if spec.unit > 1 else ""
            raise ShardError(f"{what}{unit} gives {units} parts, neither divisible by tp={tp} nor dividing it")
        base += seg
    return out


def replicated_parts(spec: ShardSpec, size: int, tp: int) -> list[str]:
    """The parts (``expr = size``) that have fewer units than ranks, so that ranks hold copies of them. Right for
    a column-parallel weight's KV heads and for block scales; wrong for a row-parallel weight, whose copies the
    all-reduce would add up (``shard_tp`` refuses those)."""
    return [(f"`{expr}` = {seg}" if expr else f"{seg}") + (f" in units of {spec.unit}" if spec.unit > 1 else "")
            + f" makes {seg // spec.unit} part{'s' * (seg // spec.unit > 1)}"
            for seg, expr in _parts(spec, size) if seg % spec.unit == 0 and 0 < seg // spec.unit < tp]


def local_size(spec: ShardSpec, size: int, tp: int) -> tuple[int, tuple[int, ...]]:
    """(size held by each rank, its segment sizes): rank 0's, which a padded vocabulary's never shortens."""
    parts = tuple(length for _, length in rank_slices(spec, size, tp, 0))
    return sum(parts), parts
