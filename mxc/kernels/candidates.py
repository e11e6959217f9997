"""Kernel candidates: who can run each IR op, for which target, and why not.

Pure data and small checks; no torch import. The ``select_kernels`` pass
walks ``CANDIDATES`` in order for every node; the first candidate whose
``why_not`` returns ``None`` claims it, and the node records the kernel and the
reason. When none claims a node, the build fails listing every rejection.
Later candidates (generated Triton, cuBLAS/fp8 GEMMs per token-count bucket,
an autotune cache) are added here, ahead of the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mxc.ir.ops import OPS


@dataclass(frozen=True)
class Candidate:
    name: str  # "module.function" under mxc.kernels, as generated code calls it
    op: str
    targets: tuple[str, ...]
    reason: str  # why it is chosen when it claims a node
    check: Callable | None = None  # (node, in_types, options) -> str reason it cannot, or None

    def why_not(self, node, in_types, options) -> str | None:
        if options.target not in self.targets:
            return f"{self.name}: runs on {', '.join(self.targets)}, not {options.target}"
        if self.check is not None:
            return self.check(node, in_types, options)
        return None


def _torch_ref(op: str) -> Candidate:
    return Candidate(f"torch_ref.{op}", op, ("cpu", "cuda"), "torch reference (the only candidate for this op yet)")


CANDIDATES: dict[str, list[Candidate]] = {op: [_torch_ref(op)] for op in OPS}
