"""interleave_gate_up: the fp8 MLP's gate/up weight stored with gate and up rows in alternating blocks.

Matches (after ``fuse_mlp``)::

    y = rms_norm_mlp(x, g, w_gu, s_gu, w_down, s_down, eps=e, granularity=channel|tensor[, residual=False])

where ``w_gu`` is a merged [gate; up] weight of two equal parts whose rows a rank holds (I each) are whole
blocks of ``BLOCK``. Rewrites to the same node with ``interleave=BLOCK``, and marks ``w_gu`` and its scales
``interleave: BLOCK``: the loader stores each rank's rows as [gate 0..B; up 0..B; gate B..2B; up B..2B; ...].
A CTA tile of the prefill's gate/up GEMM (``cutlass_fp8``: 128 columns = 2 x BLOCK) then holds gates and their
ups, so SiLU-and-mul runs in the GEMM's epilogue (``fp8_gemm.silu_pair``): the GEMM writes h, half the
bytes of gate/up, and the down projection's quantize reads h once, without the SiLU
(``cuda_ops.rms_norm_mlp_cutlass``). Every kernel of ``rms_norm_mlp`` reads the layout from the attribute
(the decode GEMV's SiLU epilogue, the SiLU-quantize prologue, the references); the persistent MLP kernel
(``--mlp-pair``) does not, so that build keeps the halves.
Block-scaled weights keep the halves too: their 128-row scale blocks would straddle gate and up.
Preserves: every value (the same products in another row order); only the storage order changes.
"""

from __future__ import annotations

from dataclasses import replace

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node
from mxc.kernels.cutlass_fp8 import PAIR_BLOCK as BLOCK  # half the shipped CUTLASS tile's columns (64)


def _match(node: Node, ctx):
    if node.attrs.get("interleave") or node.attrs["granularity"] not in ("channel", "tensor"):
        return None
    w_name, s_name = node.ins[2], node.ins[3]
    w, s = ctx.weights.get(w_name), ctx.weights.get(s_name)
    if w is None or s is None or len(w.segments) != 2 or w.segments[0] != w.segments[1] or w.stack:
        return None
    if w.shape[0] % (2 * BLOCK):  # a rank's gate (and up) rows: whole blocks
        return None
    ctx.weights[w_name] = replace(w, interleave=BLOCK)
    ctx.weights[s_name] = replace(s, interleave=BLOCK)
    return {ctx.index(node): [node.replace(attrs={**node.attrs, "interleave": BLOCK})]}


def run(graph: Graph, options) -> Graph:
    if options.quant != "fp8" or options.mlp_pair:
        return graph
    return apply_rules(graph, [("rms_norm_mlp", _match)])[0]
