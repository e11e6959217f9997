"""Deterministic random weights, for the built-in default model and benchmarks.

``DummyCheckpoint`` answers the same questions as a real ``Checkpoint`` for
exactly the tensors a graph asks for. Each tensor's values depend only on its
name, shape and init (``normal``: N(0, 0.02); ``ones``: 1 + N(0, 0.02) for
norm scales), never on the order tensors are read in, so builds are
reproducible bit for bit. Tensors above 256K elements repeat a 256K-element random
block (drawn from the same per-name seed): generating billions of normals on
the host would dominate a benchmark build, and a bandwidth benchmark only
needs realistic, non-zero values (with 4M-element blocks the 30B-parameter MoE benchmark
(18K expert matrices of 1.5M elements, 61 GB) was still writing weights after 4 minutes).
"""

from __future__ import annotations

import hashlib

import torch

from mxc.ir import Graph
from mxc.loaders.buffers import empty


_BLOCK = 1 << 18


class DummyCheckpoint:
    def __init__(self, graph: Graph):
        self.directory = "<dummy weights>"
        self._specs: dict[str, tuple[tuple[int, ...], str]] = {}
        from mxc.loaders.convert import parts_of

        for w in graph.all_weights():
            if w.scale_of:
                continue
            for hf, shape in parts_of(w):
                self._specs[hf] = (shape, w.init)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor's float32 values (``dtype``: cast to it, as ``.to(dtype)`` would: the block is cast once, then
        repeated, so a bf16 build neither fills nor casts float32 copies of billions of elements)."""
        shape, init = self._specs[name]
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)
        n = 1
        for d in shape:
            n *= d
        block = torch.randn(min(n, _BLOCK), generator=torch.Generator().manual_seed(seed)) * 0.02
        if init == "ones":
            block += 1.0  # elementwise, so the same values as adding it to the repeated tensor
        if dtype is not None:
            block = block.to(dtype)
        if n <= _BLOCK:
            return block.view(shape)
        out = empty((n,), block.dtype)
        whole = n // _BLOCK * _BLOCK
        out[:whole].view(-1, _BLOCK).copy_(block)  # one broadcast copy: no repeat of n elements, then a slice
        out[whole:].copy_(block[:n - whole])
        return out.view(shape)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
