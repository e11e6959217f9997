"""What an already-fp8 checkpoint stores in fp8: its linear weights with scale tensors, and those it keeps unquantized.

Checkpoints name the layers they leave in the model dtype in their ``quantization_config`` (compressed-tensors'
``ignore``, transformers' ``modules_to_not_convert``, AutoFP8's ``ignored_layers``), in forms as varied as regexes
and module paths; the tensors themselves say it plainly: a weight quantized to fp8 has a scale tensor beside it.
``unquantized_linears`` reads that for every linear weight (and expert stack) of a bound graph's layers, so the
``quantize`` pass imports the fp8 ones as they are and leaves the rest as the checkpoint holds them, as vLLM does.
A weight must be one or the other in every layer and every expert: the layers share one definition.
``checkpoint_quantization`` reads config.json's ``quantization_config``: whether the checkpoint is fp8 at all,
with which scale granularity and scale-tensor names.
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


SUFFIXES = ("weight_scale", "weight_scale_inv")  # the scale tensors' names: compressed-tensors', transformers'


def checkpoint_quantization(config: dict, config_path: str, names=None) -> tuple[str, str] | None:
    """(granularity, scale-tensor suffix) when config.json says the weights are already fp8, else None.

    ``names``: a callable giving the checkpoint's tensor names, which settle the format where the config leaves it
    open (quant_method fp8 with no weight_block_size: transformers' 128x128 blocks with ``weight_scale_inv``, or the
    per-tensor ``weight_scale`` of AutoFP8 checkpoints, as vLLM reads them) and must agree with it elsewhere."""
    found = _quantization(config, config_path, names)
    if found is not None and names is not None:
        _check_suffix(found[1], names(), config, config_path)
    return found


def _check_suffix(suffix: str, names, config: dict, config_path: str) -> None:
    """The checkpoint's scale tensors have the name the config implies: where it has none of those but has the
    other kind, the config and the tensors disagree (every fp8 weight would otherwise read as unquantized)."""
    suffixes = {n.rpartition(".")[2]: n for n in names}
    other = next(s for s in SUFFIXES if s != suffix)
    if suffix not in suffixes and other in suffixes:
        qc = config["quantization_config"]
        said = ", ".join(f"{k} {qc[k]}" for k in ("quant_method", "weight_block_size") if k in qc)
        raise MxcError(f"{config_path}: quantization_config ({said}) means scale tensors named *.{suffix}, but the "
                       f"checkpoint's are named *.{other} ({suffixes[other]}): the config and the tensor names "
                       f"disagree; check that config.json came with these weights")


def _quantization(config: dict, config_path: str, names) -> tuple[str, str] | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise MxcError(f"{config_path}: quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":  # transformers' fine-grained fp8: weight + weight_scale_inv per 128x128 block
        block = qc.get("weight_block_size", "absent")
        if block not in ("absent", None, [128, 128]):
            raise MxcError(f"{config_path}: quantization_config.weight_block_size {block} is not supported "
                           f"(expected [128, 128], or null for one scale a tensor)")
        if block == [128, 128]:
            return "block128", "weight_scale_inv"
        suffixes = {n.rpartition(".")[2] for n in names()} if names is not None else set()
        if "weight_scale" in suffixes and "weight_scale_inv" not in suffixes:  # AutoFP8: one scale a tensor
            return "tensor", "weight_scale"
        # absent: transformers' default, (128, 128) (FineGrainedFP8Config); null: per tensor
        return ("block128" if block == "absent" else "tensor"), "weight_scale_inv"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        groups = list(groups.values()) if isinstance(groups, dict) else None
        if groups is None or not all(isinstance(g, dict) and isinstance(g.get("weights", {}), dict) for g in groups):
            raise MxcError(f"{config_path}: quantization_config.config_groups must map group names to objects "
                           f"with a 'weights' object")
        schemes = [g.get("weights", {}) for g in groups] or [{}]
        for weights in schemes:
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise MxcError(f"{config_path}: compressed-tensors scheme {weights} is not fp8; only fp8 is supported")
        strategies = sorted({str(w.get("strategy")) for w in schemes})
        if len(strategies) > 1:  # one granularity a build: each group's layers would need their own
            raise MxcError(f"{config_path}: quantization_config.config_groups mix the fp8 strategies {strategies}; "
                           f"mxc imports checkpoints whose groups share one strategy (channel or tensor)")
        strategy = schemes[0].get("strategy")
        if strategy == "block":  # llm-compressor's FP8_BLOCK: one scale a block_structure tile
            blocks = sorted({str(w.get("block_structure")) for w in schemes})
            if blocks != ["[128, 128]"]:
                raise MxcError(f"{config_path}: compressed-tensors fp8 block_structure {', '.join(blocks)} is not "
                               f"supported (expected [128, 128])")
            return "block128", "weight_scale"
        if strategy not in ("channel", "tensor"):
            raise MxcError(f"{config_path}: compressed-tensors fp8 strategy {strategy!r} is not supported "
                           f"(channel, tensor, or block with block_structure [128, 128])")
        return strategy, "weight_scale"
    raise MxcError(f"{config_path}: quantization_config.quant_method {method!r} is not supported (fp8, "
                   f"compressed-tensors fp8)")
