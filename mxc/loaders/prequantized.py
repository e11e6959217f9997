"""What an already-fp8 checkpoint stores in fp8: its linear weights with scale tensors, and those it keeps unquantized.

Checkpoints name the layers they leave in the model dtype in their ``quantization_config`` (compressed-tensors'
``ignore``, transformers' ``modules_to_not_convert``, AutoFP8's ``ignored_layers``), in forms as varied as regexes
and module paths; the tensors themselves say it plainly: a weight quantized to fp8 has a scale tensor beside it.
``unquantized_linears`` reads that for every linear weight (and expert stack) of a bound graph's layers, so the
``quantize`` pass imports the fp8 ones as they are and leaves the rest as the checkpoint holds them, as vLLM does.
A weight must be one or the other in every layer and every expert: the layers share one definition.
"""

from __future__ import annotations

from mxc.errors import MxcError
from mxc.ir import Graph


def unquantized_linears(graph: Graph, names, suffix: str, where) -> tuple[str, ...]:
    """The checkpoint-name templates (``{i}`` for the layer, an expert stack's index too) of the layers' linear
    weights that the checkpoint stores without a ``suffix`` scale tensor, sorted."""
    have = set(names)
    keep = []
    for rep in graph.repeats():
        for w in rep.weights.values():
            if len(w.shape) < 2 or not w.quantize or w.quant is not None:
                continue  # norms and biases; MoE routers (kept in the model dtype by the definition)
            for template in w.hf:
                concrete = [template.replace("{" + rep.index + "}", str(i)) for i in range(rep.count)]
                if w.stack:
                    key = "{" + w.stack + "}"
                    concrete = [c.replace(key, str(e)) for c in concrete for e in range(w.shape[0])]
                scaled = [c[: -len("weight")] + suffix in have for c in concrete]
                if all(scaled):
                    continue
                if any(scaled):
                    fp8, plain = (next(c for c, s in zip(concrete, scaled) if s is want) for want in (True, False))
                    raise MxcError(f"{where}: {fp8} is fp8 (it has {suffix}) but {plain} is not: mxc imports a "
                                   f"weight in fp8 in every layer and expert or in none (the layers share one "
                                   f"definition); build from the bf16 checkpoint with --quant fp8")
                keep.append(template)
    return tuple(sorted(keep))
