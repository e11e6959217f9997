"""Lab: the batch-1 MoE router folded away (docs/persistent_decode.md, "The router folded into the o GEMV").

The router's logits are l = r * ((x * g) @ W_r) for the residual sum x = h + a @ W_o, the router RMSNorm's weight g
and its scale r = rsqrt(mean(x^2) + eps), one positive number a token. So the unscaled logits
L = (h * g) @ W_r + a @ (W_o diag(g) W_r) can come out of the o GEMV as 128 more output rows, and the top k of
softmax(r * L) is the top k of L. Here the router kernel goes: each program of the gate/up pair kernel, past its PDL
wait, adds the residual itself, takes r, scales the 128 logits, runs the bitonic top-k the router runs
(``triton_route.top_k_scores``) and picks its own expert; the first one writes the residual sum, the weights and
the ids the shipped down kernel reads. Its K loop forms the normalised x tile by tile (rounded as the router kernel
rounds it: x * r, then times g).

On the GPU (``bash bench/gpu_session.sh fold``): checks the folded pair against the torch reference, then times
32 layers of [router -> experts -> norm] against [folded gate/up -> down -> norm] in one CUDA graph with PDL, and
the o GEMV at 2048 rows against 2048 + 128 (what the fold adds to it: 1 MB of bf16 rows), and the (h * g) W_r term's
128 x 2048 product alone (what it costs where the attention's window does not hide it).
Kill criterion (written before the first call): the folded chain at least 2 us a layer under the shipped one,
the o GEMV's extra rows counted, or the fold is dropped.
On the CPU: ``TRITON_INTERPRET=1 python bench/router_fold_lab.py --check`` (the interpreter, small shapes).
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

from mxc.kernels import moe_ref  # noqa: E402
from mxc.kernels import triton_moe_decode as tmd  # noqa: E402
from mxc.kernels.launch import cdiv, launch, next_pow2  # noqa: E402
from mxc.kernels.pdl import pdl_enter  # noqa: E402
from mxc.kernels.triton_route import top_k_scores  # noqa: E402


@triton.jit
def _fold_up_kernel(a_ptr, b_ptr, nw_ptr, l_ptr, w_ptr, s_ptr, wts_ptr, ids_ptr, h_ptr, eps,
                    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_TK: tl.constexpr, RENORMALIZE: tl.constexpr, UNROLL: tl.constexpr = False,
                    USE_PDL: tl.constexpr = False):
    """Program (pair p = t * TOP_K + j, n-tile): token t's routing, then ``_pair_up_kernel``'s rows for its j-th
    expert over x = rms_norm(a + b) * g formed a tile at a time."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    t = pair // TOP_K
    j = pair % TOP_K
    ty = a_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    s = (tl.load(a_ptr + t * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
         + tl.load(b_ptr + t * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)).to(ty)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    offs_e = tl.arange(0, BLOCK_E)
    logits = tl.load(l_ptr + t * E + offs_e, mask=offs_e < E, other=float("-inf")) * rstd
    w, ids = top_k_scores(logits, E, TOP_K, BLOCK_E, BLOCK_TK, False, RENORMALIZE, BITONIC=True)
    offs_tk = tl.arange(0, BLOCK_TK)
    e = tl.sum(tl.where(offs_tk == j, ids, 0), axis=0)
    if (j == 0) & (tl.program_id(1) == 0):  # one program a token writes what the down kernel reads
        tl.store(s_ptr + t * H + offs_h, s, mask=h_ok)
        tl.store(wts_ptr + t * TOP_K + offs_tk, w.to(ty), mask=offs_tk < TOP_K)
        tl.store(ids_ptr + t * TOP_K + offs_tk, ids, mask=offs_tk < TOP_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * (2 * I * H) + rn[:, None] * H + offs_k[None, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if UNROLL:
        for k in tl.static_range(0, H, BLOCK_K):
            acc_g, acc_u = _fold_step(a_ptr, b_ptr, nw_ptr, g_ptrs, t, k, rstd, acc_g, acc_u, H, I, BLOCK_K)
    else:
        for k in range(0, H, BLOCK_K):
            acc_g, acc_u = _fold_step(a_ptr, b_ptr, nw_ptr, g_ptrs, t, k, rstd, acc_g, acc_u, H, I, BLOCK_K)
    gate = tl.sum(acc_g, axis=1).to(ty).to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(ty).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
    tl.store(h_ptr + pair * I + offs_n, (act * up).to(ty), mask=offs_n < I)


@triton.jit
def _fold_step(a_ptr, b_ptr, nw_ptr, g_ptrs, t, k, rstd, acc_g, acc_u, H: tl.constexpr, I: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One BLOCK_K step: x's tile normalised as ``triton_route.norm_route_kernel`` rounds it, the gate and up
    rows' products added (``triton_gemv._gate_up_step``'s sums)."""
    ty = a_ptr.dtype.element_ty
    offs = k + tl.arange(0, BLOCK_K)
    ok = offs < H
    s = (tl.load(a_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
         + tl.load(b_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    x = ((s * rstd).to(ty).to(tl.float32) * tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32))
    x = x.to(ty).to(tl.float32)
    g = tl.load(g_ptrs + k, mask=ok[None, :], other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I * H + k, mask=ok[None, :], other=0.0).to(tl.float32)
    return acc_g + g * x[None, :], acc_u + u * x[None, :]


def folded_moe(a, b, norm_weight, logits, w1, w2, *, eps: float, k: int, renormalize: bool = True):
    """(s, y): s = a + b, y = s + the experts of rms_norm(s) * norm_weight routed by top-k of softmax(r * logits)
    (``logits`` [T, E] fp32, unscaled). The folded gate/up kernel, then the shipped down kernel."""
    T, H = a.shape
    E, I2, _ = w1.shape
    I = I2 // 2
    up, down = tmd.config_for(H, I, a.dtype, k)
    s = torch.empty_like(a)
    wts = torch.empty((T, k), dtype=a.dtype, device=a.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=a.device)
    h = torch.empty((T * k, I), dtype=a.dtype, device=a.device)
    y = torch.empty_like(a)
    launch(_fold_up_kernel, (T * k, cdiv(I, up.BLOCK_N)), [a, b, norm_weight, logits, w1, s, wts, ids, h, float(eps)],
           dict(E=E, H=H, I=I, TOP_K=k, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, BLOCK_H=next_pow2(H),
                BLOCK_E=next_pow2(E), BLOCK_TK=next_pow2(k), RENORMALIZE=bool(renormalize),
                **({"UNROLL": True} if up.UNROLL else {})),
           num_warps=up.num_warps, num_stages=1)
    tile = down.TILE and k & (k - 1) == 0
    launch(tmd._pair_down_tile_kernel if tile else tmd._pair_down_sum_kernel, (T, cdiv(H, down.BLOCK_N)),
           [h, w2, None, wts, ids, s, y],
           dict(E=E, H=H, I=I, TOP_K=k, BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K,
                **({"UNROLL": True} if down.UNROLL else {})),
           num_warps=down.num_warps, num_stages=1)
    return s, y, wts, ids, h


def reference(a, b, norm_weight, logits, w1, w2, *, eps: float, k: int, renormalize: bool = True):
    """The torch reference: the residual sum and its RMSNorm rounded as the router kernel rounds them, the
    routing from the scaled logits in fp32 (``moe_ref.route``), the experts by ``moe_ref``."""
    dt = a.dtype
    s = (a.float() + b.float()).to(dt)
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    x = ((sf * rstd).to(dt).float() * norm_weight.float()).to(dt)
    wts, ids = moe_ref.route(logits * rstd, k, renormalize=renormalize)
    wts = wts.to(dt)
    y = moe_ref.fused_moe(x, wts, ids, w1, w2)
    I = w1.shape[1] // 2
    w = w1[ids.reshape(-1)].float()  # [T * k, 2I, H]: each pair's expert
    gu = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(k, 0), w).to(dt).float()
    h = (torch.nn.functional.silu(gu[:, :I]).to(dt).float() * gu[:, I:]).to(dt)
    return (s.float() + y.float()).to(dt), s, wts, ids, h


def check(device: str, E: int, H: int, I: int, K: int, T: int = 1) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dt).to(device)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(dt).to(device)
    a = (torch.randn(T, H, generator=g) * 0.1).to(dt).to(device)  # small next to the experts' output
    b = (torch.randn(T, H, generator=g) * 0.1).to(dt).to(device)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt).to(device)
    logits = (torch.randn(T, E, generator=g) * 0.2).to(device)  # scaled by r (about 7 here): not one-hot
    for renorm in (True, False):
        s, y, wts, ids, h = folded_moe(a, b, nw, logits, w1, w2, eps=1e-6, k=K, renormalize=renorm)
        ref_y, ref_s, ref_w, ref_ids, ref_h = reference(a, b, nw, logits, w1, w2, eps=1e-6, k=K,
                                                        renormalize=renorm)
        # the GPU rounds as torch does; Triton's interpreter truncates unless tests/kernels/conftest.py patched it
        ulp = 0.0 if device == "cuda" else 2.0 ** -7
        assert ((s.float() - ref_s.float()).abs() <= ulp * ref_s.float().abs()).all(), "residual sum"
        assert torch.equal(ids.cpu(), ref_ids.cpu()), (ids, ref_ids)
        err_w = (wts.float() - ref_w.float()).abs().max().item()
        assert err_w < 1e-2, ("routing weights", err_w)
        for name, got, want in (("each pair's gate/up", h, ref_h), ("output", y, ref_y)):
            err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
            assert err < 2e-2, (name, err)
    print(f"check {device}: the folded router and experts match the reference", flush=True)


def bench(rounds: int) -> None:
    from moe_lab import E, K, chain_inputs, time_us

    from mxc.kernels import triton_gemv, triton_norm

    dt = torch.bfloat16
    c = chain_inputs()
    w1, w2, a, b, nw, rws, sets = c.w1, c.w2, c.a, c.b, c.nw, c.rws, c.sets
    logits = [torch.randn(1, E, device="cuda") for _ in range(sets)]
    attn = [torch.randn(1, 4096, device="cuda", dtype=dt) for _ in range(sets)]
    wo = [torch.randn(2048, 4096, device="cuda", dtype=dt) * 0.02 for _ in range(sets)]
    wo_fold = [torch.randn(2048 + E, 4096, device="cuda", dtype=dt) * 0.02 for _ in range(sets)]

    def shipped(i):
        s, h, wts, ids = c.route(i)
        y = tmd.fused_moe(h, wts, ids, w1, w2, residual=s)
        return triton_norm.rms_norm(y, nw, 1e-6)

    def folded(i):
        s, y, *_ = folded_moe(a[i % sets], b[i % sets], nw, logits[i % sets], w1, w2, eps=1e-6, k=K)
        return triton_norm.rms_norm(y, nw, 1e-6)

    names = {
        "router only": c.route,
        "shipped: router, pair kernels, norm": shipped,
        "folded: folded gate/up, down, norm": folded,
        "o GEMV, 2048 rows": lambda i: triton_gemv.linear_small_m(attn[i % sets], wo[i % sets]),
        "o GEMV, 2048 + 128 rows": lambda i: triton_gemv.linear_small_m(attn[i % sets], wo_fold[i % sets]),
        "(h * g) W_r alone, 128 rows": lambda i: triton_gemv.linear_small_m(a[i % sets], rws[i % sets]),
    }
    results: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in names.items():
            results.setdefault(name, []).append(time_us(fn, calls=32, pdl=True))
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in results.items()}
    for name, ts in results.items():
        print(f"{name:40s} {med[name]:7.2f} us a layer ({'/'.join(f'{t:.2f}' for t in ts)})", flush=True)
    rows = med["o GEMV, 2048 + 128 rows"] - med["o GEMV, 2048 rows"]
    gain = med["shipped: router, pair kernels, norm"] - med["folded: folded gate/up, down, norm"] - rows
    h_term = med["(h * g) W_r alone, 128 rows"]  # hidden in the attention's window if it fits there; else on the path
    print(f"fold: {gain:+.2f} us a layer net of the o GEMV's extra rows ({rows:+.2f}); {gain - h_term:+.2f} if the "
          f"(h * g) W_r term ({h_term:.2f} us alone) is not hidden; kill criterion 2 us: "
          f"{'met' if gain >= 2 else 'not met'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="CPU: the interpreter against the reference, small shapes")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.check:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--check runs under TRITON_INTERPRET=1"
        check("cpu", E=16, H=64, I=48, K=4, T=2)
        return
    check("cuda", E=128, H=2048, I=768, K=8, T=1)
    bench(args.rounds)


if __name__ == "__main__":
    main()
