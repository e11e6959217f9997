"""fuse_norm_linear: an RMSNorm read only by one linear becomes part of that linear.

Matches::

    h = rms_norm(x, g, eps=e)          # g a weight; h read only by this linear
    y = linear(h, w, b)                # no prologue, no residual

Rewrites to::

    y = rms_norm_linear(x, g, w, b, eps=e)

Only under ``--quant fp8``: the ``quantize`` pass turns the op into
``rms_norm_qlinear``, whose first kernel (the per-token activation quantize,
one program per row) computes the norm as the unfused RMSNorm does, so the
RMSNorm launches before the QKV and gate/up projections disappear (64 per step
on Llama-3-8B). Runs before ``fuse_add_rms_norm``, so the norm after the
attention's residual add is taken here too, and the add then folds into the o
projection's epilogue (``fuse_linear_io``). A linear that stays bf16 (the LM
head without ``--quant-lm-head``) runs the RMSNorm kernel, then its GEMM. For
bf16 models the pass leaves the graph alone: the norm folded into the batch-1
GEMV (sum of squares while streaming the weights) measured 4.83 against 4.43
ms/token on the H200 (Llama-3-8B shape; again 4.47 against 4.09 on 2026-12-03,
``triton_gemv``), and without that kernel the rewrite saves no launch. Requires: the norm's weight is a weight and its
output has no other reader (a MoE block reads it twice: router and experts);
dead code is eliminated first. Preserves: the output name and the math (the
normalised row is rounded to the model dtype, as by the unfused norm).
"""

from __future__ import annotations

from mxc.compiler.passes import eliminate_dead_code
from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(norm: Node, ctx):
    lin = ctx.sole_user(norm.outs[0])
    if norm.ins[1] not in ctx.weights or lin is None:
        return None
    if lin.op != "linear" or lin.ins[0] != norm.outs[0] or len(lin.ins) > 3 or lin.attrs.get("prologue"):
        return None
    ins = (norm.ins[0], norm.ins[1], lin.ins[1]) + tuple(i for i in lin.ins[2:3] if i is not None)
    attrs = {"eps": norm.attrs["eps"]}
    return {ctx.index(norm): [], ctx.index(lin): [Node("rms_norm_linear", lin.outs, ins, attrs, lin.loc)]}


def run(graph: Graph, options) -> Graph:
    if options.quant != "fp8":
        return graph
    # the merges leave the unmerged projections to dead-code elimination: drop them first, so a norm
    # read only by the merged linear counts one reader
    return apply_rules(eliminate_dead_code.run(graph, options), [("rms_norm", _match)])[0]
