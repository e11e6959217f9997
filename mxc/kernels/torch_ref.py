"""Torch reference implementations: one function per IR op.

These are the oracle for every other kernel and the CPU target's code path.
They are written for clarity and numerical fidelity with Hugging Face
transformers (reductions in float32, results cast back), not for speed.
Generated forward programs call them as ``torch_ref.<op>(inputs..., attrs...)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxc.kernels import rope as rope_ref
from mxc.kernels.context import ForwardContext


def embedding(ids, table):
    return F.embedding(ids, table)


def gather_rows(x, rows):
    return x.index_select(0, rows)


def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def silu(x):
    return F.silu(x)


def silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x, weight, bias=None, residual=None, prologue=None):
    if prologue == "silu_mul":
        x = silu_mul(x)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def heads(x, size):
    return x.view(x.shape[0], -1, size)


def flatten_heads(x):
    return x.reshape(x.shape[0], -1)


def split(x, sizes):
    return tuple(x.split(list(sizes), dim=-1))


def rope(q, k, positions, ctx: ForwardContext, spec):
    key = ("rope", id(spec))
    if key not in ctx.memo:  # one cos/sin table per call, shared by all layers
        ctx.memo[key] = rope_ref.cos_sin(spec, positions, q.dtype)
    cos, sin = ctx.memo[key]
    return rope_ref.apply_rope(q, cos, sin), rope_ref.apply_rope(k, cos, sin)


def attention(q, k, v, ctx: ForwardContext, scale, layer, causal=True, sliding_window=None):
    """Causal GQA attention per sequence of the flattened batch, through the KV cache if any.

    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Token j of sequence b sits at
    position past_lens[b] + j and sees keys at positions p with p <= its own
    and (with a sliding window w) p > its own - w.
    """
    out = torch.empty_like(q)
    start = 0
    for b, n in enumerate(ctx.seq_lens):
        past = ctx.past_lens[b]
        qb, kb, vb = q[start:start + n], k[start:start + n], v[start:start + n]
        if ctx.k_cache is not None:
            slot = ctx.slots[b]
            ctx.k_cache[layer][slot, past:past + n] = kb
            ctx.v_cache[layer][slot, past:past + n] = vb
            kb, vb = ctx.k_cache[layer][slot, :past + n], ctx.v_cache[layer][slot, :past + n]
        out[start:start + n] = _attend(qb, kb, vb, past, scale, causal, sliding_window)
        start += n
    return out


def _attend(q, k, v, past, scale, causal, sliding_window):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    qpos = past + torch.arange(q.shape[0], device=q.device).unsqueeze(1)
    kpos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    allowed = torch.ones_like(scores[0], dtype=torch.bool)
    if causal:
        allowed &= kpos <= qpos
    if sliding_window is not None:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


# --- fused ops (made by compiler passes) ----------------------------------------

def add_rms_norm(a, b, weight, eps):
    s = a + b
    return s, rms_norm(s, weight, eps)


def add_rms_norm_route(a, b, norm_weight, router_weight, ctx=None, *, eps, k, scoring="softmax", renormalize=False,
                       fp32_weights=False):
    s, h = add_rms_norm(a, b, norm_weight, eps)
    return (s, h) + route(linear(h, router_weight), k, scoring, renormalize, fp32_weights)


def rms_norm_linear(x, norm_weight, weight, bias=None, eps=1e-6):
    return linear(rms_norm(x, norm_weight, eps), weight, bias)


def qkv_rope_cache(qkv, positions, q_norm=None, k_norm=None, ctx: ForwardContext = None, *, heads, kv_heads,
                   head_dim, spec, layer, eps=None):
    """split + optional q/k RMSNorm (over the whole projections when the weights are that wide, as
    OLMoE; else per head, as Qwen3) + heads + RoPE, then k and v into KV-cache slot ``layer``; returns q."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    whole = q_norm is not None and q_norm.shape[-1] != head_dim
    if whole:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k, v = (t.reshape(t.shape[0], -1, head_dim) for t in (q, k, v))
    if q_norm is not None and not whole:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rope(q, k, positions, ctx, spec)
    start = 0
    for b, n in enumerate(ctx.seq_lens):
        slot, past = ctx.slots[b], ctx.past_lens[b]
        ctx.k_cache[layer][slot, past:past + n] = k[start:start + n]
        ctx.v_cache[layer][slot, past:past + n] = v[start:start + n]
        start += n
    return q


def cached_attention(q, ctx: ForwardContext, scale, layer, causal=True, sliding_window=None, early_dependents=False):
    """Attention of q over KV-cache slot ``layer`` (already holding this call's keys and values).
    ``early_dependents`` orders GPU launches (``early_launch_o_proj``); nothing here."""
    out = torch.empty_like(q)
    start = 0
    for b, n in enumerate(ctx.seq_lens):
        slot, past = ctx.slots[b], ctx.past_lens[b]
        kb, vb = ctx.k_cache[layer][slot, :past + n], ctx.v_cache[layer][slot, :past + n]
        out[start:start + n] = _attend(q[start:start + n], kb, vb, past, scale, causal, sliding_window)
        start += n
    return out


# --- tensor parallelism (made by shard_tp) ---------------------------------------

def vocab_embedding(ids, table, ctx: ForwardContext):
    """This rank's vocabulary slice starts at rank * rows; other ids give zero rows."""
    rows = table.shape[0]
    local = ids - ctx.rank * rows
    mine = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), table)
    return out * mine.unsqueeze(-1).to(out.dtype)


def all_reduce(x, bias=None, ctx: ForwardContext = None, world=None):
    if ctx.world_size > 1 and x.device.type != "meta":  # meta: the build's shape-only trace
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=ctx.group)
    return x if bias is None else x + bias


def all_reduce_add(x, residual, bias=None, ctx: ForwardContext = None, world=None):
    return add(residual, all_reduce(x, bias, ctx))


def all_reduce_add_rms_norm(x, residual, weight, bias=None, ctx: ForwardContext = None, eps=1e-6, world=None):
    return add_rms_norm(residual, all_reduce(x, bias, ctx), weight, eps)


def linear_all_reduce_add(x, weight, residual, bias=None, ctx: ForwardContext = None, world=None):
    return all_reduce_add(linear(x, weight), residual, bias, ctx)


def linear_all_reduce_add_rms_norm(x, weight, residual, norm_weight, bias=None, ctx: ForwardContext = None, eps=1e-6,
                                   world=None):
    return all_reduce_add_rms_norm(linear(x, weight), residual, norm_weight, bias, ctx, eps)


def all_gather(x, ctx: ForwardContext, world, size=None):
    """The ranks' slices concatenated along the last dim; the first ``size`` columns (a padded vocabulary's)."""
    if world == 1:
        return x
    if x.device.type == "meta":  # the build's shape-only trace
        return torch.cat([x] * world, dim=-1)[..., :size]
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=ctx.group)
    out = torch.cat(parts, dim=-1)
    return out if size is None else out[..., :size].contiguous()


def rank_slice(x, ctx: ForwardContext, world):
    """This rank's columns of a gathered [..., world * n]: ``all_gather``'s inverse."""
    n = x.shape[-1] // world
    return x.narrow(-1, ctx.rank * n, n).contiguous() if world > 1 else x


# --- quantized matmul (made by quantize) ----------------------------------------

def rms_norm_qlinear(x, norm_weight, weight, scale, bias=None, eps=1e-6, granularity="channel"):
    return qlinear(rms_norm(x, norm_weight, eps), weight, scale, bias, granularity=granularity)


def rms_norm_mlp(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps=1e-6, granularity="channel",
                 interleave=0, residual=True):
    gate_up = rms_norm_qlinear(x, norm_weight, w_gate_up, s_gate_up, None, eps, granularity)
    return qlinear(halves(gate_up, interleave), w_down, s_down, None, x if residual else None, granularity,
                   prologue="silu_mul")


def halves(gate_up, interleave=0):
    """[..., 2I] with gate and up columns interleaved in blocks of ``interleave`` (``interleave_gate_up``) as
    [gate | up]; unchanged for 0."""
    if not interleave:
        return gate_up
    *lead, n = gate_up.shape
    blocks = gate_up.reshape(*lead, n // (2 * interleave), 2, interleave)
    return blocks.transpose(-3, -2).reshape(*lead, n)


def qlinear(x, weight, scale, bias=None, residual=None, granularity="channel", prologue=None):
    from mxc.kernels import fp8_ref

    return fp8_ref.qlinear(x, weight, scale, bias, residual, granularity, prologue)


# --- mixture of experts ------------------------------------------------------------

def sigmoid(x):
    return torch.sigmoid(x)


def scale_rows(x, s):
    return x * s


def route(logits, k, scoring="softmax", renormalize=False, fp32_weights=False):
    from mxc.kernels import moe_ref

    return moe_ref.route(logits, k, scoring, renormalize, fp32_weights)


def experts(x, weights, ids, w_gate, w_up, w_down):
    from mxc.kernels import moe_ref

    return moe_ref.experts(x, weights, ids, w_gate, w_up, w_down)


def fused_moe(x, weights, ids, w_gate_up, w_down, s_gate_up=None, s_down=None, residual=None):
    from mxc.kernels import moe_ref
    from mxc.kernels.fp8_ref import dequantize_experts

    if s_gate_up is not None:  # fp8 experts: weight-only, dequantized (activations stay in x's dtype)
        w_gate_up, w_down = (dequantize_experts(w, s, x.dtype) for w, s in ((w_gate_up, s_gate_up), (w_down, s_down)))
    y = moe_ref.fused_moe(x, weights, ids, w_gate_up, w_down)
    return y if residual is None else add(residual, y)
