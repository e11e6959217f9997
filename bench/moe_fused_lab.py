"""Lab: the batch-1 MoE experts as one kernel, gate/up and down together, partial outputs summed by fp32 atomics.

Today (``triton_moe_decode``) a Qwen3-30B-A3B layer's experts take two kernels at one token: the gate/up pair
kernel (14.9 us a layer in the step for 12.1 us of bytes) and the tiled down kernel (9.1 us for 6.1 us of bytes:
latency-bound, its programs wait on the gate/up kernel's last ones), then the next layer's RMSNorm. Here one
program takes (pair p = t * k + j, a slice of BN intermediate columns):

    h[s]   = silu(x[t] @ gate_e[s]^T) * (x[t] @ up_e[s]^T)            (rounded as the pair kernel rounds it)
    acc[t] += weights[t, j] * (down_e[:, s] @ h[s])                  (fp32 atomics into acc [T, H])

so no program waits on another: the down slice streams right after the program's own gate/up rows, and every
program's bytes (gate/up 2 * BN rows, down BN columns) are in flight from the kernel's start. The finish kernel
(one program a token) then rounds acc to the model dtype, adds the residual, writes it, RMSNorms it (the next
layer's input norm, which the down kernel's residual add is followed by today) and zeroes acc for the next layer.

What differs from the pair kernels: each expert's output is not rounded to the dtype before its routing weight
(the k terms and the slices are summed in fp32, rounded once), and the sum's order is the atomics' (not bit-
reproducible run to run). The down weights are read in the checkpoint's layout [E, H, I] (a slice is BN
columns of every row: BN * 2 contiguous bytes a row) or transposed at load ([E, I, H]: BN whole rows).

On the GPU (`bash bench/gpu_session.sh moefused`): checks every variant against the torch reference, then times
32 layers of [router -> experts -> norm] in one CUDA graph with PDL: the shipped kernels against each variant.
Kill criterion: no variant at least 2 us a layer under the shipped chain.
On the CPU: ``TRITON_INTERPRET=1 python bench/moe_fused_lab.py --check`` (Triton interpreter, small shapes).

Measured on one H200 (2026-12-04, docs/perf.md, fortieth run; six calls, the sets of ``VARIANTS`` below): the best
fused config is 1.65-1.93 us a layer under the shipped chain (29.2-29.5 us), short of the criterion, and its fp32
atomics make the sums' order, so the output's last bits, vary run to run; the order-independent int64 sums cost
6-8 us more. Dropped. What the lab found instead: the fused kernel's down chunks lost 1.5 us a layer in a loop
against unrolled, and the shipped gate/up pair kernel's K loop unrolled (``pair_experts``) took 28.51 against 29.44
us a layer: ``triton_moe_decode.PairConfig.UNROLL``, now the default.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mxc.kernels import launch as L  # noqa: E402
from mxc.kernels.launch import cdiv, next_pow2  # noqa: E402
from mxc.kernels.pdl import pdl_enter, prefetch_l2  # noqa: E402
from mxc.kernels.triton_gemv import dot_gate_up_rows  # noqa: E402


@triton.jit
def _fused_kernel(x_ptr, w1_ptr, w2_ptr, ids_ptr, wts_ptr, acc_ptr,
                  E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                  BN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                  DOWN_T: tl.constexpr, PREFETCH: tl.constexpr, STORE: tl.constexpr = False,
                  COPIES: tl.constexpr = 1, PIPE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    t = pair // TOP_K
    ty = x_ptr.dtype.element_ty
    e = tl.load(ids_ptr + pair)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    rn = offs_n % I
    if DOWN_T:
        d_base = w2_ptr + e * (I * H) + rn[:, None] * H  # [BN, 1]: row i of down^T
        d_step = 1
    else:
        d_base = w2_ptr + e * (H * I) + rn[:, None]  # [BN, 1]: column i of down
        d_step = I
    if PREFETCH:  # the down slice asked of L2 before the gate/up rows are read
        if DOWN_T:
            prefetch_l2(d_base + tl.arange(0, H // 64)[None, :] * 64)
        else:
            prefetch_l2(w2_ptr + e * (H * I) + tl.arange(0, H)[None, :] * I + (tl.program_id(1) * BN))
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w1_ptr + e * (2 * I * H) + rn[:, None] * H + offs_k[None, :]
    if PIPE:  # the next step's tiles loaded before this step's products; the first down chunk before the sums
        x_ptrs = x_ptr + t * H + offs_k
        xk = tl.load(x_ptrs)
        gk = tl.load(g_ptrs)
        uk = tl.load(g_ptrs + I * H)
        acc_g = tl.zeros((BN, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BN, BLOCK_K), dtype=tl.float32)
        for k in range(BLOCK_K, H, BLOCK_K):
            xn = tl.load(x_ptrs + k)
            gn = tl.load(g_ptrs + k)
            un = tl.load(g_ptrs + I * H + k)
            acc_g += gk.to(tl.float32) * xk.to(tl.float32)[None, :]
            acc_u += uk.to(tl.float32) * xk.to(tl.float32)[None, :]
            xk, gk, uk = xn, gn, un
        w0 = tl.load(d_base + tl.arange(0, BLOCK_H)[None, :] * d_step)
        acc_g += gk.to(tl.float32) * xk.to(tl.float32)[None, :]
        acc_u += uk.to(tl.float32) * xk.to(tl.float32)[None, :]
        gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    else:
        gate, up = dot_gate_up_rows(x_ptr + t * H + offs_k, g_ptrs, g_ptrs + I * H, H, BN, BLOCK_K)
    gate = gate.to(ty).to(tl.float32)
    up = up.to(ty).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
    h = (act * up).to(ty).to(tl.float32)
    wt = tl.where(valid, tl.load(wts_ptr + pair).to(tl.float32), 0.0)
    hw = tl.where(offs_n < I, h * wt, 0.0)
    for c in tl.static_range(0, H, BLOCK_H):  # unrolled: a loop (tl.range) measured 1.5-1.8 us a layer slower
        cols = c + tl.arange(0, BLOCK_H)
        if PIPE and c == 0:
            w = w0.to(tl.float32)
        else:
            w = tl.load(d_base + cols[None, :] * d_step).to(tl.float32)  # [BN, BLOCK_H]
        y = tl.sum(w * hw[:, None], axis=0)
        dst = acc_ptr + (tl.program_id(1) % COPIES) * (tl.num_programs(0) // TOP_K * H) + t * H + cols
        if STORE:  # timing only: plain stores (wrong sums), what the atomics cost
            tl.store(dst, y)
        elif acc_ptr.dtype.element_ty == tl.int64:  # fixed point, 32 fraction bits: integer sums, any order
            # (truncated: an fp32 y * 2^32 of 2^24 or more is an integer already, so only |y| < 2^-8 loses < 2^-32)
            tl.atomic_add(dst, (y * 4294967296.0).to(tl.int64), sem="relaxed")
        else:
            tl.atomic_add(dst, y, sem="relaxed")


@triton.jit
def _finish_kernel(acc_ptr, r_ptr, nw_ptr, res_out_ptr, out_ptr, eps,
                   H: tl.constexpr, BLOCK_H: tl.constexpr, COPIES: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    T = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    ty = r_ptr.dtype.element_ty
    a = tl.zeros((BLOCK_H,), tl.float32)
    for c in tl.static_range(COPIES):
        if acc_ptr.dtype.element_ty == tl.int64:
            a += (tl.load(acc_ptr + c * T * H + t * H + cols, mask=ok, other=0).to(tl.float64)
                  * (1.0 / 4294967296.0)).to(tl.float32)
        else:
            a += tl.load(acc_ptr + c * T * H + t * H + cols, mask=ok, other=0.0)
    # A guard, not a known fix: the second GPU call's check failed (0.64 of the output's scale) before this barrier
    # was added, though that code's PTX already issued these loads ahead of the zeroing; every check since passed.
    tl.debug_barrier()
    for c in tl.static_range(COPIES):
        tl.store(acc_ptr + c * T * H + t * H + cols, tl.zeros((BLOCK_H,), acc_ptr.dtype.element_ty), mask=ok)
    a = a.to(ty).to(tl.float32)
    s = (tl.load(r_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32) + a).to(ty)
    tl.store(res_out_ptr + t * H + cols, s, mask=ok)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
    y = (sf * rstd).to(ty).to(tl.float32) * tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def fused_experts(x, weights, ids, w1, w2, acc, *, down_t: bool, bn: int = 16, block_k: int = 256,
                  block_h: int = 512, warps: int = 4, prefetch: bool = False, store: bool = False,
                  copies: int = 1, pipe: bool = False, fixed: bool = False) -> None:
    """Add the experts' output of x [T, H] into acc [copies, T, H] fp32 (zero before; slice s of the intermediate
    adds into copy s % copies). w2 is [E, H, I], or [E, I, H] with ``down_t``."""
    T, H = x.shape
    E, two_i, _ = w1.shape
    I, k = two_i // 2, ids.shape[1]
    L.launch(_fused_kernel, (T * k, cdiv(I, bn)), [x, w1, w2, ids, weights, acc],
             dict(E=E, H=H, I=I, TOP_K=k, BN=bn, BLOCK_K=min(block_k, H), BLOCK_H=min(block_h, H), DOWN_T=down_t,
                  PREFETCH=prefetch, STORE=store, COPIES=copies, PIPE=pipe), num_warps=warps, num_stages=1)


def finish(acc, residual, norm_weight, eps: float):
    """(residual + the sum of acc's copies rounded, rms_norm of that); acc zeroed."""
    T, H = residual.shape
    res_out, out = torch.empty_like(residual), torch.empty_like(residual)
    L.launch(_finish_kernel, (T,), [acc, residual, norm_weight, res_out, out, float(eps)],
             dict(H=H, BLOCK_H=next_pow2(H), COPIES=acc.shape[0]), num_warps=max(1, min(8, next_pow2(H) // 256)), num_stages=1)
    return res_out, out


def reference(x, weights, ids, w1, w2, residual, norm_weight, eps):
    from mxc.kernels import moe_ref, torch_ref

    y = moe_ref.fused_moe(x, weights, ids, w1, w2)
    s = (residual.float() + y.float()).to(x.dtype)
    return s, torch_ref.rms_norm(s, norm_weight, eps)


# The first call (2026-12-04) timed down_t in (True, False), bn in (8, 16, 32), block_h in (256, 512), warps in
# (4, 8), prefetch in (False, True): best bn=32 block_h=512 warps=8, untransposed, no prefetch, 1.05 us a layer over
# the shipped chain; every transposed variant slower still (5-111 us). The second: bn in (32, 64), block_h in (512,
# 1024), warps in (8, 16), acc in 1 or 4 copies, plain stores in place of the atomics: best bn=32 block_h=1024
# warps=16, one copy, 1.93 us a layer under the shipped chain; plain stores 0.28 us faster than the atomics, more
# copies slower. This third set: more warps, wider K steps, the gate/up loop pipelined by hand (``pipe``: Triton's
# num_stages does not pipeline these loads, no cp.async in the PTX).
# The third (four configs a call): hand pipelining slower (registers), wider K steps slower, 32 warps slower;
# int64 fixed-point sums (order-independent: ``acc`` int64, 32 fraction bits) cost 6-8 us more than fp32 atomics.
# Every config so far held more than 64 registers a thread at 16 warps (the best: 105): one program an SM, so
# 192 programs ran in 1.45 waves. The fourth: configs whose programs all fit at once (cuobjdump, sm_90), with the
# down chunks in a loop not unrolled (``tl.range``): none faster; the best config itself lost 1.5 us that way.
VARIANTS = [dict(down_t=False, bn=32, block_h=1024, warps=16, block_k=256)]


def pair_experts(x, weights, ids, w1, w2, residual, *, up_unrolled: bool, down_unrolled: bool):
    """The shipped two-kernel experts (``triton_moe_decode.fused_moe``, its default configs) with either kernel's K
    loop unrolled or not (``PairConfig.UNROLL``; the lab first measured copies of the two kernels, 2026-12-04)."""
    from dataclasses import replace

    from mxc.kernels import triton_moe_decode as tmd

    up, down = tmd.config_for(x.shape[1], w2.shape[2], x.dtype, ids.shape[1])
    return tmd.fused_moe(x, weights, ids, w1, w2, residual=residual,
                         configs=(replace(up, UNROLL=up_unrolled), replace(down, UNROLL=down_unrolled)))


def check(device: str, E: int, H: int, I: int, K: int, T: int = 1, variants=VARIANTS) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dt).to(device)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(dt).to(device)
    w2t = w2.transpose(1, 2).contiguous()
    x = torch.randn(T, H, generator=g).to(dt).to(device)
    r = torch.randn(T, H, generator=g).to(dt).to(device)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt).to(device)
    scores = torch.randn(T, E, generator=g).softmax(-1)
    wts, ids = torch.topk(scores, K, dim=-1)
    wts, ids = (wts / wts.sum(-1, keepdim=True)).to(dt).to(device), ids.to(device)
    ids[0, -1] = E + 3  # an invalid id contributes nothing
    # the reference drops invalid ids: give them a zero weight instead
    wts_ref = wts.masked_fill(ids >= E, 0)
    ref_s, ref_h = reference(x, wts_ref, ids.clamp(max=E - 1), w1, w2, r, nw, 1e-6)
    for v in variants:
        if v.get("store"):
            continue
        acc = torch.zeros(v.get("copies", 1), T, H, dtype=torch.int64 if v.get("fixed") else torch.float32,
                          device=device)
        fused_experts(x, wts, ids, w1, w2t if v["down_t"] else w2, acc, **v)
        s, h = finish(acc, r, nw, 1e-6)
        assert torch.count_nonzero(acc) == 0, "finish left acc non-zero"
        if v.get("fixed"):  # integer sums: the same bits whatever order the atomics land in
            fused_experts(x, wts, ids, w1, w2t if v["down_t"] else w2, acc, **v)
            assert torch.equal(finish(acc, r, nw, 1e-6)[0], s), (v, "not reproducible")
        for got, want in ((s, ref_s), (h, ref_h)):
            err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
            assert err < 2.5e-2, (v, err, "residual sum" if got is s else "normed")
    rolled = pair_experts(x, wts, ids, w1, w2, r, up_unrolled=False, down_unrolled=False)
    for uu, du in ((True, False), (False, True), (True, True)):
        got = pair_experts(x, wts, ids, w1, w2, r, up_unrolled=uu, down_unrolled=du)
        assert torch.equal(got, rolled), (uu, du, "the unrolled loops differ from the loops")
    print(f"check {device}: {len(variants)} variants match the reference", flush=True)


def time_chain(layer, layers: int = 32) -> float:
    """us a layer: ``layer(i)`` for i < layers in one CUDA graph launched with PDL (``moe_lab.time_us``)."""
    from moe_lab import time_us

    return time_us(layer, calls=layers, pdl=True)


def bench(rounds: int) -> None:
    from moe_lab import H, I, K, chain_inputs

    from mxc.kernels import triton_moe_decode as tmd
    from mxc.kernels import triton_norm

    c = chain_inputs()
    w1, w2, nw, route = c.w1, c.w2, c.nw, c.route
    w2t = w2.transpose(1, 2).contiguous()
    accs = {(c, fx): torch.zeros(c, 1, H, dtype=torch.int64 if fx else torch.float32, device="cuda")
            for c in (1, 4) for fx in (False, True)}

    def shipped(i):
        s, h, wts, ids = route(i)
        y = tmd.fused_moe(h, wts, ids, w1, w2, residual=s)
        return triton_norm.rms_norm(y, nw, 1e-6)

    def fused(v):
        def layer(i):
            s, h, wts, ids = route(i)
            acc = accs[v.get("copies", 1), v.get("fixed", False)]
            fused_experts(h, wts, ids, w1, w2t if v["down_t"] else w2, acc, **v)
            return finish(acc, s, nw, 1e-6)
        return layer

    router_only = route

    bytes_ = K * 3 * I * H * 2
    print(f"expert bytes a layer {bytes_ / 1e6:.1f} MB", flush=True)
    results: dict[str, list[float]] = {}
    names = {"router only": router_only, "shipped": shipped,
             "second call's best": fused(dict(down_t=False, bn=32, block_h=1024, warps=16))}
    for v in VARIANTS:
        names[" ".join(f"{k}={val}" for k, val in v.items())] = fused(v)
    for uu, du in ((True, False), (False, True), (True, True), (False, False)):
        def pairs(i, uu=uu, du=du):
            s, h, wts, ids = route(i)
            y = pair_experts(h, wts, ids, w1, w2, s, up_unrolled=uu, down_unrolled=du)
            return triton_norm.rms_norm(y, nw, 1e-6)
        names[f"pair kernels, up unrolled {uu}, down unrolled {du}"] = pairs
    for r in range(rounds):
        for name, fn in names.items():
            try:
                t = time_chain(fn)
            except Exception as e:  # out of resources
                print(f"  skip {name}: {type(e).__name__} {str(e)[:80]}", flush=True)
                continue
            results.setdefault(name, []).append(t)
    base = sorted(results["shipped"])[len(results["shipped"]) // 2]
    router = sorted(results["router only"])[len(results["router only"]) // 2]
    for name, ts in sorted(results.items(), key=lambda kv: sorted(kv[1])[len(kv[1]) // 2]):
        med = sorted(ts)[len(ts) // 2]
        print(f"{name:60s} {med:7.2f} us a layer ({'/'.join(f'{t:.2f}' for t in ts)}), "
              f"{med - base:+6.2f} vs shipped, experts+norm {med - router:6.2f} us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="CPU: the interpreter against the reference, small shapes")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.check:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--check runs under TRITON_INTERPRET=1"
        check("cpu", E=8, H=64, I=48, K=4, T=2, variants=[dict(v, bn=min(v["bn"], 16), block_h=min(v["block_h"], 32), block_k=64)
                                                     for v in VARIANTS] + [dict(VARIANTS[0], fixed=True, bn=16, block_h=32, block_k=64)])
        return
    check("cuda", E=128, H=2048, I=768, K=8, T=1)
    bench(args.rounds)


if __name__ == "__main__":
    main()
