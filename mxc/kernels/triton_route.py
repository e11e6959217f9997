"""The MoE router in one Triton kernel: ``route(logits [T, E], k)`` -> ``(weights [T, k], ids [T, k])``.

The same as ``moe_ref.route``: scores = softmax (or sigmoid) of the logits in fp32, the k largest
with their expert ids, optionally renormalised to sum to 1, weights rounded to the logits' dtype (with
``fp32_weights``, kept in fp32: transformers' Mixtral; the kernels store in the weights buffer's dtype).
The torch composition is about eight launches a layer (softmax, top-k's gather and sort,
the sum, the division, dtype casts): at batch-1 decode of a 48-layer MoE (Qwen3-30B-A3B on an
H200) they took ~0.9 ms of a 4.04 ms step. One program per token: the row of E <= 1024 scores
stays in registers, and the top k come out of one bitonic top-k over keys that pack each score above
its reversed expert id (``TOPK``; or k rounds of (max, lowest index holding it, mask)). Ties go to the
lower expert id (``torch.topk`` leaves their order unspecified).

``add_rms_norm_route`` (decode at up to ``candidates.NORM_ROUTE_MAX_TOKENS`` = 16 tokens; the ``fuse_norm_route``
pass) also takes the three kernels before it: the residual add, the RMSNorm and the router GEMV. Its grid is a
column of programs a token. Each program reads ROWS router rows (before its PDL wait: weights), normalises its token's
row itself (H values: cheap next to the router's E x H), writes its ROWS logits, and the last of
the token's programs to finish (an atomic count a token, left at 0 for the next call) routes the
token from the logits the others wrote. Each column's program 0 also writes the token's residual
sum and normalised row, which the experts read. Until 2026-12-06 one column of programs took the
tokens in turn and its last program routed them all: at 8 tokens 18.9 us a call against 6.1 now, and the
Qwen3-30B-A3B fp8 step at batch 8 6.94 ms against 6.30 (batch 1 2.21 against 2.20; one H100,
``bench/moe_lab.py`` and ``bench/decode_ab.py``, docs/perf.md "sixty-eighth run"). On the Qwen3-30B-A3B
shape at batch 1 (H200, 2026-11-30) it took 5.8 us a layer at 2 rows and 8 warps a program against
~6.8 us for the three kernels, and the step went from 2.73 to 2.65 ms; one row a program took 5.35 us
in ``bench/moe_lab.py`` with the rounds at one warp, and 4.67 us with the bitonic top-k at two (the
default since 2026-12-03, ``_config``: the step 2.519 against 2.541 ms). ``PACKED`` (one reduction a
top-k round instead of two) stays an option: it measured no faster at one warp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxc.kernels.launch import cdiv, launch, next_pow2
from mxc.kernels.pdl import pdl_enter, reads_before_wait

MAX_EXPERTS = 1024
# the most tokens the fused norm + router takes (its counts' length); builds send it at most
# ``candidates.NORM_ROUTE_MAX_TOKENS``, past which the three kernels are faster, and bench/moe_lab.py times it to here
NORM_ROUTE_TOKENS = 32
TOPK_WAYS = ("rounds", "packed", "bitonic")
# How the routers take the top k (``_route_row``): "rounds" (two reductions a round), "packed" (one) or
# "bitonic" (``tl.topk`` over the packed keys). A/B knob, read at launch. Bitonic, with two warps a program
# (``_config``): Qwen3-30B-A3B bf16 batch 1 2.519 against 2.541 ms a step with rounds at one warp, every one of
# five interleaved rounds 0.02 ms apart (one H200, 2026-12-03, ``bench/decode_ab.py``); the fused router added
# 3.58 us a layer instead of 4.10. At one warp bitonic took 2.539.
TOPK = "bitonic"


@triton.jit
def top_k_scores(x, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr = False,
                 BITONIC: tl.constexpr = False):
    """One token's routing from its logits ``x`` [BLOCK_E] in fp32 (-inf past E): (weights [BLOCK_K] fp32,
    ids [BLOCK_K] int64), the first K of each meaningful.

    k rounds of (max score, lowest expert holding it): two reductions a round, or with ``PACKED`` one,
    over int64 keys (the score's bits, >= 0 for every score, above the reversed expert id). ``BITONIC``
    takes the same keys' top BLOCK_K in one bitonic top-k (``tl.topk``: log2(BLOCK_E) merge stages
    instead of k rounds of full reductions); at k = 1 it is the packed round."""
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:  # torch's softmax: exp(x - max) / sum
        p = tl.exp(x - tl.max(x, axis=0))
        s = p / tl.sum(p, axis=0)
    s = tl.where(ok, s, -1.0)  # below every score (sigmoid and softmax are >= 0)
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    if PACKED or BITONIC:  # distinct keys: their order is the rounds' (score, then the lower expert id)
        key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
        key = tl.where(ok, key, -1)
    if BITONIC and BLOCK_K > 1:  # a top 1 is the packed round's one max (Triton 3.6's tl.topk fails at k = 1)
        top = tl.topk(key, BLOCK_K)  # descending; past E only when BLOCK_K > K
        w = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        ids = BLOCK_E - 1 - (top & 0xFFFFFFFF)
    elif PACKED or BITONIC:
        for j in tl.static_range(K):
            top = tl.max(key, axis=0)
            idx = BLOCK_E - 1 - (top & 0xFFFFFFFF)
            w = tl.where(offs_k == j, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), w)
            ids = tl.where(offs_k == j, idx, ids)
            key = tl.where(offs == idx, -1, key)
    else:
        for j in tl.static_range(K):
            best = tl.max(s, axis=0)
            idx = tl.min(tl.where(s == best, offs, BLOCK_E), axis=0)
            w = tl.where(offs_k == j, best, w)
            ids = tl.where(offs_k == j, idx.to(tl.int64), ids)
            s = tl.where(offs == idx, -2.0, s)
    if RENORMALIZE:
        w = w / tl.sum(tl.where(offs_k < K, w, 0.0), axis=0)
    return w, ids


@triton.jit
def _route_row(x, weights_ptr, ids_ptr, t, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr = False,
               BITONIC: tl.constexpr = False):
    """Route token ``t`` from its logits ``x`` (``top_k_scores``): store its k weights and ids."""
    w, ids = top_k_scores(x, E, K, BLOCK_E, BLOCK_K, SIGMOID, RENORMALIZE, PACKED, BITONIC)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + t * K + offs_k, w.to(weights_ptr.dtype.element_ty), mask=offs_k < K)
    tl.store(ids_ptr + t * K + offs_k, ids, mask=offs_k < K)


@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
                 USE_PDL: tl.constexpr = False, BITONIC: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    _route_row(x, weights_ptr, ids_ptr, t, E, K, BLOCK_E, BLOCK_K, SIGMOID, RENORMALIZE, BITONIC=BITONIC)


@reads_before_wait("router_w_ptr", "norm_w_ptr")
@triton.jit
def norm_route_kernel(a_ptr, b_ptr, norm_w_ptr, router_w_ptr, s_ptr, h_ptr, logits_ptr, weights_ptr, ids_ptr,
                      count_ptr, eps, H: tl.constexpr, BLOCK_H: tl.constexpr, E: tl.constexpr,
                      ROWS: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr = False,
                      USE_PDL: tl.constexpr = False, BITONIC: tl.constexpr = False):
    """Program (p, t): router rows [p * ROWS, +ROWS) for token t; the last of token t's programs routes it."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    rows = pid * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < E
    # weights: never written by the kernel ahead, so read before the wait
    wr = tl.load(router_w_ptr + rows[:, None] * H + offs_h[None, :], mask=rows_ok[:, None] & h_ok[None, :],
                 other=0.0).to(tl.float32)
    nw = tl.load(norm_w_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    ty = s_ptr.dtype.element_ty
    row = t * H  # T <= 32 rows of H <= 8192: int32 offsets
    a = tl.load(a_ptr + row + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    s = (a + b).to(ty)  # torch_ref.add_rms_norm: the sum rounded, then normalised
    x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    h = ((x * rstd).to(ty).to(tl.float32) * nw).to(ty)  # rounded before the weight, as HF
    if pid == 0:
        tl.store(s_ptr + row + offs_h, s, mask=h_ok)
        tl.store(h_ptr + row + offs_h, h, mask=h_ok)
    logit = tl.sum(wr * h.to(tl.float32)[None, :], axis=1)  # the router linear, rounded to the dtype
    tl.store(logits_ptr + t * E + rows, logit.to(ty), mask=rows_ok)
    # release: this program's logits are visible to whichever of the token's programs counts last (Triton puts a
    # barrier before a scalar atomic: every warp's stores are in; checked in the sm_90 PTX, 3.6 and 3.9)
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        offs_e = tl.arange(0, BLOCK_E)
        lt = tl.load(logits_ptr + t * E + offs_e, mask=offs_e < E, other=float("-inf"), volatile=True)
        _route_row(lt.to(tl.float32), weights_ptr, ids_ptr, t, E, K, BLOCK_E, BLOCK_K, SIGMOID,
                   RENORMALIZE, PACKED, BITONIC)
        tl.store(count_ptr + t, 0)  # for the next call (the next kernel's count starts after this one ends)


def _config(H: int) -> tuple[int, int]:
    """(router rows a program, warps): one row a program, next_pow2(H) / 2048 warps, at least two and at most
    eight. On the Qwen3-30B-A3B shape at batch 1 (E = 128, H = 2048; one H200, Triton 3.6,
    ``bench/moe_lab.py``, each call reading another layer's router): with the bitonic top-k (2026-12-03) one row
    and two warps took 4.67 us (one warp 4.98; 4.65-4.71 for 1-2 rows at 2-8 warps), against 5.35 us for the
    rounds at one row and one warp, the best of the rounds (2026-11-30: 5.7-8.4 us for 2-8 rows at 1-8 warps),
    5.44 for the packed rounds and 7.15 for the three kernels."""
    return 1, max(2, min(8, next_pow2(H) // 2048))


def _topk_constexprs(topk: str | None) -> dict:
    """The kernels' top-k constexprs for ``topk`` (None: ``TOPK``), each passed only when set: the rounds keep the
    binaries they had before the other ways existed."""
    topk = topk or TOPK
    if topk not in TOPK_WAYS:
        raise ValueError(f"topk must be one of {', '.join(TOPK_WAYS)}, got {topk!r}")
    return {"rounds": {}, "packed": {"PACKED": True}, "bitonic": {"BITONIC": True}}[topk]


def add_rms_norm_route(a: torch.Tensor, b: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor,
                       ctx=None, *, eps: float, k: int, scoring: str = "softmax", renormalize: bool = False,
                       fp32_weights: bool = False, rows: int | None = None, num_warps: int | None = None,
                       topk: str | None = None):
    """``s = a + b``, ``h = rms_norm(s, norm_weight)``, then ``route(linear(h, router_weight), k, ...)`` in one
    kernel, for 1..NORM_ROUTE_TOKENS (32) tokens: returns ``(s, h, weights, ids)`` as
    ``torch_ref.add_rms_norm_route`` (the weights in a's dtype, or in fp32 with ``fp32_weights``).

    ``ctx`` (a ``ForwardContext``) keeps the kernel's counter (``counters``), shared by every layer of
    a call; without one it is allocated per call. ``rows`` (router rows a program, a power of two),
    ``num_warps`` and ``topk`` (one of ``TOPK_WAYS``, ``_route_row``) override the defaults
    (``bench/moe_lab.py`` times them). Runs on ``meta`` tensors too."""
    T, H = a.shape
    E = router_weight.shape[0]
    assert 1 <= T <= NORM_ROUTE_TOKENS, f"add_rms_norm_route: 1..{NORM_ROUTE_TOKENS} tokens, got {T}"
    assert b.shape == a.shape and b.dtype == a.dtype and a.is_contiguous() and b.is_contiguous(), \
        "add_rms_norm_route: a and b must be contiguous, of one shape and dtype"
    assert norm_weight.shape == (H,) and router_weight.shape == (E, H) and router_weight.is_contiguous(), \
        f"add_rms_norm_route: weights {tuple(norm_weight.shape)}, {tuple(router_weight.shape)} do not fit H={H}"
    if not 1 <= k <= E <= MAX_EXPERTS:
        raise ValueError(f"need 1 <= k <= E <= {MAX_EXPERTS}, got k={k}, E={E}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be softmax or sigmoid, got {scoring!r}")
    # one count a token; always the most tokens' worth, so that no batch's call replaces the tensor that a CUDA graph
    # captured at another batch holds
    count = ctx.counters("route", NORM_ROUTE_TOKENS, a.device) if ctx is not None else \
        torch.zeros(T, dtype=torch.int32, device=a.device)
    s, h = torch.empty_like(a), torch.empty_like(a)
    logits = torch.empty((T, E), dtype=a.dtype, device=a.device)
    weights = torch.empty((T, k), dtype=torch.float32 if fp32_weights else a.dtype, device=a.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=a.device)
    default_rows, default_warps = _config(H)
    rows = rows or default_rows
    launch(norm_route_kernel, (cdiv(E, rows), T),
           [a, b, norm_weight, router_weight, s, h, logits, weights, ids, count, float(eps)],
           dict(H=H, BLOCK_H=next_pow2(H), E=E, ROWS=rows, K=k, BLOCK_E=next_pow2(E),
                BLOCK_K=next_pow2(k), SIGMOID=scoring == "sigmoid", RENORMALIZE=bool(renormalize),
                **_topk_constexprs(topk)),
           num_warps=num_warps or default_warps, num_stages=1)
    return s, h, weights, ids


def route(logits: torch.Tensor, k: int, scoring: str = "softmax", renormalize: bool = False,
          fp32_weights: bool = False, topk: str | None = None):
    """``moe_ref.route`` in one kernel: logits [T, E] (contiguous; fp32, fp16 or bf16) ->
    (weights [T, k] in the logits' dtype, or fp32 with ``fp32_weights``, ids [T, k] int64). ``topk`` as in
    ``add_rms_norm_route``; this kernel has no packed way (it runs as rounds). Runs on ``meta`` tensors too."""
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= k <= E <= MAX_EXPERTS:
        raise ValueError(f"need 1 <= k <= E <= {MAX_EXPERTS}, got k={k}, E={E}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be softmax or sigmoid, got {scoring!r}")
    weights = torch.empty((T, k), dtype=torch.float32 if fp32_weights else logits.dtype, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        launch(route_kernel, (T,), [logits, weights, ids],
               dict(E=E, K=k, BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(k),
                    SIGMOID=scoring == "sigmoid", RENORMALIZE=bool(renormalize),
                    **{n: v for n, v in _topk_constexprs(topk).items() if n == "BITONIC"}),
               num_warps=4 if E > 256 else 1, num_stages=1)
    return weights, ids
