"""fuse_mlp: a decoder layer's fp8 MLP (and its residual add) become one op.

Matches (after ``quantize``)::

    gu = rms_norm_qlinear(x, g, w_gu, s_gu, eps=e)           # no bias; gu read only by the next qlinear
    y = qlinear(gu, w_down, s_down, None, x, prologue='silu_mul')   # the residual is the norm's input

Rewrites to::

    y = rms_norm_mlp(x, g, w_gu, s_gu, w_down, s_down, eps=e)

so that the MLP's kernels can cross the two linears' boundary: at decode token counts the gate/up GEMV
computes SiLU-and-mul in its epilogue (``cuda_ops.rms_norm_mlp_small_m``), or, with ``--mlp-pair``, one
persistent CUDA kernel runs the whole MLP (``mxc.kernels.mlp_pair_fp8``); at prefill token counts, with the
gate/up rows interleaved (``interleave_gate_up``), the CUTLASS gate/up GEMM does (``cuda_ops.rms_norm_mlp_cutlass``).
Otherwise the unfused nodes' kernels run (``select_kernels``: ``cuda_ops.rms_norm_mlp_*``), and the CPU
target the same references, so the rewrite changes no result there. A down projection without a residual (a
tensor-parallel rank's: the all-reduce after it adds x) becomes ``rms_norm_mlp(..., residual=False)``.
Preserves: the output name and the math of each step.
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(down: Node, ctx):
    extra = down.ins[3:]  # bias, residual
    if down.attrs.get("prologue") != "silu_mul" or (extra and extra[0] is not None):
        return None
    up = ctx.producing(down.ins[0])
    if up is None or up.op != "rms_norm_qlinear" or len(up.ins) != 4 or ctx.sole_user(up.outs[0]) is not down:
        return None
    residual = len(extra) == 2 and extra[1] is not None
    if (residual and extra[1] != up.ins[0]) or up.attrs["granularity"] != down.attrs["granularity"]:
        return None
    ins = (up.ins[0], up.ins[1], up.ins[2], up.ins[3], down.ins[1], down.ins[2])
    attrs = {"eps": up.attrs["eps"], "granularity": up.attrs["granularity"]}
    if not residual:
        attrs["residual"] = False
    return {ctx.index(up): [], ctx.index(down): [Node("rms_norm_mlp", down.outs, ins, attrs, down.loc)]}


def run(graph: Graph, options) -> Graph:
    if options.quant != "fp8":
        return graph
    return apply_rules(graph, [("qlinear", _match)])[0]
