"""The IR's data types: values, weights, nodes, repeated blocks, graphs.

A ``Graph`` is a straight-line SSA program over named values. Layers are a
``Repeat``: one body executed ``count`` times, with per-layer weights named by
a template (``layers.{i}.wqkv``) and loop-carried values listed in ``carry``
(``x`` takes the body's ``x_2`` at the end of each iteration). Weights carry
their layout as data: where they come from in the checkpoint (``hf``, several
names = concatenated along dim 0 in ``segments``), how they shard
(``ShardSpec``) and how they are quantized (``QuantSpec``). Everything is a
frozen dataclass; passes build new graphs with ``dataclasses.replace``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Union

Dim = Union[int, str]  # str = a symbolic token dimension ("T", "R")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.shape))}] {self.dtype}"


@dataclass(frozen=True)
class Sym:
    """A reference to a repeat index (``i``) inside an attribute."""

    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ShardSpec:
    """How a weight splits across tensor-parallel ranks.

    kind: ``column`` (split output rows, dim 0), ``row`` (split input columns,
    dim 1), ``vocab`` (split the vocabulary, dim 0) or ``replicated``.
    ``segments`` are the sizes of merged parts (q, k, v) along the split dim,
    each split separately; empty for an unmerged weight. ``unit`` is how many
    rows stay together (a head: ``head_dim``). A part with fewer units than
    ranks is replicated: rank r takes unit ``r * units // tp`` (KV heads when
    there are fewer than ranks). ``exprs`` are the model file's expressions
    for each part's size, for error messages.
    """

    kind: str
    segments: tuple[int, ...] = ()
    unit: int = 1
    exprs: tuple[str, ...] = ()

    KINDS = ("column", "row", "vocab", "replicated")

    @property
    def dim(self) -> int:
        return 1 if self.kind == "row" else 0


@dataclass(frozen=True)
class QuantSpec:
    """How a weight is stored quantized (filled by the quantize pass).

    The weight's scales live in a companion weight ``<name>_scale`` (float32):
    ``channel`` and ``tensor`` store one scale per output row ([N]; a tensor
    scale is repeated over its rows, so each merged part keeps its own);
    ``block128`` stores one per 128x128 tile ([ceil(N/128), ceil(K/128)]).
    ``prequantized``: the checkpoint already holds fp8 values and scales.
    """

    scheme: str  # "fp8_e4m3"
    granularity: str  # "channel" | "tensor" | "block128"
    prequantized: bool = False

    GRANULARITIES = ("channel", "tensor", "block128")


@dataclass(frozen=True)
class Weight:
    name: str  # tensor name in the artifact; may contain "{i}" inside a Repeat
    shape: tuple[int, ...]
    dtype: str
    hf: tuple[str, ...]  # checkpoint names; several = concatenated along dim 0
    segments: tuple[int, ...] = ()  # rows per hf part when merged
    init: str = "normal"  # dummy-weight initialisation: "normal" | "ones"
    stack: str | None = None  # experts: dim 0 enumerates this index in the hf names ("{e}")
    shard: ShardSpec | None = None
    quant: QuantSpec | None = None
    scale_of: str | None = None  # this is the scale tensor of that (local) weight; the loader writes both
    quantize: bool = True  # False: ``--quant`` leaves it in the model dtype (MoE routers: the experts they pick)
    # > 0: a merged [gate; up] weight (or its row scales) stored with each rank's rows interleaved in blocks of this
    # many, [gate block 0; up block 0; gate block 1; ...] (``interleave_gate_up``; the loader reorders after sharding)
    interleave: int = 0

    def resolve(self, index_name: str | None, i: int | None) -> "Weight":
        """The concrete weight of layer ``i``."""
        if index_name is None:
            return self
        key = "{" + index_name + "}"
        return replace(self, name=self.name.replace(key, str(i)), hf=tuple(h.replace(key, str(i)) for h in self.hf))

    @property
    def shard_dim(self) -> int:
        """The dimension the shard spec splits (one further in for an expert stack)."""
        return self.shard.dim + (1 if self.stack else 0)

    def expert_hf(self, e: int) -> tuple[str, ...]:
        """The checkpoint names of expert ``e``'s parts."""
        key = "{" + str(self.stack) + "}"
        return tuple(h.replace(key, str(e)) for h in self.hf)


@dataclass(frozen=True)
class Node:
    op: str
    outs: tuple[str, ...]
    ins: tuple[str | None, ...]  # value or weight names; None = optional input absent
    attrs: dict[str, Any] = field(default_factory=dict)
    loc: str = ""  # "llama.yaml:31": where the node came from

    def replace(self, **changes) -> "Node":
        if all(getattr(self, k) == v for k, v in changes.items()):
            return self
        return replace(self, **changes)


@dataclass(frozen=True)
class Repeat:
    count: int
    index: str
    weights: dict[str, Weight]  # local name -> weight (names templated by index)
    body: tuple[Node, ...]
    carry: dict[str, str]  # outer value -> body value it takes after each iteration
    loc: str = ""

    def replace(self, **changes) -> "Repeat":
        return replace(self, **changes)


Item = Union[Node, Repeat]


@dataclass(frozen=True)
class Graph:
    family: str
    dtype: str  # the model (activation) dtype
    config: dict[str, Any]  # resolved parameters
    inputs: dict[str, TensorType]
    weights: dict[str, Weight]
    body: tuple[Item, ...]
    outputs: tuple[str, ...]
    ignore: tuple[str, ...] = ()  # checkpoint names deliberately unused ("{i}" = any layer)
    source: str = ""  # model file it was bound from
    # (checkpoint name of a tied weight, checkpoint name of the weight it reuses, the tied_if that tied them):
    # a checkpoint may store the tied weight's own tensor too, which must then hold the same values
    tied: tuple[tuple[str, str, str], ...] = ()

    def replace(self, **changes) -> "Graph":
        return replace(self, **changes)

    def nodes(self) -> Iterator[tuple[Node, Repeat | None]]:
        """Every node with the repeat it lives in (None at top level)."""
        for item in self.body:
            if isinstance(item, Repeat):
                for n in item.body:
                    yield n, item
            else:
                yield item, None

    def repeats(self) -> list[Repeat]:
        return [it for it in self.body if isinstance(it, Repeat)]

    def all_weights(self) -> Iterator[Weight]:
        """Every concrete weight, layers expanded, in artifact order."""
        yield from self.weights.values()
        for rep in self.repeats():
            for i in range(rep.count):
                for w in rep.weights.values():
                    yield w.resolve(rep.index, i)


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... : the first not in ``taken`` (which it joins)."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def map_bodies(graph: Graph, fn) -> Graph:
    """Apply ``fn(nodes, weights) -> (nodes, weights)`` to the top level and every repeat body."""
    items, top_nodes = [], []

    def flush():
        if top_nodes:
            nodes, weights = fn(tuple(top_nodes), graph_weights[0])
            graph_weights[0] = weights
            items.extend(nodes)
            top_nodes.clear()

    graph_weights = [dict(graph.weights)]
    for item in graph.body:
        if isinstance(item, Repeat):
            flush()
            body, weights = fn(item.body, dict(item.weights))
            items.append(item.replace(body=tuple(body), weights=weights))
        else:
            top_nodes.append(item)
    flush()
    return graph.replace(body=tuple(items), weights=graph_weights[0])
