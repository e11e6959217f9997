"""bench/profile_step.layer_table: a decode step's kernels folded onto one layer's sequence."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_step import layer_table  # noqa: E402

LAYER = [("norm", 2.0), ("gemv", 7.0), ("rope", 1.0), ("attn", 3.0), ("gemv", 5.0), ("gemv", 30.0), ("gemv", 15.0)]


def _steps(n_steps: int = 4, layers: int = 8, overlap: float = 1.5):
    """(start, end, name) in end order: each kernel starts ``overlap`` us before the previous one ends (PDL) and
    adds its own time; every step has an embedding ahead of its layers and an LM head and sampling after."""
    kernels, end = [], 0.0
    for _ in range(n_steps):
        for name, adds in [("embed", 1.0)] + LAYER * layers + [("lm_head", 60.0), ("argmax", 2.0)]:
            kernels.append((end - overlap, end + adds, name))
            end += adds
    return kernels


def test_folds_the_layers_and_skips_the_step_head_and_tail():
    table = layer_table(_steps()).splitlines()
    rows = [line.split() for line in table[1:-1]]
    assert [r[0] for r in rows] == [name for name, _ in LAYER]  # one layer, in launch order
    assert [float(r[3]) for r in rows] == [adds for _, adds in LAYER]  # what each kernel adds, never the LM head's
    assert all(float(r[1]) == -1.5 for r in rows)  # started under the previous kernel
    assert float(table[-1].split()[-1]) == sum(adds for _, adds in LAYER)


def test_no_repeating_layer():
    kernels = [(float(i), i + 1.0, f"k{i}") for i in range(100)]
    assert layer_table(kernels) == "timeline: no repeating layer found"
