"""Adapters between IR ops that read the forward context and the GPU kernels.

The generated program calls ``cuda_ops.<op>(inputs..., ctx, attrs...)`` with
the IR's calling convention; these functions pick the context's device
tensors (KV cache of the layer, cache locations, sequence tables, RoPE
tables), or the kernels for the token count (``rms_norm_linear``), and call
the kernels' wrappers: Triton, cuBLAS through torch, the CUTLASS and MLP-pair
libraries, the peer-memory all-reduces. Nothing here reads device values on the
host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import json

import torch

from mxc.kernels import (cublas, fp8_gemm, launch, mlp_pair_fp8, peer_allreduce, torch_ref, triton_attention,
                         triton_elementwise, triton_fp8, triton_gemv, triton_norm, triton_rope, triton_route)
from mxc.kernels.context import ForwardContext


def rms_norm_linear_small_m(x, norm_weight, weight, bias=None, eps=1e-6):
    """<= 32 tokens: the RMSNorm kernel, then the GEMV (the LM head under fp8 without
    ``--quant-lm-head``; the GEMV's own RMSNorm prologue measured slower, see ``triton_gemv``)."""
    return triton_gemv.linear_small_m(triton_norm.rms_norm(x, norm_weight, eps), weight, bias)


def rms_norm_linear(x, norm_weight, weight, bias=None, eps=1e-6):
    """Larger token counts: the RMSNorm kernel, then cuBLAS."""
    return cublas.linear(triton_norm.rms_norm(x, norm_weight, eps), weight, bias)


def rms_norm_qlinear_small_m(x, norm_weight, weight, scale, bias=None, eps=1e-6, granularity="channel"):
    """<= 32 tokens, fp8 weights: the quantize kernel normalises the row, then the fp8 GEMV."""
    return triton_fp8.qlinear_small_m(x, weight, scale, bias, granularity=granularity, prologue="rms_norm",
                                      norm_weight=norm_weight, eps=eps)


def rms_norm_qlinear_scaled_mm(x, norm_weight, weight, scale, bias=None, eps=1e-6, granularity="channel"):
    """Larger token counts, row-wise scales: the quantize kernel normalises the row, then cuBLASLt."""
    return fp8_gemm.scaled_mm(x, weight, scale, bias, granularity=granularity, prologue="rms_norm",
                              norm_weight=norm_weight, eps=eps)


def rms_norm_qlinear_cutlass(x, norm_weight, weight, scale, bias=None, eps=1e-6, granularity="channel"):
    """Larger token counts, row-wise scales: the quantize kernel normalises the row, then the CUTLASS fp8 GEMM."""
    return fp8_gemm.cutlass(x, weight, scale, bias, granularity=granularity, prologue="rms_norm",
                            norm_weight=norm_weight, eps=eps)


def rms_norm_qlinear_gemm(x, norm_weight, weight, scale, bias=None, eps=1e-6, granularity="channel"):
    """Larger token counts (block scales): the quantize kernel normalises the row, then the Triton fp8 GEMM."""
    return triton_fp8.qlinear_gemm(x, weight, scale, bias, granularity=granularity, prologue="rms_norm",
                                   norm_weight=norm_weight, eps=eps)


# ``rms_norm_mlp`` (fuse_mlp): x + down(silu_mul(gate_up(rms_norm(x)))). Each runs the unfused nodes' kernels, in
# the same order, so the results are theirs; at decode token counts the SiLU moves into the gate/up GEMV.

# ``interleave`` (``interleave_gate_up``): the gate/up weight's rows, and so gate/up's columns, alternate in blocks
# of that many gates and their ups; every kernel below reads that layout. ``residual=False``: no x + (a
# tensor-parallel rank's part, summed by the all-reduce after it).

def _mlp_chain(gate_up_fn, down_fn, doc: str):
    """The fused op as its two unfused nodes' kernels: ``gate_up_fn`` (an ``rms_norm_qlinear_*``), then ``down_fn``
    (a qlinear kernel) with the SiLU-and-mul prologue and x as the residual."""
    def run(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps=1e-6, granularity="channel", interleave=0,
            residual=True):
        gate_up = gate_up_fn(x, norm_weight, w_gate_up, s_gate_up, None, eps, granularity)
        return down_fn(gate_up, w_down, s_down, None, x if residual else None, granularity=granularity,
                       prologue="silu_mul", interleave=interleave)

    run.__doc__ = doc
    return run


def rms_norm_mlp_small_m(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps=1e-6, granularity="channel",
                         interleave=0, residual=True):
    """<= 32 tokens: the RMSNorm-quantize, the fp8 GEMV with SiLU-and-mul in its epilogue (where its config
    allows; else the SiLU kernel after it), then the GEMV with the residual (after its quantize kernel, or
    none: ``WEIGHT_ONLY``). The unfused nodes' values: the epilogue rounds gate and up as their GEMV's output."""
    act = triton_fp8.qlinear_small_m(x, w_gate_up, s_gate_up, granularity=granularity, prologue="rms_norm",
                                     norm_weight=norm_weight, eps=eps, epilogue="silu_mul", interleave=interleave)
    return triton_fp8.qlinear_small_m(act, w_down, s_down, None, x if residual else None, granularity=granularity)


_cutlass_chain = _mlp_chain(rms_norm_qlinear_cutlass, fp8_gemm.cutlass, "")
SILU_PAIR = True  # False: an interleaved MLP runs the chain's kernels, as halves do (A/B in one artifact)


def rms_norm_mlp_cutlass(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps=1e-6, granularity="channel",
                         interleave=0, residual=True):
    """Each linear the CUTLASS fp8 GEMM. Interleaved gate/up (and a library with the SiLU-pair kernels for that
    interleave): the RMSNorm-quantize, the SiLU-pair GEMM (SiLU-and-mul in its epilogue: h and its row maxima
    out), ``quantize_max``, the down GEMM with the residual in its epilogue (``fp8_gemm.silu_pair``); the same
    values as the chain. Otherwise the chain: the gate/up GEMM, the SiLU-and-mul quantize, the down GEMM.
    Recording on ``meta``, both paths' Triton kernels are recorded (the artifact's library decides at load)."""
    meta = x.device.type == "meta"
    if interleave and SILU_PAIR and (meta or fp8_gemm.has_silu_pair(interleave, w_gate_up.shape[1])):
        quantized = fp8_gemm.silu_pair(x, norm_weight, w_gate_up, s_gate_up, eps, interleave)
        out = fp8_gemm.cutlass(x, w_down, s_down, None, x if residual else None, granularity=granularity,
                               quantized=quantized)
        if not meta:
            return out
    return _cutlass_chain(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps, granularity, interleave, residual)


rms_norm_mlp_scaled_mm = _mlp_chain(rms_norm_qlinear_scaled_mm, fp8_gemm.scaled_mm,
                                    "Each linear cuBLASLt fp8 (torch._scaled_mm).")
rms_norm_mlp_gemm = _mlp_chain(rms_norm_qlinear_gemm, triton_fp8.qlinear_gemm,
                               "Each linear the Triton fp8 GEMM (block scales).")


MLP_PAIR = True  # False: rms_norm_mlp_pair runs rms_norm_mlp_small_m's kernels instead (A/B in one artifact)


def rms_norm_mlp_pair(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps=1e-6, granularity="channel"):
    """<= 8 tokens: ``mlp_pair_fp8``'s persistent kernel, one launch (the artifact's library; programmatic
    dependent launch where the kernels around it use it). Launches no Triton kernel, so a build records none."""
    if not MLP_PAIR:
        return rms_norm_mlp_small_m(x, norm_weight, w_gate_up, s_gate_up, w_down, s_down, eps, granularity)
    out = torch.empty_like(x)
    if x.device.type == "meta":
        return out
    pair = mlp_pair_fp8.active()
    pair.rms_norm_pair(x, norm_weight, eps, w_gate_up, s_gate_up, w_down, s_down, x, out,
                       mlp_pair_fp8.workspace(w_down.shape[1], x.device), pdl=launch.pdl_active())
    return out


_SPEC_KEYS: dict[int, tuple[dict, str]] = {}  # id(spec) -> (spec, its JSON): a forward passes the same dicts


def _spec_key(spec: dict) -> str:
    """The RoPE spec's JSON, the tables' key: serialised once a spec object (a layer's call asks for it)."""
    known = _SPEC_KEYS.get(id(spec))  # holding the spec keeps its id from being reused
    if known is None:
        if len(_SPEC_KEYS) >= 256:
            _SPEC_KEYS.clear()
        known = _SPEC_KEYS[id(spec)] = (spec, json.dumps(spec, sort_keys=True))
    return known[1]


def _tables(ctx: ForwardContext, spec: dict):
    key = _spec_key(spec)
    if key not in ctx.rope_tables:  # filled by the first (eager) call, reused by every later one
        max_len = ctx.k_cache[0].shape[1]
        ctx.rope_tables[key] = triton_rope.rope_tables(spec, max_len, ctx.k_cache[0].device)
    return ctx.rope_tables[key]


def qkv_rope_cache(qkv, positions, q_norm=None, k_norm=None, ctx: ForwardContext = None, *, heads, kv_heads,
                   head_dim, spec, layer, eps=None):
    cos, sin = _tables(ctx, spec)
    return triton_rope.rope_qkv_write(qkv, positions, cos, sin, ctx.k_cache[layer], ctx.v_cache[layer],
                                      ctx.cache_loc, q_norm, k_norm, eps if eps is not None else 1e-6)


def all_reduce_one_shot(x, bias=None, ctx: ForwardContext = None, world=None):
    """The decode all-reduce over peer memory (``peer_allreduce``) where the runtime set it up
    (``ctx.peer_allreduce``) and ``x`` fits its buffer, else NCCL as ``torch_ref.all_reduce`` (a prefill's
    rows)."""
    comm = ctx.peer_allreduce
    if comm is None or ctx.world_size == 1 or x.device.type == "meta" or not comm.fits(x):
        return torch_ref.all_reduce(x, bias, ctx)
    out = comm(x)
    return out if bias is None else out + bias


def all_reduce_add(x, residual, bias=None, ctx: ForwardContext = None, world=None):
    """The all-reduce (peer memory or NCCL, as ``all_reduce_one_shot``), then the Triton add."""
    return triton_elementwise.add(residual, all_reduce_one_shot(x, bias, ctx))


def all_reduce_add_rms_norm(x, residual, weight, bias=None, ctx: ForwardContext = None, eps=1e-6, world=None):
    """The all-reduce (peer memory or NCCL, as ``all_reduce_one_shot``), then the Triton add + RMSNorm."""
    return triton_norm.add_rms_norm(all_reduce_one_shot(x, bias, ctx), residual, weight, eps)


def _push_comm(x, ctx, world, w=None):
    """The runtime's push all-reduce (``peer_allreduce.PushAllReduce``) for ``x`` (with ``w``: for the rows
    of ``x @ w^T``, which the GEMV pushes itself), or "record" when the build traces on ``meta`` (the
    kernels' launches are recorded for the artifact), or None (fall back: no push all-reduce here, more
    rows than its buffer takes, or a GEMV that cannot push: a K split)."""
    if w is not None and not triton_gemv.pushes(x.shape[0], w.shape[0], w.shape[1], x.dtype):
        return None
    if x.device.type == "meta":
        return "record" if world and world > 1 else None
    comm = ctx.peer_allreduce
    rows = x if w is None else torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="meta")
    return comm if ctx.world_size > 1 and hasattr(comm, "add_rms_norm") and comm.fits(rows) else None


def _record_push(x, world, w=None, **kw):
    """The push kernel's launch for the recorder (the build's trace on ``meta``); with ``w``, the GEMV
    ``x @ w^T`` that pushes its rows, then the kernel that waits for them."""
    bufs = torch.empty(world, dtype=torch.int64, device=x.device)
    state = torch.empty(4, dtype=torch.int32, device=x.device)
    if w is None:
        return peer_allreduce.push_all_reduce(x, bufs, state, 0, world * x.numel(), world, **kw)
    slot = world * x.shape[0] * w.shape[0]
    triton_gemv.linear_small_m_push(x, w, bufs, state, 0, slot, world)
    rows = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="meta")
    return peer_allreduce.push_all_reduce(rows, bufs, state, 0, slot, world, pushed=True, **kw)


def all_reduce_push(x, bias=None, ctx: ForwardContext = None, world=None):
    """Sum over the ranks by the push all-reduce (``peer_allreduce``), + bias."""
    comm = _push_comm(x, ctx, world)
    if comm is None:
        return all_reduce_one_shot(x, bias, ctx)
    return _record_push(x, world, bias=bias) if comm == "record" else comm(x, bias)


def all_reduce_add_push(x, residual, bias=None, ctx: ForwardContext = None, world=None):
    """``residual + all_reduce(x, bias)`` in one push all-reduce kernel."""
    comm = _push_comm(x, ctx, world)
    if comm is None:
        return all_reduce_add(x, residual, bias, ctx)
    if comm == "record":  # and the fallback's add, for a runtime without peer memory
        all_reduce_add(x, residual, bias, ctx)
        return _record_push(x, world, residual=residual, bias=bias)
    return comm.add(x, residual, bias)


def all_reduce_add_rms_norm_push(x, residual, weight, bias=None, ctx: ForwardContext = None, eps=1e-6, world=None):
    """``s = residual + all_reduce(x, bias)`` and ``rms_norm(s)`` in one push all-reduce kernel."""
    comm = _push_comm(x, ctx, world)
    if comm is None:
        return all_reduce_add_rms_norm(x, residual, weight, bias, ctx, eps)
    if comm == "record":  # and the fallback's add + RMSNorm, for a runtime without peer memory
        all_reduce_add_rms_norm(x, residual, weight, bias, ctx, eps)
        return _record_push(x, world, residual=residual, weight=weight, bias=bias, eps=eps)
    return comm.add_rms_norm(x, residual, weight, eps, bias)


def linear_all_reduce_add_push(x, weight, residual, bias=None, ctx: ForwardContext = None, world=None):
    """``residual + all_reduce(x @ weight^T, bias)``: the GEMV pushes its rows into the peers' buffers
    and one kernel waits, sums and adds; else the GEMV, then ``all_reduce_add_push``."""
    comm = _push_comm(x, ctx, world, weight)
    if comm is None:
        return all_reduce_add_push(triton_gemv.linear_small_m(x, weight), residual, bias, ctx, world)
    if comm == "record":  # and the unfused path, for a runtime without peer memory
        all_reduce_add_push(triton_gemv.linear_small_m(x, weight), residual, bias, ctx, world)
        return _record_push(x, world, weight, residual=residual, bias=bias)
    return comm.linear_add(x, weight, residual, bias)


def linear_all_reduce_add_rms_norm_push(x, weight, residual, norm_weight, bias=None, ctx: ForwardContext = None,
                                        eps=1e-6, world=None):
    """``s = residual + all_reduce(x @ weight^T, bias)`` and ``rms_norm(s)``, as ``linear_all_reduce_add_push``."""
    comm = _push_comm(x, ctx, world, weight)
    if comm is None:
        return all_reduce_add_rms_norm_push(triton_gemv.linear_small_m(x, weight), residual, norm_weight, bias, ctx,
                                            eps, world)
    if comm == "record":
        all_reduce_add_rms_norm_push(triton_gemv.linear_small_m(x, weight), residual, norm_weight, bias, ctx, eps,
                                     world)
        return _record_push(x, world, weight, residual=residual, weight=norm_weight, bias=bias, eps=eps)
    return comm.linear_add_rms_norm(x, weight, residual, norm_weight, eps, bias)


def linear_all_reduce_add(x, weight, residual, bias=None, ctx: ForwardContext = None, world=None):
    """More tokens than the pushing GEMV serves: cuBLAS, then ``all_reduce_add``."""
    return all_reduce_add(cublas.linear(x, weight), residual, bias, ctx)


def linear_all_reduce_add_rms_norm(x, weight, residual, norm_weight, bias=None, ctx: ForwardContext = None, eps=1e-6,
                                   world=None):
    """More tokens than the pushing GEMV serves: cuBLAS, then ``all_reduce_add_rms_norm``."""
    return all_reduce_add_rms_norm(cublas.linear(x, weight), residual, norm_weight, bias, ctx, eps)


def add_rms_norm_route(a, b, norm_weight, router_weight, ctx: ForwardContext = None, *, eps, k, scoring="softmax",
                       renormalize=False, fp32_weights=False):
    """More tokens than the fused kernel serves (``triton_route.add_rms_norm_route``): the Triton add +
    RMSNorm, the router GEMM by cuBLAS, the Triton router."""
    s, h = triton_norm.add_rms_norm(a, b, norm_weight, eps)
    return (s, h) + triton_route.route(cublas.linear(h, router_weight), k, scoring, renormalize, fp32_weights)


def fused_moe(x, weights, ids, w_gate_up, w_down, s_gate_up=None, s_down=None, residual=None):
    from mxc.kernels import triton_moe

    return triton_moe.fused_moe(x, weights, ids, w_gate_up, w_down, s_gate_up=s_gate_up, s_down=s_down,
                                residual=residual)


def fused_moe_pairs(x, weights, ids, w_gate_up, w_down, s_gate_up=None, s_down=None, residual=None):
    from mxc.kernels import triton_moe_decode

    return triton_moe_decode.fused_moe(x, weights, ids, w_gate_up, w_down, s_gate_up=s_gate_up, s_down=s_down,
                                       residual=residual)


def cached_attention(q, ctx: ForwardContext, scale, layer, causal=True, sliding_window=None, early_dependents=False):
    if not causal:  # the kernels mask causally; the candidate declines such a node (``candidates._attention_ok``)
        raise ValueError("cuda_ops.cached_attention: the Triton attention kernels are causal only, got causal=False")
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    if ctx.decode:
        return triton_attention.decode_attention(q, k_cache, v_cache, ctx.slots_t, ctx.kv_lens, scale,
                                                 sliding_window, early_dependents=early_dependents)
    return triton_attention.prefill_attention(q, k_cache, v_cache, ctx.slots_t, ctx.kv_lens, ctx.q_start,
                                              ctx.max_q_len, scale, sliding_window)
