"""quantize: linear weights become fp8 e4m3 with scales (``--quant fp8``; identity otherwise).

Matches: every ``linear`` inside a repeated block whose weight is a local
weight not yet quantized and not declared ``quantize: false`` (the MoE routers:
an fp8 router can pick other experts, for bytes the experts' dwarf; vLLM keeps
them unquantized too), and the LM head with ``--quant-lm-head``, unless it
is tied to the embedding table, which must stay in the model dtype.

Rewrites to::

    y = linear(x, w, b, r, prologue=p)  ->  y = qlinear(x, w, w_scale, b, r, granularity=g, prologue=p)
    y = rms_norm_linear(x, g, w, b)     ->  y = rms_norm_qlinear(x, g, w, w_scale, b, granularity=g)

with ``w`` now ``float8_e4m3fn`` carrying ``QuantSpec('fp8_e4m3', g)`` and a
new float32 weight ``w_scale`` (``scale_of: w``), which the loader fills when
it quantizes ``w``: [N] for ``channel``/``tensor`` (a tensor scale per merged
part, repeated per row), [N/128, K/128] for ``block128``. For a checkpoint
that is already fp8 (``quant_scale_suffix``: ``weight_scale_inv`` for HF fp8,
``weight_scale`` for compressed-tensors), the spec says ``prequantized`` and
the scale weight names the checkpoint's scale tensors: nothing is
requantized, and its static ``input_scale`` tensors are ignored. Runs after
``shard_tp``: shapes are per rank, and the scale's shard spec follows the
weight's (column: split like the rows; row: per-row scales replicated,
block scales split along K), so every rank's scales match its slice.
Expert stacks of ``fused_moe`` are quantized too, always with per-expert row
scales (``[E, rows]``; the fused MoE kernel dequantizes them, activations stay
in the model dtype); an already-fp8 checkpoint's experts keep its scales
(block scales as ``[E, row blocks, column blocks]``). Experts left unfused (``--disable-pass fuse_moe``) are
refused: the ``experts`` op takes no scales. Preserves: value names;
the math up to fp8 rounding (tested against the unquantized model).
"""

from __future__ import annotations

from dataclasses import replace

from mxc.compiler.rewrite import apply_rules
from mxc.errors import MxcError
from mxc.ir import Graph, Node, QuantSpec, Repeat, ShardSpec, Weight
from mxc.ir.sharding import ShardError, padded_vocab, rank_slices

FP8 = "float8_e4m3fn"


def _blocks_follow(spec: ShardSpec, blocks: ShardSpec, tp: int) -> bool:
    """Whether ``blocks`` (a split of the scale's 128-block rows or columns) gives every rank the scales of the
    blocks its rows of ``spec`` lie in, in its local order: each rank's share of a part must start where a block
    does, or (one part) lie inside one block, whose scale that rank then holds a copy of; with several parts each
    share must be whole blocks, so the next part's local rows start on a local block too. The ranges are those
    the loader slices (``rank_slices``), so what this accepts is what every rank loads."""
    sizes = spec.segments
    if len(sizes) > 1 and any(s % 128 for s in sizes):
        return False
    bases = [sum(sizes[:j]) for j in range(len(sizes))]
    block_bases = [sum(blocks.segments[:j]) for j in range(len(sizes))]
    for rank in range(tp):
        try:
            held = rank_slices(blocks, sum(blocks.segments), tp, rank)
        except ShardError:
            return False
        rows = rank_slices(spec, sum(sizes), tp, rank)
        for (start, n), (b_start, b_n), base, b_base in zip(rows, held, bases, block_bases):
            first, last = (start - base) // 128, (start - base + n - 1) // 128
            if (start - base) % 128 and (len(sizes) > 1 or first != last):
                return False
            if len(sizes) > 1 and n % 128:
                return False
            if (b_start - b_base, b_n) != (first, last - first + 1):
                return False
    return True


def _block_spec(spec: ShardSpec | None, name: str, tp: int, prequantized: bool = False) -> ShardSpec | None:
    """The shard spec of block scales: the weight's split, counted in 128-row/column blocks, in units of the blocks
    a head spans (or of single blocks, for heads of 96 rows whose ranks still hold whole blocks), when
    ``_blocks_follow`` says every rank then loads the scales its rows need. A padded vocabulary (``padded_vocab``)
    needs each rank's ceil(V / tp) rows to be whole blocks: its last block may be partial (V = 255 at --tp 2)."""
    if spec is None or spec.kind == "replicated":
        return spec
    sizes = spec.segments
    blocks = tuple(-(-s // 128) for s in sizes)
    try:
        rank_slices(spec, sum(sizes), tp, 0)
    except ShardError:  # shard_tp refuses this split with its own message
        return replace(spec, segments=blocks, unit=max(1, spec.unit // 128))
    if padded_vocab(spec):
        follows = [replace(spec, segments=blocks, unit=1)] if -(-sizes[0] // tp) % 128 == 0 else []
    else:
        units = ([spec.unit // 128] if spec.unit % 128 == 0 else []) + [1]
        follows = [b for b in (replace(spec, segments=blocks, unit=u) for u in dict.fromkeys(units))
                   if _blocks_follow(spec, b, tp)]
    if not follows:
        fix = ("the checkpoint is fp8 with these block scales: use a --tp that leaves each rank whole 128-blocks, or "
               "build from the bf16 checkpoint with --quant fp8") if prequantized else "use --quant-granularity channel"
        raise MxcError(f"block128 fp8 scales of {name} cannot follow its tensor-parallel split "
                       f"(parts {list(sizes)}, unit {spec.unit}, --tp {tp}: a rank's rows are not whole 128-blocks): "
                       f"{fix}")
    return follows[0]


def scale_weight(w: Weight, local: str, granularity: str, tp: int, prequantized: bool = False) -> Weight:
    n, k = w.shape
    if tp == 1:
        w = replace(w, shard=None)  # nothing to split: the scale needs no shard spec
    if granularity == "block128":
        return Weight(f"{w.name}_scale", (-(-n // 128), -(-k // 128)), "float32", (),
                      shard=_block_spec(w.shard, w.name, tp, prequantized), scale_of=local)
    shard = w.shard if w.shard is not None and w.shard.kind in ("column", "vocab") else None
    return Weight(f"{w.name}_scale", (n,), "float32", (), shard=shard, scale_of=local)


def _prequantized(w: Weight, scale: Weight, suffix: str) -> Weight:
    """The checkpoint holds fp8 values: the scale comes from ``<name>.<suffix>`` beside each part."""
    return replace(scale, hf=tuple(h[: -len("weight")] + suffix for h in w.hf), segments=w.segments)


def _stored_unquantized(w: Weight, keep: frozenset[str]) -> bool:
    """Whether an fp8 checkpoint keeps ``w`` in the model dtype (``keep``: its unquantized linears' templates); a
    merged weight's parts must agree."""
    kept = [h in keep for h in w.hf]
    if any(kept) and not all(kept):
        fp8, plain = (next(h for h, k in zip(w.hf, kept) if k is want) for want in (False, True))
        raise MxcError(f"the checkpoint stores {fp8} in fp8 but {plain} unquantized, and mxc merges them into one "
                       f"weight ({w.name}); build from the bf16 checkpoint with --quant fp8")
    return all(kept)


def becomes_fp8(w: Weight, options) -> bool:
    """Whether ``run`` leaves the layer linear weight ``w`` in fp8 (for passes before it that fuse differently
    around fp8 linears): under ``--quant fp8``, unless declared ``quantize: false`` or stored unquantized by an
    fp8 checkpoint (``options.quant_unquantized``)."""
    if w.dtype == FP8 or w.quant is not None:
        return True
    return options.quant == "fp8" and _to_quantize(w, frozenset(options.quant_unquantized))


def _to_quantize(w: Weight, keep: frozenset[str]) -> bool:
    """Whether the bf16 weight ``w`` is one ``--quant fp8`` turns into fp8: not declared ``quantize: false`` and
    not among the parts an fp8 checkpoint stores unquantized (``keep``)."""
    return w.quantize and not _stored_unquantized(w, keep)


def _rule(granularity: str, include: set[str] | None, tp: int, suffix: str | None = None,
          keep: frozenset[str] = frozenset()):
    def quantize(node: Node, ctx):
        at = 2 if node.op == "rms_norm_linear" else 1  # the weight's position among the inputs
        local = node.ins[at]
        w = ctx.weights.get(local)
        if (w is None or w.quant is not None or w.dtype == FP8 or not _to_quantize(w, keep)
                or (include is not None and local not in include)):
            return None
        scale_local = f"{local}_scale"
        ctx.weights[local] = replace(w, dtype=FP8, quant=QuantSpec("fp8_e4m3", granularity, suffix is not None))
        scale = scale_weight(w, local, granularity, tp, suffix is not None)
        ctx.weights[scale_local] = _prequantized(w, scale, suffix) if suffix else scale
        ins = node.ins[:at + 1] + (scale_local,) + tuple(node.ins[at + 1:])
        attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel", "kernel_reason")}
        op = "rms_norm_qlinear" if node.op == "rms_norm_linear" else "qlinear"
        return {ctx.index(node): [Node(op, node.outs, ins, {**attrs, "granularity": granularity}, node.loc)]}

    return quantize


def run(graph: Graph, options) -> Graph:
    if options.quant is None:  # else "fp8": BuildOptions takes no other
        return graph
    g = options.quant_granularity
    # layers: every linear weight
    items = []
    keep = frozenset(options.quant_unquantized)
    for item in graph.body:
        if isinstance(item, Repeat):
            sub = graph.replace(body=(item,), weights={})
            rule = _rule(g, None, options.tp, options.quant_scale_suffix, keep)
            rules = [("linear", rule), ("rms_norm_linear", rule),
                     ("fused_moe", _expert_rule(options.tp, g, options.quant_scale_suffix, keep)),
                     ("experts", _unfused_experts(options.quant_scale_suffix, keep))]
            item = apply_rules(sub, rules)[0].body[0]
        items.append(item)
    graph = graph.replace(body=tuple(items))
    if options.quant_scale_suffix:  # static activation scales of fp8 checkpoints: mxc quantizes per token
        stems = {h[: -len("weight")] for rep in graph.repeats() for w in rep.weights.values() if w.quant
                 for h in w.hf}
        graph = graph.replace(ignore=graph.ignore + tuple(sorted(s + "input_scale" for s in stems)))
    if options.quant_lm_head:
        heads = {n.ins[1] if n.op == "linear" else n.ins[2] for n, rep in graph.nodes()
                 if rep is None and n.op in ("linear", "rms_norm_linear")}
        tied = {n.ins[1] for n, rep in graph.nodes() if n.op in ("embedding", "vocab_embedding")}
        if heads & tied:
            raise MxcError("--quant-lm-head: the LM head is tied to the embedding table, which stays in the "
                           "model dtype; build without --quant-lm-head")
        top = graph.replace(body=tuple(it for it in graph.body if isinstance(it, Node)))
        rule = _rule(g, heads, options.tp, options.quant_scale_suffix)
        done = apply_rules(top, [("linear", rule), ("rms_norm_linear", rule)])[0]
        it = iter(done.body)
        graph = graph.replace(weights=done.weights,
                              body=tuple(item if isinstance(item, Repeat) else next(it) for item in graph.body))
    return graph


def _unfused_experts(suffix: str | None, keep: frozenset[str]):
    """Experts left unfused (``--disable-pass fuse_moe``) cannot be fp8: only ``fused_moe`` takes expert scales.
    Leaving them in the model dtype would ignore --quant fp8 for most of an MoE's weights, and an fp8 checkpoint's
    experts would then be refused by the loader as if they were not meant to be fp8: say which option to drop."""

    def refuse(node: Node, ctx):
        stacks = [ctx.weights[node.ins[j]] for j in (3, 4, 5)]
        if not any(_to_quantize(w, keep) for w in stacks):
            return None  # an fp8 checkpoint's experts kept in the model dtype
        what = "the checkpoint stores the experts in fp8" if suffix else "--quant fp8 quantizes the experts"
        raise MxcError(f"{what}, and only the fused MoE op (pass fuse_moe) takes fp8 experts, which --disable-pass "
                       f"fuse_moe skips (weight {stacks[0].name}): build without --disable-pass fuse_moe")

    return refuse


def _expert_rule(tp: int, granularity: str, suffix: str | None, keep: frozenset[str] = frozenset()):
    """fused_moe over bf16 stacks -> over fp8 stacks with per-expert row scales ([E, rows]).

    An already-fp8 checkpoint's experts (``suffix``: its scale tensors' name) are imported as they are: each
    expert's channel scales, or its tensor scale repeated over the part's rows, become that expert's row scales;
    128x128 block scales stay blocks ([E, row blocks, column blocks], split with the stack like dense ones)."""

    def quantize(node: Node, ctx):
        if len(node.ins) > 5 and node.ins[5] is not None:
            return None
        stacks = [ctx.weights[node.ins[j]] for j in (3, 4)]
        kept = [_stored_unquantized(w, keep) for w in stacks]
        if all(kept):
            return None  # an fp8 checkpoint's experts kept in the model dtype
        if any(kept):
            raise MxcError(f"the checkpoint stores {stacks[kept.index(False)].hf[0]} in fp8 but "
                           f"{stacks[kept.index(True)].hf[0]} unquantized, and the fused MoE takes one format for "
                           f"an expert's matrices; build from the bf16 checkpoint with --quant fp8")
        ins, rest = list(node.ins[:5]), list(node.ins[7:])  # rest: the residual fuse_linear_io folded in
        for j in (3, 4):
            local = node.ins[j]
            w = ctx.weights[local]
            spec = QuantSpec("fp8_e4m3", granularity, True) if suffix else QuantSpec("fp8_e4m3", "channel")
            ctx.weights[local] = replace(w, dtype=FP8, quant=spec)
            if spec.granularity == "block128":
                e, n, k = w.shape
                shard = _block_spec(w.shard, w.name, tp, prequantized=True) if tp > 1 else None
                scale = Weight(f"{w.name}_scale", (e, -(-n // 128), -(-k // 128)), "float32", (), stack=w.stack,
                               shard=shard, scale_of=local)
            else:
                shard = w.shard if w.shard is not None and w.shard.kind == "column" and tp > 1 else None
                scale = Weight(f"{w.name}_scale", w.shape[:2], "float32", (), stack=w.stack, shard=shard,
                               scale_of=local)
            ctx.weights[f"{local}_scale"] = _prequantized(w, scale, suffix) if suffix else scale
            ins.append(f"{local}_scale")
        attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel", "kernel_reason")}
        return {ctx.index(node): [node.replace(ins=tuple(ins + rest), attrs=attrs)]}

    return quantize
