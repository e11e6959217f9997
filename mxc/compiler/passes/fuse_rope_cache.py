"""fuse_rope_cache: q/k/v split, per-head norms, RoPE and the KV-cache write become one op.

Matches (from each ``attention`` node whose q, k and v come from one ``split``)::

    q0, k0, v0 = split(qkv, sizes=[HQ*D, HKV*D, HKV*D])
    q = heads(q0, size=D); k = heads(k0, size=D); v = heads(v0, size=D)
    q = rms_norm(q, q_norm, eps); k = rms_norm(k, k_norm, eps)        # optional, per head (Qwen3)
    q, k = rope(q, k, positions, spec=S)
    a = attention(q, k, v, scale=s, layer=i, sliding_window=w)

Rewrites to::

    q = qkv_rope_cache(qkv, positions, q_norm, k_norm, heads=HQ, kv_heads=HKV, head_dim=D, spec=S, eps=eps, layer=i)
    a = cached_attention(q, scale=s, layer=i, sliding_window=w)

``qkv_rope_cache`` writes k and v into KV-cache slot ``layer``; the
``cached_attention`` right after it reads them (program order is the
dependence; no pass reorders nodes). The old chain is left to
``eliminate_dead_code``. A norm over each whole projection (OLMoE: ``q0`` and
``k0`` normed with [HQ*D] and [HKV*D] weights before ``heads``) is fused the same
way; the op tells the two apart by the norm weights' width. Requires: the three come from one split with exactly
those sizes; norms on both q and k or neither, with one eps. Preserves: the
attention output name and the math (tested numerically against the unfused graph).
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _back(value, ctx, op):
    node = ctx.producing(value)
    return node if node is not None and node.op == op else None


def _unnorm(value, ctx):
    """(input, weight, eps) of the rms_norm producing ``value``, or (value, None, None)."""
    norm = _back(value, ctx, "rms_norm")
    return (norm.ins[0], norm.ins[1], norm.attrs["eps"]) if norm else (value, None, None)


def _match(attn: Node, ctx):
    q, k, v = attn.ins[:3]
    rope = _back(q, ctx, "rope")
    if rope is None or rope.outs != (q, k):
        return None
    qh, q_norm, q_eps = _unnorm(rope.ins[0], ctx)
    kh, k_norm, k_eps = _unnorm(rope.ins[1], ctx)
    if (q_norm is None) != (k_norm is None) or q_eps != k_eps:
        return None
    vh = v
    heads = [_back(x, ctx, "heads") for x in (qh, kh, vh)]
    if any(h is None for h in heads):
        return None
    parts = [h.ins[0] for h in heads]
    if q_norm is None:  # a norm over each whole projection, before the heads view (OLMoE)?
        whole = [_back(x, ctx, "rms_norm") for x in parts[:2]]
        if all(whole) and whole[0].attrs["eps"] == whole[1].attrs["eps"]:
            q_norm, k_norm, q_eps = whole[0].ins[1], whole[1].ins[1], whole[0].attrs["eps"]
            parts = [whole[0].ins[0], whole[1].ins[0], parts[2]]
    split = _back(parts[0], ctx, "split")
    if split is None or parts != list(split.outs):
        return None
    d = heads[0].attrs["size"]
    if any(h.attrs["size"] != d for h in heads):
        return None
    hq, hkv, hkv2 = (s // d for s in split.attrs["sizes"])
    if hkv != hkv2 or [hq * d, hkv * d, hkv * d] != list(split.attrs["sizes"]):
        return None
    attrs = {"heads": hq, "kv_heads": hkv, "head_dim": d, "spec": rope.attrs["spec"], "layer": attn.attrs["layer"]}
    if q_eps is not None:
        attrs["eps"] = q_eps
    ins = (split.ins[0], rope.ins[2]) + ((q_norm, k_norm) if q_norm else ())
    fused = Node("qkv_rope_cache", (ctx.fresh("q_rot"),), ins, attrs, rope.loc)
    att_attrs = {k: val for k, val in attn.attrs.items() if k not in ("kernel", "kernel_reason")}
    cached = Node("cached_attention", attn.outs, fused.outs, att_attrs, attn.loc)
    return {ctx.index(attn): [fused, cached]}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("attention", _match)])[0]
