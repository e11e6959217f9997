"""fuse_rope_attention: the RoPE/KV-write op and the attention that reads it become one op.

Matches (after ``fuse_rope_cache``)::

    q = qkv_rope_cache(qkv, positions, q_norm, k_norm, heads=HQ, kv_heads=HKV, head_dim=D, spec=S, eps=e, layer=i)
    a = cached_attention(q, scale=s, layer=i, sliding_window=w)       # q read only here

Rewrites to::

    a = rope_cache_attention(qkv, positions, q_norm, k_norm, heads=HQ, kv_heads=HKV, head_dim=D, spec=S,
                             eps=e, layer=i, scale=s, sliding_window=w)

At decode its GPU kernel rotates q and the new k in the attention's own split programs, takes the
new token's row from registers and writes k and v to the cache as it goes: one launch a layer
instead of two (the RoPE kernel was 84 us of a 4.4 ms Llama-3-8B step on the H200, 2026-11-30);
prefill runs the two kernels as before. Requires: q has no other reader; q/k norms per head or
none (a norm over a whole projection, OLMoE, needs every head of the token: not fused).
Preserves: the attention output's name and the math (the same rounding steps; bit for bit against
the two kernels under the interpreter; on the GPU the per-head q/k norm's fp32 sum runs over other
tiles, so a rounded q or k can differ by an ulp now and then).
"""

from __future__ import annotations

from mxc.compiler.rewrite import apply_rules
from mxc.ir import Graph, Node


def _match(attn: Node, ctx):
    rope = ctx.producing(attn.ins[0])
    if rope is None or rope.op != "qkv_rope_cache" or len(ctx.users.get(attn.ins[0], [])) != 1:
        return None
    if rope.attrs["layer"] != attn.attrs["layer"]:
        return None
    if len(rope.ins) > 2:
        norm = ctx.weights.get(rope.ins[2])
        if norm is None or tuple(norm.shape) != (rope.attrs["head_dim"],):
            return None  # a whole-projection q/k norm (or not a weight)
    attrs = {**{k: v for k, v in rope.attrs.items() if k not in ("kernel", "kernel_reason")},
             **{k: v for k, v in attn.attrs.items() if k not in ("kernel", "kernel_reason")}}
    return {ctx.index(rope): [], ctx.index(attn): [Node("rope_cache_attention", attn.outs, rope.ins, attrs, rope.loc)]}


def run(graph: Graph, options) -> Graph:
    return apply_rules(graph, [("cached_attention", _match)])[0]
