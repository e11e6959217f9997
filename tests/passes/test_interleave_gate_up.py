"""interleave_gate_up on the CPU pipeline: which fp8 MLPs get their gate/up rows interleaved in 64-row blocks.

The layout itself, the loader and the kernels: tests/build/test_interleave_gate_up.py.
"""

from __future__ import annotations

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.kernels.cutlass_fp8 import PAIR_BLOCK


def _mlp(bind_arch, intermediate_size, **options):
    g = compile_graph(bind_arch(intermediate_size=intermediate_size), BuildOptions(quant="fp8", **options))
    (rep,) = g.repeats()
    (mlp,) = [n for n in rep.body if n.op == "rms_norm_mlp"]
    return mlp, rep.weights


@pytest.mark.parametrize("intermediate_size, interleaved", [(64, True), (128, True), (192, True), (96, False),
                                                            (32, False)])
def test_interleaves_gate_rows_in_whole_blocks(bind_arch, intermediate_size, interleaved):
    """Gate (and up) rows a whole number of 64-row blocks -- one block, two, three -- are interleaved; 96 or 32
    rows are not."""
    mlp, weights = _mlp(bind_arch, intermediate_size)
    block = PAIR_BLOCK if interleaved else 0
    assert PAIR_BLOCK == 64
    assert mlp.attrs.get("interleave", 0) == block
    assert weights[mlp.ins[2]].interleave == weights[mlp.ins[3]].interleave == block
