"""select_kernels: every node is claimed by kernel candidates, or the build fails.

Matches: every node. Rewrites to: the same node with ``kernel`` and
``kernel_reason`` attributes. The reason is the chosen candidate's, followed by
``[declined: ...]`` with why each candidate for the target asked before it said
no (e.g. the CUTLASS fp8 GEMM turned off). When one candidate serves every token count,
``kernel`` is its ``module.function``; when candidates split the range,
``kernel`` is a list of ``[max_tokens, name]`` (``None`` = no upper bound) and
the generated code dispatches on the input's row count, e.g. a Triton GEMV up
to 32 tokens and cuBLAS above. With a range left unclaimed, raises
``MxcError`` listing every candidate's reason for declining.
Preserves: the graph's structure and math; only adds attributes.
"""

from __future__ import annotations

from mxc.errors import MxcError
from mxc.ir import Graph, TensorType, map_bodies, verify
from mxc.kernels.candidates import CANDIDATES, FUSED_ON_CUDA


def _choose(node, in_types, options):
    """[(hi, candidate, declined)] covering token counts 1..inf in order, or raise. ``declined``: the reasons of
    the candidates for this target that were asked for the range before the chosen one and said no."""
    chosen, covered, rejections, declined = [], 0, [], []  # covered: every count <= covered is served
    for cand in CANDIDATES.get(node.op, []):
        lo, hi = cand.tokens
        if lo > covered + 1 or (hi is not None and hi <= covered):
            continue  # would leave a gap, or adds nothing
        why = cand.why_not(node, in_types, options)
        if why is not None:
            rejections.append(why)
            if options.target in cand.targets:  # a target's other kernels are not news
                declined.append(why)
            continue
        chosen.append((hi, cand, declined))
        if hi is None:
            return chosen
        covered, declined = hi, []
    listed = "; ".join(rejections) or "no candidates registered"
    raise MxcError(f"no kernel for {node.op} -> {', '.join(node.outs)} ({node.loc}) on target {options.target}"
                   + (f" above {covered} tokens" if covered else "") + f": {listed}" + _skipped_fusion(node, options))


def _skipped_fusion(node, options) -> str:
    """Where the node is left unfused because ``--disable-pass`` skipped a pass whose fused op the target runs
    instead (or eliminate_dead_code, leaving the op that fusion replaced), what to drop."""
    passes = FUSED_ON_CUDA.get(node.op, ()) if options.target == "cuda" else ()
    skipped = [p for p in (*passes, "eliminate_dead_code") if passes and p in options.disable_passes]
    if not skipped:
        return ""
    return (f"; on cuda {node.op} runs only fused (passes {', '.join(passes)}, then eliminate_dead_code removes "
            f"the unfused op), which --disable-pass {', '.join(skipped)} skips: build without it")


def run(graph: Graph, options) -> Graph:
    types = verify(graph)

    def wtype(v, weights):
        w = weights.get(v) or graph.weights[v]
        return TensorType(w.shape, w.dtype)

    def select(nodes, weights):
        out = []
        for n in nodes:
            in_types = [None if v is None else types[v] if v in types else wtype(v, weights) for v in n.ins]
            chosen = _choose(n, in_types, options)
            reasons = [c.reason + (f" [declined: {'; '.join(no)}]" if no else "") for _, c, no in chosen]
            if len(chosen) == 1:
                kernel, reason = chosen[0][1].name, reasons[0]
            else:
                kernel = [[hi, c.name] for hi, c, _ in chosen]
                reason = "; ".join(f"<= {hi} tokens: {r}" if hi else f"above: {r}"
                                   for (hi, _, _), r in zip(chosen, reasons))
            out.append(n.replace(attrs={**n.attrs, "kernel": kernel, "kernel_reason": reason}))
        return tuple(out), weights

    return map_bodies(graph, select)
