"""prefetch_next_weight: a preloading one-token fp8 GEMV asks L2 for the next GEMV's weight.

Matches (CUDA target with PDL)::

    y = qlinear(t, w, s, b, r)                  # w [N, K] e4m3, a weight whose one-token GEMV preloads
    ... = rms_norm_mlp(y, norm, w_gate_up, ...)  # or rms_norm_qlinear(y, norm, w_next, ...): a reader of y

where ``triton_fp8_gemv.preloads(N, K, dtype, G)``: that GEMV has its whole weight tiles in registers by its PDL
wait, so HBM idles through its FMAs and the RMSNorm-quantize kernel after it. Rewrites to the same qlinear with
the reader's first weight as its ``prefetch`` input; the GEMV asks L2 for the start of that weight's rows after
its wait (``triton_fp8_gemv.next_prefetch``), so the next GEMV reads them from L2. In Llama's layer: the o
projection prefetches the MLP's gate/up.
Preserves: the graph's math (``prefetch`` is a hint; every qlinear kernel takes it, only the GEMV uses it).
"""

from __future__ import annotations

import torch

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node

# the readers whose first GEMV weight is input 2
_NEXT = ("rms_norm_mlp", "rms_norm_qlinear")


def _match(lin: Node, ctx, dtype: torch.dtype):
    if len(lin.ins) > 5 and lin.ins[5] is not None or lin.ins[1] not in ctx.weights:
        return None
    from mxc.kernels.triton_fp8_gemv import preloads

    n, k = ctx.weights[lin.ins[1]].shape
    if not preloads(n, k, dtype, lin.attrs["granularity"]):
        return None
    readers = [ctx.nodes[i] for i in ctx.users.get(lin.outs[0], [])]
    nxt = next((r for r in readers if r.op in _NEXT and r.ins[0] == lin.outs[0] and r.ins[2] in ctx.weights), None)
    if nxt is None:
        return None
    ins = tuple(lin.ins) + (None,) * (5 - len(lin.ins)) + (nxt.ins[2],)
    return {ctx.index(lin): [lin.replace(ins=ins)]}


def run(graph: Graph, options) -> Graph:
    if options.target != "cuda" or not options.pdl:
        return graph
    dtype = getattr(torch, options.dtype)
    return apply_rules(graph, [("qlinear", lambda n, ctx: _match(n, ctx, dtype))])[0]
