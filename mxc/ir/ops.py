"""The op set: every op the IR knows, each with one shape/dtype rule.

A rule takes the input types (``None`` for an absent optional input) and the
node's attributes, checks them, and returns the output types. It raises
``RuleError`` with a short message; the verifier adds the node and location.
Shapes are tuples of ints and symbolic token dims ("T" for tokens, "R" for
logit rows). Adding an op = adding one ``OpDef`` here, a torch reference in
``kernels/torch_ref.py`` and a candidate in ``kernels/candidates.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mxc.ir.graph import TensorType


class RuleError(ValueError):
    """An op's inputs or attributes do not fit its rule."""


def _need(cond: bool, msg: Callable[[], str]) -> None:
    if not cond:
        raise RuleError(msg())


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]  # input names; a trailing "?" marks optional
    rule: Callable[..., tuple[TensorType, ...]]
    attrs: tuple[str, ...] = ()  # required attributes
    optional_attrs: tuple[str, ...] = ()
    doc: str = ""
    uses_context: bool = False  # reads the forward context (sequence layout, KV cache)


# --- rules -----------------------------------------------------------------

def _embedding(ids, table, **_):
    _need(len(ids.shape) == 1 and ids.dtype == "int64", lambda: f"ids must be [T] int64, got {ids}")
    _need(len(table.shape) == 2, lambda: f"table must be [vocab, hidden], got {table}")
    return (TensorType((ids.shape[0], table.shape[1]), table.dtype),)


def _rms_norm(x, w, eps, **_):
    _need(len(w.shape) == 1 and x.shape[-1] == w.shape[0], lambda: f"weight {w} does not match the last dim of {x}")
    _need(eps > 0, lambda: f"eps must be > 0, got {eps}")
    return (x,)


def _linear(x, w, bias=None, residual=None, prologue=None, **_):
    _need(len(x.shape) == 2 and len(w.shape) == 2, lambda: f"expects x [T, K] and w [N, K], got {x} and {w}")
    _need(prologue in (None, "silu_mul"), lambda: f"prologue must be None or 'silu_mul', got {prologue!r}")
    k = x.shape[1] // 2 if prologue == "silu_mul" else x.shape[1]
    _need(k == w.shape[1] and (prologue is None or x.shape[1] % 2 == 0),
          lambda: f"x {x}{' (after silu_mul)' if prologue else ''} and weight {w} disagree on K")
    if bias is not None:
        _need(bias.shape == (w.shape[0],), lambda: f"bias {bias} must be [{w.shape[0]}]")
    out = TensorType((x.shape[0], w.shape[0]), x.dtype)
    if residual is not None:
        _need(residual == out, lambda: f"residual {residual} must match the output {out}")
    return (out,)


def _rms_norm_linear(x, norm, w, bias=None, eps=None, **_):
    _need(len(x.shape) == 2 and len(w.shape) == 2, lambda: f"expects x [T, K] and w [N, K], got {x} and {w}")
    _need(eps > 0, lambda: f"eps must be > 0, got {eps}")
    _need(x.shape[1] == w.shape[1] and norm.shape == (x.shape[1],),
          lambda: f"x {x}, norm weight {norm} and weight {w} disagree on K")
    if bias is not None:
        _need(bias.shape == (w.shape[0],), lambda: f"bias {bias} must be [{w.shape[0]}]")
    return (TensorType((x.shape[0], w.shape[0]), x.dtype),)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _heads(x, size, **_):
    _need(_positive_int(size), lambda: f"size must be a positive integer, got {size!r}")
    _need(len(x.shape) == 2 and x.shape[1] % size == 0, lambda: f"cannot split {x} into heads of {size}")
    return (TensorType((x.shape[0], x.shape[1] // size, size), x.dtype),)


def _flatten_heads(x, **_):
    _need(len(x.shape) == 3, lambda: f"expects [T, heads, head_dim], got {x}")
    return (TensorType((x.shape[0], x.shape[1] * x.shape[2]), x.dtype),)


def _rope(q, k, positions, spec, **_):
    _need(len(q.shape) == 3 and len(k.shape) == 3 and q.shape[2] == k.shape[2], lambda: f"q {q} and k {k} must be [T, heads, head_dim]")
    _need(positions.dtype == "int64" and positions.shape == (q.shape[0],), lambda: f"positions {positions} must be [T] int64")
    _need(spec.get("rotary_dim", q.shape[2]) <= q.shape[2], lambda: f"rotary_dim {spec.get('rotary_dim')} exceeds head_dim {q.shape[2]}")
    return (q, k)


def _attention(q, k, v, **attrs):
    _need(len(q.shape) == 3 and k.shape == v.shape and len(k.shape) == 3, lambda: f"expects q, k, v [T, heads, head_dim], got {q}, {k}, {v}")
    _need(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], lambda: f"q {q} and k {k} disagree")
    _need(k.shape[1] != 0 and q.shape[1] % k.shape[1] == 0,
          lambda: f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return (q,)


def _qkv_rope_cache(qkv, positions, q_norm=None, k_norm=None, *, heads, kv_heads, head_dim, **_):
    width = (heads + 2 * kv_heads) * head_dim
    _need(len(qkv.shape) == 2 and qkv.shape[1] == width, lambda: f"qkv {qkv} must be [T, {width}] for {heads}+2*{kv_heads} heads of {head_dim}")
    _need(positions.dtype == "int64" and positions.shape == (qkv.shape[0],), lambda: f"positions {positions} must be [T] int64")
    _need((q_norm is None) == (k_norm is None), lambda: "q_norm and k_norm come together")
    if q_norm is not None:  # per head ([head_dim] each) or over the whole projections (OLMoE)
        per_head = q_norm.shape == (head_dim,) and k_norm.shape == (head_dim,)
        whole = q_norm.shape == (heads * head_dim,) and k_norm.shape == (kv_heads * head_dim,)
        _need(per_head or whole, lambda: f"q/k norm weights {q_norm}, {k_norm} must be [{head_dim}] each (per head) "
                                         f"or [{heads * head_dim}] and [{kv_heads * head_dim}] (whole projections)")
    return (TensorType((qkv.shape[0], heads, head_dim), qkv.dtype),)


def _add_rms_norm(a, b, w, eps, **_):
    _need(a == b, lambda: f"inputs differ: {a} vs {b}")
    return (a,) + _rms_norm(a, w, eps)


def _qlinear(x, w, scale, bias=None, residual=None, granularity=None, prologue=None, **_):
    _need(w.dtype == "float8_e4m3fn", lambda: f"weight {w} must be float8_e4m3fn")
    _need(scale.dtype == "float32", lambda: f"scale {scale} must be float32")
    n, k = w.shape
    want = (n,) if granularity in ("channel", "tensor") else (-(-n // 128), -(-k // 128))
    _need(granularity in ("channel", "tensor", "block128"), lambda: f"unknown granularity {granularity!r}")
    _need(scale.shape == want, lambda: f"{granularity} scale {scale} must be {list(want)} for weight {w}")
    (out,) = _linear(x, TensorType(w.shape, x.dtype), bias, residual, prologue)
    return (out,)


def _rms_norm_qlinear(x, norm, w, scale, bias=None, eps=None, granularity=None, **_):
    _rms_norm(x, norm, eps)
    return _qlinear(x, w, scale, bias, granularity=granularity)


def _rms_norm_mlp(x, norm, w_gate_up, s_gate_up, w_down, s_down, eps=None, granularity=None, interleave=0,
                  residual=True, **_):
    (gate_up,) = _rms_norm_qlinear(x, norm, w_gate_up, s_gate_up, eps=eps, granularity=granularity)
    _need(gate_up.shape[-1] % 2 == 0, lambda: f"gate/up weight {w_gate_up} must have an even number of rows")
    _need(interleave == 0 or (_positive_int(interleave) and gate_up.shape[-1] % (2 * interleave) == 0),
          lambda: f"interleave={interleave!r} must be 0 or a block size dividing half of {w_gate_up}'s rows")
    _need(isinstance(residual, bool), lambda: f"residual={residual!r} must be true or false")
    return _qlinear(TensorType(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,), x.dtype), w_down, s_down,
                    residual=x if residual else None, granularity=granularity)


def _route(logits, k, scoring="softmax", renormalize=False, fp32_weights=False, **_):
    _need(len(logits.shape) == 2, lambda: f"router logits must be [T, experts], got {logits}")
    _need(_positive_int(k) and k <= logits.shape[1], lambda: f"k={k!r} must be in 1..{logits.shape[1]}")
    _need(scoring in ("softmax", "sigmoid"), lambda: f"scoring must be softmax or sigmoid, got {scoring!r}")
    _need(isinstance(fp32_weights, bool), lambda: f"fp32_weights={fp32_weights!r} must be true or false")
    t = logits.shape[0]
    return (TensorType((t, k), "float32" if fp32_weights else logits.dtype), TensorType((t, k), "int64"))


def _add_rms_norm_route(a, b, norm_w, router_w, eps=None, k=None, scoring="softmax", renormalize=False,
                        fp32_weights=False, **_):
    s, h = _add_rms_norm(a, b, norm_w, eps)
    _need(len(router_w.shape) == 2 and router_w.shape[1] == a.shape[-1],
          lambda: f"router weight {router_w} must be [experts, {a.shape[-1]}]")
    return (s, h) + _route(TensorType((a.shape[0], router_w.shape[0]), a.dtype), k, scoring, renormalize,
                           fp32_weights)


def _moe_common(x, weights, ids, w_in, w_down, in_rows):
    _need(len(x.shape) == 2 and weights.shape == ids.shape and ids.dtype == "int64" and weights.shape[0] == x.shape[0],
          lambda: f"expects x [T, H], weights and ids [T, k], got {x}, {weights}, {ids}")
    _need(weights.dtype in (x.dtype, "float32"), lambda: f"routing weights {weights} must be in x's dtype "
                                                          f"({x.dtype}) or float32")
    e, rows, h = w_in.shape
    _need(h == x.shape[1] and w_down.shape[0] == e and w_down.shape[1] == h and w_down.shape[2] * in_rows == rows,
          lambda: f"expert stacks {w_in} / {w_down} do not fit x {x}")
    return (x,)


def _experts(x, weights, ids, w_gate, w_up, w_down, **_):
    _need(w_gate == w_up, lambda: f"gate {w_gate} and up {w_up} stacks differ")
    return _moe_common(x, weights, ids, w_gate, w_down, 1)


def _fused_moe(x, weights, ids, w_gate_up, w_down, s_gate_up=None, s_down=None, residual=None, **_):
    _need((s_gate_up is None) == (s_down is None), lambda: "fp8 expert scales come together")
    if s_gate_up is not None:
        _need(w_gate_up.dtype == w_down.dtype == "float8_e4m3fn", lambda: f"scaled stacks must be fp8, got {w_gate_up}")
        blocks = [(w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128)) for w in (w_gate_up, w_down)]
        _need((s_gate_up.shape, s_down.shape) in ((w_gate_up.shape[:2], w_down.shape[:2]), tuple(blocks)),
              lambda: f"scales {s_gate_up} / {s_down} must be row scales [E, rows] or 128x128 block scales "
                      f"[E, row blocks, column blocks] of {w_gate_up} / {w_down}, both alike")
        w_gate_up, w_down = TensorType(w_gate_up.shape, x.dtype), TensorType(w_down.shape, x.dtype)
    out = _moe_common(x, weights, ids, w_gate_up, w_down, 2)
    if residual is not None:
        _need(residual == out[0], lambda: f"residual {residual} must match the output {out[0]}")
    return out


def _scale_rows(x, s, **_):
    _need(s.shape == (x.shape[0], 1), lambda: f"scale {s} must be [T, 1] for {x}")
    return (x,)


def _all_reduce(x, bias=None, **_):
    if bias is not None:
        _need(bias.shape == (x.shape[-1],), lambda: f"bias {bias} must match the last dim of {x}")
    return (x,)


def _all_reduce_add(x, residual, bias=None, **_):
    _need(x == residual, lambda: f"inputs differ: {x} vs {residual}")
    return _all_reduce(x, bias)


def _all_reduce_add_rms_norm(x, residual, w, bias=None, eps=None, **_):
    return _all_reduce_add(x, residual, bias) + _rms_norm(x, w, eps)


def _linear_all_reduce_add(x, w, residual, bias=None, **_):
    (y,) = _linear(x, w)
    return _all_reduce_add(y, residual, bias)


def _linear_all_reduce_add_rms_norm(x, w, residual, norm_w, bias=None, eps=None, **_):
    (y,) = _linear(x, w)
    return _all_reduce_add_rms_norm(y, residual, norm_w, bias, eps)


def _all_gather(x, world, size=None, **_):
    _need(_positive_int(world), lambda: f"world must be a positive integer, got {world!r}")
    full = x.shape[-1] * world
    _need(size is None or (_positive_int(size) and full - x.shape[-1] < size <= full),
          lambda: f"size must be an integer in ({full - x.shape[-1]}, {full}] (the padded vocabulary's), got {size!r}")
    return (TensorType(x.shape[:-1] + (size or full,), x.dtype),)


def _rank_slice(x, world, **_):
    _need(_positive_int(world), lambda: f"world must be a positive integer, got {world!r}")
    _need(x.shape[-1] % world == 0, lambda: f"the last dim of {x} does not split into {world} equal slices")
    return (TensorType(x.shape[:-1] + (x.shape[-1] // world,), x.dtype),)


def _same2(a, b, **_):
    _need(a == b, lambda: f"inputs differ: {a} vs {b}")
    return (a,)


def _unary(x, **_):
    return (x,)


def _silu_mul(x, **_):
    _need(len(x.shape) == 2 and x.shape[1] % 2 == 0, lambda: f"expects [T, 2*I], got {x}")
    return (TensorType((x.shape[0], x.shape[1] // 2), x.dtype),)


def _split(x, sizes, **_):
    _need(all(_positive_int(s) for s in sizes), lambda: f"sizes must be positive integers, got {list(sizes)}")
    _need(sum(sizes) == x.shape[-1], lambda: f"sizes {list(sizes)} do not add up to the last dim of {x}")
    return tuple(TensorType(x.shape[:-1] + (s,), x.dtype) for s in sizes)


def _gather_rows(x, rows, **_):
    _need(len(rows.shape) == 1 and rows.dtype == "int64", lambda: f"rows must be [R] int64, got {rows}")
    return (TensorType((rows.shape[0],) + x.shape[1:], x.dtype),)


# --- the op list -------------------------------------------------------------

OPS: dict[str, OpDef] = {d.name: d for d in [
    # lookup
    OpDef("embedding", ("ids", "table"), _embedding, doc="rows of table: [T] -> [T, H]"),
    OpDef("gather_rows", ("x", "rows"), _gather_rows, doc="x[rows]: [T, H] -> [R, H]"),
    # elementwise
    OpDef("add", ("a", "b"), _same2),
    OpDef("mul", ("a", "b"), _same2),
    OpDef("silu", ("x",), _unary),
    OpDef("sigmoid", ("x",), _unary),
    OpDef("scale_rows", ("x", "s"), _scale_rows, doc="x * s, s [T, 1] (a gate per token)"),
    OpDef("silu_mul", ("x",), _silu_mul, doc="silu(x[:, :I]) * x[:, I:] (made by merge_gate_up; a model file may "
                                              "use it on a checkpoint's fused [gate; up] projection, whose weight "
                                              "then shards with parts: [I, I])"),
    # normalisation
    OpDef("rms_norm", ("x", "weight"), _rms_norm, attrs=("eps",),
          doc="x / sqrt(mean(x^2) + eps) over the last dim in float32, cast back to x's dtype, then times weight "
              "(Llama's order; not Gemma's (1 + weight); no mean subtracted)"),
    # matmul
    OpDef("linear", ("x", "weight", "bias?", "residual?"), _linear, optional_attrs=("prologue",),
          doc="residual + prologue(x) @ weight.T + bias (prologue and residual made by fuse_linear_io)"),
    # layout
    OpDef("heads", ("x",), _heads, attrs=("size",), doc="[T, n*d] -> [T, n, d]"),
    OpDef("flatten_heads", ("x",), _flatten_heads, doc="[T, n, d] -> [T, n*d]"),
    OpDef("split", ("x",), _split, attrs=("sizes",),
          doc="along the last dim (made by merge_qkv; a model file may split a checkpoint's fused projection, "
              "q, k, v in that order, whose weight then shards with parts: the same sizes)"),
    # attention
    OpDef("rope", ("q", "k", "positions"), _rope, attrs=("spec",),
          doc="rotary embedding of q and k, rotate-half (GPT-NeoX/Llama) convention, on the first rotary_dim dims "
              "of each head (spec from a resolver); not the interleaved pairs of GPT-J/GLM",
          uses_context=True),
    OpDef("attention", ("q", "k", "v"), _attention, attrs=("scale", "layer"),
          optional_attrs=("causal", "sliding_window"),
          doc="causal GQA attention per sequence; reads and appends KV cache slot `layer`",
          uses_context=True),
    # quantized matmul (made by quantize)
    OpDef("qlinear", ("x", "weight", "scale", "bias?", "residual?"), _qlinear, attrs=("granularity",),
          optional_attrs=("prologue",),
          doc="linear over an fp8 weight with its scales; activations quantized per token on the fly"),
    # mixture of experts
    OpDef("route", ("logits",), _route, attrs=("k",), optional_attrs=("scoring", "renormalize", "fp32_weights"),
          doc="scores (softmax/sigmoid, in float32) -> top-k weights and expert ids per token; the weights "
              "rounded to the logits' dtype, or kept in float32 with fp32_weights (transformers' Mixtral)"),
    OpDef("experts", ("x", "weights", "ids", "w_gate", "w_up", "w_down"), _experts,
          doc="sum over each token's experts of weight * down(silu(gate(x)) * up(x)); stacks [E, ...]; weights "
              "in x's dtype, or float32 (Mixtral's: the float32 products summed, then rounded to x's dtype)"),
    OpDef("fused_moe", ("x", "weights", "ids", "w_gate_up", "w_down", "s_gate_up?", "s_down?", "residual?"),
          _fused_moe, doc="experts over a merged gate/up stack [E, 2I, H] -- fuse_moe; fp8 stacks with row scales "
                          "(or an fp8 checkpoint's 128x128 block scales) -- quantize; + residual -- fuse_linear_io"),
    # tensor parallelism (made by shard_tp)
    OpDef("vocab_embedding", ("ids", "table"), _embedding, uses_context=True,
          doc="rows of this rank's vocabulary slice (rank * rows ...), zeros elsewhere; all_reduce completes it"),
    OpDef("all_reduce", ("x", "bias?"), _all_reduce, optional_attrs=("world",), uses_context=True,
          doc="sum over the tensor-parallel ranks, then + bias (the bias of a row-parallel linear)"),
    OpDef("all_gather", ("x",), _all_gather, attrs=("world",), optional_attrs=("size",), uses_context=True,
          doc="concatenate the ranks' slices along the last dim (vocab-parallel logits); the first size of them "
              "(a padded vocabulary)"),
    OpDef("rank_slice", ("x",), _rank_slice, attrs=("world",), uses_context=True,
          doc="this rank's 1/world of the last dim (after a norm over an all_gather of a column-parallel output)"),
    # fused (made by compiler passes)
    OpDef("all_reduce_add", ("x", "residual", "bias?"), _all_reduce_add, optional_attrs=("world",),
          uses_context=True, doc="residual + all_reduce(x, bias) -- fuse_all_reduce"),
    OpDef("all_reduce_add_rms_norm", ("x", "residual", "weight", "bias?"), _all_reduce_add_rms_norm,
          attrs=("eps",), optional_attrs=("world",), uses_context=True,
          doc="s = residual + all_reduce(x, bias); (s, rms_norm(s)) -- fuse_all_reduce"),
    OpDef("linear_all_reduce_add", ("x", "weight", "residual", "bias?"), _linear_all_reduce_add,
          optional_attrs=("world",), uses_context=True,
          doc="residual + all_reduce(linear(x, weight), bias): the GEMV pushes its rows -- fuse_linear_all_reduce"),
    OpDef("linear_all_reduce_add_rms_norm", ("x", "weight", "residual", "norm_weight", "bias?"),
          _linear_all_reduce_add_rms_norm, attrs=("eps",), optional_attrs=("world",), uses_context=True,
          doc="s = residual + all_reduce(linear(x, weight), bias); (s, rms_norm(s)) -- fuse_linear_all_reduce"),
    OpDef("add_rms_norm", ("a", "b", "weight"), _add_rms_norm, attrs=("eps",),
          doc="s = a + b; (s, rms_norm(s)) -- fuse_add_rms_norm"),
    OpDef("add_rms_norm_route", ("a", "b", "norm_weight", "router_weight"), _add_rms_norm_route,
          attrs=("eps", "k"), optional_attrs=("scoring", "renormalize", "fp32_weights"), uses_context=True,
          doc="s = a + b; h = rms_norm(s); (s, h, route(linear(h, router_weight), k)) -- fuse_norm_route"),
    OpDef("rms_norm_linear", ("x", "norm_weight", "weight", "bias?"), _rms_norm_linear, attrs=("eps",),
          doc="linear(rms_norm(x, norm_weight), weight, bias) -- fuse_norm_linear"),
    OpDef("rms_norm_qlinear", ("x", "norm_weight", "weight", "scale", "bias?"), _rms_norm_qlinear,
          attrs=("eps", "granularity"),
          doc="qlinear(rms_norm(x, norm_weight), weight, scale, bias) -- fuse_norm_linear, then quantize"),
    OpDef("rms_norm_mlp", ("x", "norm_weight", "w_gate_up", "s_gate_up", "w_down", "s_down"), _rms_norm_mlp,
          attrs=("eps", "granularity"), optional_attrs=("interleave", "residual"),
          doc="x + qlinear(silu_mul(rms_norm_qlinear(x, norm_weight, w_gate_up, s_gate_up)), w_down, s_down): a "
              "decoder layer's fp8 MLP and its residual add, one op (residual=false: without the add, a "
              "tensor-parallel rank's part before the all-reduce); interleave: gate/up rows in blocks -- fuse_mlp, "
              "interleave_gate_up"),
    OpDef("qkv_rope_cache", ("qkv", "positions", "q_norm?", "k_norm?"), _qkv_rope_cache,
          attrs=("heads", "kv_heads", "head_dim", "spec", "layer"), optional_attrs=("eps",),
          doc="split merged qkv, optional q/k RMSNorm (per head, or over the whole projection when the weights "
              "are that wide), rotate q and k, write k and v to KV cache "
              "slot `layer`; returns q -- fuse_rope_cache", uses_context=True),
    OpDef("cached_attention", ("q",), lambda q, **_: (q,), attrs=("scale", "layer"),
          optional_attrs=("causal", "sliding_window", "early_dependents"),
          doc="attention over KV cache slot `layer`, which the preceding qkv_rope_cache filled -- fuse_rope_cache; "
              "early_dependents: at decode its last kernel lets the next one launch early -- early_launch_o_proj",
          uses_context=True),
]}

# the ops passes make (fusions, sharding, quantization): a model file may call them, but writes the others; an
# unknown op's error lists those
COMPILER_OPS = frozenset({
    "qlinear", "fused_moe", "vocab_embedding", "all_reduce", "all_gather", "rank_slice", "all_reduce_add",
    "all_reduce_add_rms_norm", "linear_all_reduce_add", "linear_all_reduce_add_rms_norm", "add_rms_norm",
    "add_rms_norm_route", "rms_norm_linear", "rms_norm_qlinear", "rms_norm_mlp", "qkv_rope_cache",
    "cached_attention"})


def n_outputs(op: str, attrs: dict) -> int:
    if op == "split":
        return len(attrs.get("sizes", ()))
    if op == "add_rms_norm_route":
        return 4
    return 2 if op in ("rope", "add_rms_norm", "all_reduce_add_rms_norm", "linear_all_reduce_add_rms_norm",
                       "route") else 1


def infer(op: str, in_types: list, attrs: dict) -> tuple[TensorType, ...]:
    """Apply ``op``'s rule. Raises RuleError on a mismatch."""
    d = OPS[op]
    names = [n.rstrip("?") for n in d.inputs]
    if len(in_types) > len(names):
        raise RuleError(f"takes at most {len(names)} inputs ({', '.join(d.inputs)}), got {len(in_types)}")
    for n, t in zip(d.inputs, list(in_types) + [None] * (len(names) - len(in_types))):
        if t is None and not n.endswith("?"):
            raise RuleError(f"input {n!r} is required")
    missing = [a for a in d.attrs if a not in attrs]
    if missing:
        raise RuleError(f"missing attribute(s) {', '.join(missing)}")
    known = set(d.attrs) | set(d.optional_attrs) | {"kernel", "kernel_reason"}
    extra = [a for a in attrs if a not in known]
    if extra:
        raise RuleError(f"unknown attribute(s) {', '.join(extra)}; {op} takes {', '.join(sorted(known - {'kernel', 'kernel_reason'})) or 'none'}")
    rule_attrs = {k: v for k, v in attrs.items() if k in d.attrs or k in d.optional_attrs}
    return d.rule(*in_types, **rule_attrs)
