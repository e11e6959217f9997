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

    def get(self, name: str) -> torch.Tensor:
        shape, init = self._specs[name]
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)
        n = 1
        for d in shape:
            n *= d
        block = torch.randn(min(n, _BLOCK), generator=torch.Generator().manual_seed(seed)) * 0.02
        t = (block if n <= _BLOCK else block.repeat(-(-n // _BLOCK))[:n]).view(shape)
        return t + 1.0 if init == "ones" else t

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
