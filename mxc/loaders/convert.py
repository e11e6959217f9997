"""Streaming weight conversion: checkpoint tensors -> the artifact's rank shard.

For every weight of the final graph (layers expanded), reads its checkpoint
parts one at a time, checks their shapes, applies the transforms the passes
declared (concatenate ``segments`` along dim 0, cast to the weight's dtype)
and writes each tensor-parallel rank's slice (the shard spec; its rows interleaved where the weight says,
``interleave_rows``) straight into
that rank's ``SafetensorsWriter``, whose header was computed from the IR.
Peak memory is about one weight (two while a tied weight's stored tensor is compared). Before any data moves, the
checkpoint's names are checked against the graph: a missing, unexpected or
mis-shaped tensor fails with its name and the shapes, and a tied weight's own
tensor, where the checkpoint stores it, must hold the values of the weight it reuses.
A tensor holding NaN or infinity, one past the largest value of the build's dtype
(1e38 in float16), an fp8 scale that is not finite and positive (or not stored as floating point) and an fp8
weight holding NaN, or once scaled past float32 (an expert's: past the model dtype, which the experts are
dequantized into), fail by name too.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import torch
from tqdm import tqdm

from mxc.artifact_format import WEIGHT_DTYPES
from mxc.errors import MxcError
from mxc.ir import Graph, Weight
from mxc.ir.sharding import local_size, rank_slices
from mxc.loaders.buffers import empty
from mxc.loaders.dummy import DummyCheckpoint
from mxc.loaders.quantize import quantize_fp8
from mxc.loaders.safetensors_writer import SafetensorsWriter, tensor_bytes

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")  # fp8 checkpoints' scale tensors
DTYPES = WEIGHT_DTYPES  # by graph.yaml's dtype names


def full_shape(w: Weight) -> tuple[int, ...]:
    """The weight's shape before tensor-parallel sharding (the shard spec keeps the global sizes)."""
    if w.shard is None or not w.shard.segments:
        return w.shape
    shape = list(w.shape)
    shape[w.shard_dim] = sum(w.shard.segments)
    return tuple(shape)


def parts_of(w: Weight) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor the weight is made of (every expert's, for a stack)."""
    shape = full_shape(w)
    if w.stack:
        inner = shape[1:]
        rows = w.segments or (inner[0],)
        return [(hf, (r,) + inner[1:]) for e in range(shape[0]) for hf, r in zip(w.expert_hf(e), rows)]
    rows = w.segments or (shape[0],)
    return [(hf, (r,) + shape[1:]) for hf, r in zip(w.hf, rows)]


def read_full(w: Weight, ckpt, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole (merged, stacked) weight from the checkpoint, before sharding, in ``dtype`` where given (else as the
    checkpoint stores it; a merged weight's parts, and an expert stack's, in their promoted dtype).

    A merged weight and an expert stack are filled in place, part by part, the cast happening in the copy: a 30B MoE
    has ~18K expert tensors, and stacking them in the checkpoint's dtype, then casting, wrote every byte three times
    (most of a 61 GB build's time); a float32 checkpoint's (or the dummy weights') q/k/v and gate/up parts were merged
    in float32, then cast. A single tensor comes as the checkpoint stores it (the caller casts it), but for dummy
    weights, which are generated in ``dtype``."""
    if w.stack:
        shape = full_shape(w)
        # every expert's dtype, not the first's: a float32 expert beside a float16 one was rounded to float16 (or
        # cast to inf) before --quant fp8 quantized it
        out = empty(shape, dtype or functools.reduce(torch.promote_types, (ckpt.dtype(h) for h, _ in parts_of(w))))
        for e in range(shape[0]):
            row = 0
            for h in w.expert_hf(e):
                part = _get(ckpt, h, dtype)
                out[e, row:row + part.shape[0]].copy_(part)
                row += part.shape[0]
        return out
    if len(w.hf) == 1:
        return _get(ckpt, w.hf[0], dtype)
    # a merged weight is filled part by part too: one part at a time besides it, not all of them (torch.cat)
    out = empty(full_shape(w), dtype or functools.reduce(torch.promote_types, map(ckpt.dtype, w.hf)))
    row = 0
    for hf in w.hf:
        part = _get(ckpt, hf, dtype)
        out[row:row + part.shape[0]].copy_(part)
        row += part.shape[0]
        del part
    return out


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, into a huge-page buffer (``buffers.empty``) where it is a copy."""
    return tensor if tensor.dtype == dtype else empty(tensor.shape, dtype).copy_(tensor)


def _get(ckpt, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """A checkpoint tensor as stored; dummy weights' in ``dtype`` (generated in it: the same values as a cast)."""
    return ckpt.get(name, dtype) if dtype is not None and isinstance(ckpt, DummyCheckpoint) else ckpt.get(name)


def _ignored(patterns: tuple[str, ...]) -> re.Pattern:
    """One pattern for names with an index ("{i}" for the layer, an expert stack's "{e}") standing for any number."""
    regex = "|".join(re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(p)) for p in patterns) or r"(?!)"
    return re.compile(f"^(?:{regex})$")


def check_names(graph: Graph, ckpt) -> None:
    """Fail on a checkpoint tensor that is missing, unexpected or mis-shaped."""
    where = ckpt.directory
    have = set(ckpt.names())
    wanted: dict[str, tuple[tuple[int, ...], str]] = {}
    for w in graph.all_weights():
        if w.scale_of:  # made from its weight's tensors, or read from the checkpoint's scales
            wanted.update({hf: (None, w.name) for hf in _scale_names(w)})
            continue
        for hf, shape in parts_of(w):
            wanted[hf] = (shape, w.name)
    missing = [n for n in wanted if n not in have]
    if missing:
        shape, used_by = wanted[missing[0]]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        what = f"expected shape {list(shape)}" if shape is not None else "the checkpoint's fp8 scales"
        stray = getattr(ckpt, "unindexed", {}).get(missing[0])
        hint = (f": it is in {stray.name}, but {ckpt.index.name} does not list it (a stale index? add it to the "
                f"index's weight_map)") if stray is not None else ""
        if shape is None and not hint:
            hint = (": the checkpoint does not store that weight in fp8 with scales" +
                    (" (--quant-lm-head asks for the LM head's; build without it)"
                     if used_by in {w.name for w in graph.weights.values()} else ""))
        raise MxcError(f"{where}: missing tensor {missing[0]!r} ({what}, for weight {used_by}){more}{hint}")
    ignored = _ignored(graph.ignore)
    unexpected = sorted(n for n in have if n not in wanted and not ignored.match(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        stem, _, suffix = unexpected[0].rpartition(".")
        if suffix in SCALE_SUFFIXES and f"{stem}.weight" in wanted:  # an fp8 tensor of a weight kept unquantized
            used_by = wanted[f"{stem}.weight"][1]
            raise MxcError(f"{where}: {stem}.weight is stored in fp8 with scales ({unexpected[0]}), but mxc "
                           f"keeps weight {used_by} in the model dtype (an MoE router, or no fp8 build): only linear "
                           f"layers and experts are imported in fp8")
        raise MxcError(f"{where}: unexpected tensor {unexpected[0]!r}{more}: the {graph.source} definition "
                       f"neither maps nor ignores it (wrong architecture, or a variant mxc does not support?)")
    for name, (shape, used_by) in wanted.items():
        got = tuple(ckpt.shape(name))
        if shape is not None and got != shape:
            raise MxcError(f"{where}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                           f"(for weight {used_by}; does config.json match the weights?)")


def check_tied(graph: Graph, ckpt) -> None:
    """Fail on a tied weight (the LM head) whose own tensor the checkpoint stores with other values than the weight
    it reuses (the embedding): transformers loads the two untied then, and a tied build would silently differ."""
    have = set(ckpt.names())
    for name, target, cond in graph.tied:
        if name in have and target in have and not _same_values(ckpt, name, target):
            raise MxcError(f"{ckpt.directory}: {name} differs from {target}, which config.json ties it to "
                           f"({graph.source}: tied_if `{cond}`); transformers then loads the two untied: make `{cond}` "
                           f"false in config.json to build them untied too")


def _same_values(ckpt, a: str, b: str, rows: int = 4096) -> bool:
    if tuple(ckpt.shape(a)) != tuple(ckpt.shape(b)):
        return False
    x, y = ckpt.get(a), ckpt.get(b)  # NaN equals NaN: a copied damaged value is reported as damage, later
    return all(torch.isclose(x[r:r + rows].float(), y[r:r + rows].float(), rtol=0, atol=0, equal_nan=True).all()
               for r in range(0, x.shape[0], rows))


def rank_slice(tensor: torch.Tensor, w: Weight, tp: int, rank: int) -> torch.Tensor:
    """The part of a full (merged) weight that ``rank`` holds, by its shard spec."""
    if tp == 1 or w.shard is None or w.shard.kind == "replicated":
        return tensor
    dim = w.shard_dim
    size = tensor.shape[dim]
    pieces = [tensor.narrow(dim, start, length) for start, length in rank_slices(w.shard, size, tp, rank)]
    local = local_size(w.shard, size, tp)[0]
    held = sum(p.shape[dim] for p in pieces)
    if held < local:  # a padded vocabulary's last rows (their logits are dropped by all_gather's size)
        pad = list(tensor.shape)
        pad[dim] = local - held
        pieces.append(torch.zeros(pad, dtype=tensor.dtype))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def interleave_rows(tensor: torch.Tensor, block: int) -> torch.Tensor:
    """A rank's [gate; up] rows (dim 0, two equal halves) as [gate block 0; up block 0; gate block 1; ...], blocks
    of ``block`` rows (``Weight.interleave``; the verifier checked that the halves are whole blocks)."""
    half = tensor.shape[0] // 2
    rest = tensor.shape[1:]
    return tensor.reshape(2, half // block, block, *rest).transpose(0, 1).reshape(tensor.shape)


def rank_tensor(full: torch.Tensor, w: Weight, tp: int, rank: int) -> torch.Tensor:
    """What ``rank``'s file stores of the full (merged) tensor: its slice, in the weight's row order."""
    local = rank_slice(full, w, tp, rank)
    return (interleave_rows(local, w.interleave) if w.interleave else local).contiguous()


def _checkpoint_scales(w: Weight, scale_w: Weight, ckpt) -> torch.Tensor:
    """The checkpoint's scales of ``w``'s parts, in the layout quantize_fp8 would have made (an expert stack's
    experts one after another: [E, rows])."""
    if w.stack:
        return torch.stack([_part_scales(w, scale_w.expert_hf(e), full_shape(w)[1:], ckpt)
                            for e in range(full_shape(w)[0])])
    return _part_scales(w, scale_w.hf, full_shape(w), ckpt)


def _part_scales(w: Weight, names: tuple[str, ...], shape: tuple[int, ...], ckpt) -> torch.Tensor:
    rows = w.segments or (shape[0],)
    k = shape[1]
    parts = []
    for hf, n in zip(names, rows):
        s = ckpt.get(hf).float()
        bad = s[~(s.isfinite() & (s > 0))]
        if bad.numel():
            raise MxcError(f"{ckpt.directory}: {hf} holds {bad.numel()} fp8 scale(s) that are not finite and "
                           f"positive (e.g. {float(bad[0])}); the checkpoint is damaged")
        if w.quant.granularity == "block128":
            if len(rows) > 1 and n % 128:
                keep_apart = "" if w.stack else ("; for --target cpu, --disable-pass merge_qkv (or merge_gate_up) "
                                                 "keeps the parts apart")
                raise MxcError(f"{ckpt.directory}: {hf}: merged part of {n} rows is not whole 128-row blocks"
                               f"{keep_apart}")
            want = [-(-n // 128), -(-k // 128)]
            if list(s.shape) != want:
                raise MxcError(f"{ckpt.directory}: {hf} has shape {list(s.shape)}, expected {want} (one scale a "
                               f"128x128 block of a [{n}, {k}] weight, as config.json's quantization_config says)")
            parts.append(s)
        elif w.quant.granularity == "tensor":
            if s.numel() != 1:
                raise MxcError(f"{ckpt.directory}: {hf} has shape {list(s.shape)}, expected one scale for the tensor "
                               f"(as config.json's quantization_config says)")
            parts.append(s.reshape(1).expand(n))
        else:
            if s.numel() != n:
                raise MxcError(f"{ckpt.directory}: {hf} has {s.numel()} scales, expected one per row ({n})")
            parts.append(s.reshape(-1))
    return torch.cat(parts, dim=0).contiguous()


def _check_stored_dtypes(w: Weight, ckpt) -> None:
    """Every checkpoint tensor of ``w`` (each part of a merged weight, each expert of a stack) holds floating-point
    values, and fp8 ones only where ``w`` imports them with their scales, where every part must be e4m3: a cast
    would make anything else wrong."""
    prequantized = w.quant is not None and w.quant.prequantized
    for hf, _ in parts_of(w):
        stored = ckpt.dtype(hf)
        if prequantized and stored != torch.float8_e4m3fn:
            raise MxcError(f"{ckpt.directory}: {hf} is stored as {stored}, but config.json's quantization_config "
                           f"says the checkpoint holds float8_e4m3fn weights (weight {w.name})")
        if stored in (torch.float8_e4m3fn, torch.float8_e5m2) and not prequantized:
            raise MxcError(f"{ckpt.directory}: {hf} is stored as {stored}, but mxc does not import "
                           f"it as fp8 (weight {w.name}); casting without its scales would be wrong")
        if not stored.is_floating_point:
            raise MxcError(f"{ckpt.directory}: {hf} is stored as {stored}, expected floating-point weights "
                           f"(weight {w.name}); the checkpoint is damaged or not this architecture's")


def _scale_names(w: Weight) -> list[str]:
    """The checkpoint's scale tensors a scale weight reads (every expert's; none where the build quantizes)."""
    return [h for e in range(w.shape[0]) for h in w.expert_hf(e)] if w.stack else list(w.hf)


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_scale_dtypes(w: Weight, ckpt) -> None:
    """The checkpoint's fp8 scales are floating-point numbers: a bool or integer tensor read as float would give
    scales of 1 or whole numbers, a silently wrong model."""
    for hf in _scale_names(w):
        stored = ckpt.dtype(hf)
        if stored not in SCALE_DTYPES:
            raise MxcError(f"{ckpt.directory}: {hf} is stored as {stored}, expected floating-point fp8 scales "
                           f"(weight {w.name}); the checkpoint is damaged")


def check_checkpoint(graph: Graph, ckpt) -> None:
    """Everything the checkpoint's headers can say against ``graph``, before any tensor is converted (and, in a
    build, before minutes of kernel compiling): names, shapes, stored dtypes, tied weights."""
    check_names(graph, ckpt)
    check_tied(graph, ckpt)
    for w in graph.all_weights():
        if not w.scale_of:
            _check_stored_dtypes(w, ckpt)
        else:
            _check_scale_dtypes(w, ckpt)


WIDER = {torch.float16: "bfloat16 or float32", torch.bfloat16: "float32"}


def _check_finite(w: Weight, ckpt, values: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Fail where ``values`` (``w`` cast to its dtype, or the largest values of the fp8 scales made of it, in
    ``dtype``) hold NaN or infinity, naming the checkpoint tensor: one that holds some itself (damaged), or one past
    the largest value of the dtype it is cast to (1e38 in float16). One min/max pass (a fraction of the cast's
    time); the culprit is looked for on failure."""
    if values.numel() == 0 or all(v.isfinite() for v in torch.aminmax(values)):  # NaN propagates to both
        return
    dtype = dtype or DTYPES[w.dtype]
    for hf, _ in parts_of(w):
        part = ckpt.get(hf)
        if not part.isfinite().all():
            raise MxcError(f"{ckpt.directory}: {hf} holds NaN or infinite values (weight {w.name}); the checkpoint "
                           f"is damaged")
        if not part.to(dtype).isfinite().all():
            name = str(dtype).removeprefix("torch.")
            hint = f"build with a wider --dtype ({WIDER[dtype]})" if dtype in WIDER else "no --dtype holds it"
            raise MxcError(f"{ckpt.directory}: {hf} holds values up to {float(part.abs().max()):.4g}, past "
                           f"{name}'s largest {torch.finfo(dtype).max:.4g} (weight {w.name}); {hint}")
    raise MxcError(f"{ckpt.directory}: weight {w.name} holds NaN or infinite values once converted to {w.dtype}")


FP8_MAX = 448.0  # e4m3fn's largest finite value; it has no infinity, and NaN is the bytes 0x7f and 0xff


def _dequantized_dtype(w: Weight, model_dtype: str) -> torch.dtype:
    """The dtype an fp8 weight's values times its scales are held in at run time: an expert stack's, the model's
    (the fused MoE kernels, and their CPU reference, dequantize the experts into the activations' dtype); every
    other weight's, float32 (the linears multiply in float32: quantize_fp8 computes in it too)."""
    return DTYPES[model_dtype] if w.stack else torch.float32


def _fp8_nan(t: torch.Tensor) -> bool:
    return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())


def _check_fp8(w: Weight, scale_w: Weight, ckpt, values: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> None:
    """Fail where a checkpoint's fp8 weight (its values as stored, imported as they are) holds NaN, or times its
    scales (checked finite and positive) goes past the largest of ``dtype`` (``_dequantized_dtype``), naming the
    checkpoint tensors. One pass over the bytes; the scales bound the rest (448 x the largest scale), so the values
    are multiplied out only on failure."""
    if _fp8_nan(values):
        for hf, _ in parts_of(w):
            if _fp8_nan(ckpt.get(hf)):
                raise MxcError(f"{ckpt.directory}: {hf} holds NaN fp8 values (bytes 0x7f or 0xff; weight {w.name}); "
                               f"the checkpoint is damaged")
        raise MxcError(f"{ckpt.directory}: weight {w.name} holds NaN fp8 values; the checkpoint is damaged")
    largest = torch.finfo(dtype).max
    if scales.numel() == 0 or FP8_MAX * float(scales.max()) <= largest:
        return
    if w.stack:
        names = [pair for e in range(full_shape(w)[0]) for pair in zip(w.expert_hf(e), scale_w.expert_hf(e))]
    else:
        names = list(zip(w.hf, scale_w.hf))
    for hf, scale_hf in names:
        part, s = ckpt.get(hf).float(), ckpt.get(scale_hf).float()
        if w.quant.granularity == "block128":
            s = s.repeat_interleave(128, 0)[:part.shape[0]].repeat_interleave(128, 1)[:, :part.shape[1]]
        elif w.quant.granularity == "channel":
            s = s.reshape(-1, 1)
        if not (part * s).to(dtype).isfinite().all():
            name = str(dtype).removeprefix("torch.")
            hint = f"build with a wider --dtype ({WIDER[dtype]})" if dtype in WIDER else "the checkpoint is damaged"
            raise MxcError(f"{ckpt.directory}: {hf} times its scales {scale_hf} (up to {float(s.max()):.4g}) is past "
                           f"{name}'s largest {largest:.4g} (weight {w.name}); {hint}")


def weight_elements(graph: Graph) -> int:
    """Elements in every weight of the graph, each layer's counted without listing the layers (a config's layer
    count is checked against the disk with it before anything walks them)."""
    top = sum(math.prod(w.shape) for w in graph.weights.values())
    return top + sum(r.count * sum(math.prod(w.shape) for w in r.weights.values()) for r in graph.repeats())


def weight_bytes(graph: Graph) -> int:
    """Bytes of tensor data in one rank's weight file (every rank's file holds the same shapes)."""
    return sum(tensor_bytes(DTYPES[w.dtype], w.shape) for w in graph.all_weights())


def write_weights(graph: Graph, ckpt, paths: list[Path], metadata: dict[str, str] | None = None,
                  progress: bool = True, checked: bool = False) -> dict[Path, tuple[str, list[str]]]:
    """Write every weight of ``graph`` into one safetensors file per rank (``paths[r]``), one tensor at a time.

    Each checkpoint tensor is read once, merged and cast, then each rank's
    slice is written to that rank's file: peak memory is about one full weight.
    Tensors are laid out in the order they are written (each fp8 scale after its
    weight), so each file's sha256, and its pieces' (``artifact_format.file_chunks``), comes out of the writing:
    returned by path, (whole, [piece, ...]). ``checked``: the caller ran
    ``check_checkpoint`` already (the build, before its kernels compile).
    """
    if not checked:
        check_checkpoint(graph, ckpt)
    tp = len(paths)
    all_weights = list(graph.all_weights())
    scales = {w.name: w for w in all_weights if w.scale_of}
    weights = []
    for w in all_weights:
        if not w.scale_of:
            weights += [w] + ([scales[f"{w.name}_scale"]] if f"{w.name}_scale" in scales else [])
    placed = {w.name for w in weights}
    weights += [w for w in all_weights if w.name not in placed]  # a scale without its weight (none expected)
    specs = {w.name: (DTYPES[w.dtype], w.shape) for w in weights}
    writers = [SafetensorsWriter(p, specs, metadata) for p in paths]
    try:
        for w in tqdm(weights, desc="converting weights", unit="tensor", disable=not progress, leave=False):
            if w.scale_of:
                continue  # written with its weight
            tensor = read_full(w, ckpt, DTYPES[w.dtype] if w.quant is None else None)
            if w.quant is not None and w.quant.prequantized:
                scale_w = scales[f"{w.name}_scale"]
                outputs = [(w, tensor), (scale_w, _checkpoint_scales(w, scale_w, ckpt))]
                _check_fp8(w, scale_w, ckpt, tensor, outputs[1][1], _dequantized_dtype(w, graph.dtype))
            elif w.quant is not None:
                q, scale = quantize_fp8(tensor, w.quant.granularity, w.segments)
                held = _dequantized_dtype(w, graph.dtype)  # a NaN or inf weight makes its group's scale one
                _check_finite(w, ckpt, (scale * FP8_MAX).to(held), held)
                outputs = [(w, q), (scales[f"{w.name}_scale"], scale)]
            else:
                outputs = [(w, _cast(tensor, DTYPES[w.dtype]))]
                _check_finite(w, ckpt, outputs[0][1])
            for target, full in outputs:
                for rank, out in enumerate(writers):
                    out.write(target.name, rank_tensor(full, target, tp, rank))
            del tensor, outputs
    except BaseException:
        for out in writers:
            out.abort()
        raise
    for out in writers:
        out.close()
    return {out.path: (out.digest, out.chunk_digests) for out in writers if out.digest is not None}
