"""select_kernels: every node is claimed by a kernel candidate, or the build fails.

Matches: every node. Rewrites to: the same node with ``kernel`` (the
candidate's ``module.function``) and ``kernel_reason`` attributes, e.g.
``linear(h, wqkv, kernel='torch_ref.linear', kernel_reason='...')``. With no
claim, raises ``MxcError`` listing each candidate's reason for declining.
Preserves: the graph's structure and math; only adds attributes.
"""

from __future__ import annotations

from mxc.errors import MxcError
from mxc.ir import Graph, Node, TensorType, map_bodies, verify
from mxc.kernels.candidates import CANDIDATES


def run(graph: Graph, options) -> Graph:
    types = verify(graph)

    def select(nodes, weights):
        out = []
        for n in nodes:
            in_types = [types.get(v) or (TensorType(weights[v].shape, weights[v].dtype) if v in weights else
                        TensorType(graph.weights[v].shape, graph.weights[v].dtype)) if v else None for v in n.ins]
            rejections = []
            for cand in CANDIDATES.get(n.op, []):
                why = cand.why_not(n, in_types, options)
                if why is None:
                    out.append(n.replace(attrs={**n.attrs, "kernel": cand.name, "kernel_reason": cand.reason}))
                    break
                rejections.append(why)
            else:
                listed = "; ".join(rejections) or "no candidates registered"
                raise MxcError(f"no kernel for {n.op} -> {', '.join(n.outs)} ({n.loc}) on target "
                               f"{options.target}: {listed}")
        return tuple(out), weights

    return map_bodies(graph, select)
