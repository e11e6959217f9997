"""fuse_linear_all_reduce: the row-parallel linear joins the push all-reduce (and the add, norm) after it.

Matches (``--tp-allreduce push``, not ``--quant fp8``; ``fuse_all_reduce`` made the second node)::

    p = linear(x, w)                      # w a weight; no bias, residual or prologue; p read only here
    s, h = all_reduce_add_rms_norm(p, r, g, b, eps=e, world=N)
    z = all_reduce_add(p, r, b, world=N)

Rewrites to::

    s, h = linear_all_reduce_add_rms_norm(x, w, r, g, b, eps=e, world=N)
    z = linear_all_reduce_add(x, w, r, b, world=N)

At decode the GEMV then pushes its rows into every rank's buffer from its epilogue
(``triton_gemv.linear_small_m_push``) and the all-reduce kernel only waits, sums and goes on
(``peer_allreduce.push_all_reduce(..., pushed=True)``): the push kernel's own read and push of
the rows leave the critical path. Where the GEMV cannot push (a K split, more than 32 tokens, no
peer memory at run time) the adapters run the linear, then the all-reduce, as before. Not under
``--quant fp8``: the ``quantize`` pass, later, quantizes linears only; not for fp32 models (the push
all-reduce sums 16-bit values) nor outputs of ``WIDE_N`` features or more (cuBLAS serves their 17..32
tokens). Preserves: the names of the outputs; the math, including the model-dtype rounding of the
linear, of the sum, the bias and the residual add.
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node
from mxc.kernels.candidates import WIDE_N


def _fold(node: Node, ctx):
    lin = ctx.plain_linear(node.ins[0], node)
    if lin is None or ctx.weights[lin.ins[1]].shape[0] >= WIDE_N:  # cuBLAS serves 17..32 tokens of such outputs better
        return None
    fused = Node(f"linear_{node.op}", node.outs, (lin.ins[0], lin.ins[1], *node.ins[1:]), node.attrs, node.loc)
    return {ctx.index(lin): [], ctx.index(node): [fused]}


def run(graph: Graph, options) -> Graph:
    if getattr(options, "tp_allreduce", "nccl") != "push" or getattr(options, "quant", None) == "fp8":
        return graph
    if graph.dtype not in ("bfloat16", "float16"):  # the push all-reduce sums 16-bit values only
        return graph
    return apply_rules(graph, [("all_reduce_add", _fold), ("all_reduce_add_rms_norm", _fold)])[0]
