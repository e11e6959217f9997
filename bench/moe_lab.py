"""The batch-1 kernels of the Qwen3-30B-A3B shape, one by one, on one GPU.

Times, as decode runs them (a CUDA graph of back-to-back calls, weights from HBM):
  the per-pair MoE kernels (``triton_moe_decode``) over their configs: the gate/up pair kernel,
    the expert-by-expert down kernel and the tiled one (the k experts in one tile); every call
    picks another random set of experts, so the chosen experts' weights come from HBM;
  the MoE block's norm + router at each ``--tokens`` up to 32: three kernels against the fused one (the build takes
    it to ``candidates.NORM_ROUTE_MAX_TOKENS``), and at one token over its tile and warps;
  the attention-side GEMVs (qkv, o, router) and the Llama-3-8B qkv and o with ``gemv_tuning.tune``;
  the experts' weight formats (bf16, fp8 row scales, fp8 128x128 block scales) at each ``--tokens``;
  the Mixtral-8x7B experts (``--mixtral``, off by default) with bf16 routing weights and with float32 ones, as
    transformers' Mixtral keeps them (its products then summed in a float32 buffer), and the per-expert loop of
    cuBLAS GEMMs (``moe_ref``), at each ``--tokens``.
Prints microseconds and TB/s of the weights read.
Usage: python bench/moe_lab.py [--skip moe,router,gemv,scales] [--tokens 1,2048] [--mixtral]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import gemv_tuning, moe_ref, triton_gemv  # noqa: E402
from mxc.kernels import triton_moe_decode as tmd  # noqa: E402

E, H, I, K = 128, 2048, 768, 8


def chain_inputs(sets: int = 16):
    """The MoE block at the Qwen3-30B-A3B shape, random bf16, for the labs' 32-layer chains (``time_us``): expert
    weights ``w1`` [E, 2I, H] and ``w2`` [E, H, I], the RMSNorm weight ``nw``, ``sets`` residual / attention inputs
    ``a``, ``b`` and router weights ``rws``, and ``route(i)``: the shipped add + RMSNorm + router of set i % sets
    (each set its own router weights, so consecutive layers choose other experts)."""
    from types import SimpleNamespace

    from mxc.kernels import triton_route
    from mxc.kernels.context import ForwardContext

    dt = torch.bfloat16
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=dt) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=dt) * 0.02
    a = [torch.randn(1, H, device="cuda", dtype=dt) for _ in range(sets)]
    b = [torch.randn(1, H, device="cuda", dtype=dt) for _ in range(sets)]
    nw = torch.ones(H, device="cuda", dtype=dt)
    rws = [torch.randn(E, H, device="cuda", dtype=dt) * H ** -0.5 for _ in range(sets)]
    ctx = ForwardContext([1], [0], [0])

    def route(i):
        return triton_route.add_rms_norm_route(a[i % sets], b[i % sets], nw, rws[i % sets], ctx, eps=1e-6, k=K,
                                               renormalize=True)

    return SimpleNamespace(w1=w1, w2=w2, a=a, b=b, nw=nw, rws=rws, route=route, sets=sets)


def time_us(fn, calls: int = 32, pdl: bool = False) -> float:
    """Microseconds per ``fn(i)``: do_bench of a CUDA graph of ``calls`` back-to-back calls; with ``pdl``, the kernels
    launched for programmatic dependent launch, as an artifact's decode graph runs them (``launch.jit_launch_pdl``)."""
    from contextlib import nullcontext

    from triton.testing import do_bench

    from mxc.kernels import launch

    with launch.using(launch.jit_launch_pdl) if pdl else nullcontext():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(0)
            fn(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i)
    return do_bench(g.replay, warmup=10 if pdl else 5, rep=100 if pdl else 40) * 1e3 / calls


def moe_kernels(tokens: int) -> None:
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    sets = 16
    xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    routes = [moe_ref.route(torch.randn(tokens, E, device="cuda"), K, renormalize=True) for _ in range(sets)]
    routes = [(w.to(torch.bfloat16), ids) for w, ids in routes]
    experts = tokens * K  # distinct with high probability at a few tokens
    up_bytes, down_bytes = experts * 2 * I * H * 2, experts * H * I * 2
    ref = moe_ref.fused_moe(xs[0], *routes[0], w1, w2)
    default_up, default_down = tmd.config_for(H, I, torch.bfloat16)

    def run(up, down):
        return lambda i: tmd.fused_moe(xs[i % sets], *routes[i % sets], w1, w2, configs=(up, down))

    def check(up, down):
        y = tmd.fused_moe(xs[0], *routes[0], w1, w2, configs=(up, down))
        err = (y.float() - ref.float()).abs().max().item()
        assert err <= 2e-2 * ref.float().abs().max().item(), (up, down, err)

    both = time_us(run(default_up, default_down))
    print(f"T={tokens} default up + down: {both:7.1f} us  {(up_bytes + down_bytes) / both / 1e6:5.2f} TB/s  "
          f"{default_up} {default_down}", flush=True)
    results = []
    for tile, bns, bks in ((False, (8, 16, 32), (256, 512)), (True, (2, 4, 8, 16), (64, 128, 256))):
        for bn in bns:
            for bk in bks:
                for nw in (4, 8):
                    down = tmd.PairConfig(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, TILE=tile)
                    try:
                        check(default_up, down)
                        t = time_us(run(default_up, down))
                    except Exception as e:  # out of resources: skip
                        print(f"  skip {down}: {type(e).__name__} {str(e)[:60]}")
                        continue
                    results.append((t, "down", down))
    best_down = min(r for r in results if r[1] == "down")
    for bn in (8, 16, 32):
        for bk in (256, 512, 1024):
            for nw in (4, 8):
                up = tmd.PairConfig(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
                try:
                    check(up, best_down[2])
                    t = time_us(run(up, best_down[2]))
                except Exception as e:
                    print(f"  skip {up}: {type(e).__name__} {str(e)[:60]}")
                    continue
                results.append((t, "up", up))
    for t, kind, cfg in sorted(results, key=lambda r: (r[1], r[0])):
        other = "best down" if kind == "up" else "default up"
        print(f"T={tokens} {kind:4s} {t:7.1f} us (with {other})  {cfg}", flush=True)
    best_up = min(r for r in results if r[1] == "up")
    print(f"T={tokens} best: up {best_up[2]}  down {best_down[2]}: {best_up[0]:.1f} us "
          f"({(up_bytes + down_bytes) / best_up[0] / 1e6:.2f} TB/s) vs default {both:.1f} us", flush=True)


def scale_formats(tokens: int) -> None:
    """The experts' weight formats at ``tokens`` tokens (the pair kernels at a few, the sorted grouped GEMMs
    above ``candidates.MOE_PAIR_MAX_TOKENS``): bf16, fp8 with row scales (``--quant fp8``) and fp8 with an
    already-fp8 checkpoint's 128x128 block scales, whose kernels dequantize each tile as they load it."""
    from mxc.kernels import candidates, triton_moe
    from mxc.loaders.quantize import quantize_fp8

    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    formats = {"bf16": (w1, w2, {})}
    for gran in ("channel", "block128"):
        (q1, s1), (q2, s2) = (quantize_fp8(w, gran) for w in (w1, w2))
        formats[gran] = (q1, q2, dict(s_gate_up=s1, s_down=s2))
    sets = 16
    xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    routes = [moe_ref.route(torch.randn(tokens, E, device="cuda"), K, renormalize=True) for _ in range(sets)]
    routes = [(w.to(torch.bfloat16), ids) for w, ids in routes]
    pairs = tokens <= candidates.MOE_PAIR_MAX_TOKENS
    fn = tmd.fused_moe if pairs else triton_moe.fused_moe
    variants = [(name, fmt, None) for name, fmt in formats.items()]
    if pairs:  # block scales at the row-scale configs' steps (gate/up 256 wide: a scale an element, gathered)
        variants.append(("block128, row-scale steps", formats["block128"],
                         tmd.config_for(H, I, torch.bfloat16, scales="row")))
    ref = moe_ref.fused_moe(xs[0], *routes[0], w1, w2)
    for name, (a, b, scales), cfg in variants:
        kw = dict(scales, **({"configs": cfg} if cfg else {}))
        y = fn(xs[0], *routes[0], a, b, **kw)
        err = (y.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        t = time_us(lambda i: fn(xs[i % sets], *routes[i % sets], a, b, **kw))
        print(f"T={tokens} experts {name:26s} {t:8.1f} us  (error {err:.1e} of the bf16 output's scale)", flush=True)


def mixtral_routing_dtype(tokens: int) -> None:
    """Mixtral-8x7B's experts (8 of 4096 x 14336, top-2) at ``tokens`` tokens, routing weights in bf16 against
    float32 (``moe_fp32_weights``: the products stay float32 until the k-sum rounds them, so the sorted kernels'
    per-assignment buffer ``y`` [T*k, H] is float32, twice the bytes). Each variant is checked against
    ``moe_ref`` with the same weights first; the float32 one must be no further off than the bf16 one's bound."""
    from mxc.kernels import candidates, triton_moe

    e, h, i, k = 8, 4096, 14336, 2
    w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i ** -0.5
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_ref.route(torch.randn(tokens, e, device="cuda"), k, renormalize=True, fp32_weights=True)
    fn = tmd.fused_moe if tokens <= candidates.MOE_PAIR_MAX_TOKENS else triton_moe.fused_moe
    flops = 2 * tokens * k * 3 * h * i
    times = {}
    for name, w in (("bf16", weights.to(torch.bfloat16)), ("float32", weights)):
        ref = moe_ref.fused_moe(x, w, ids, w1, w2).float()
        err = (fn(x, w, ids, w1, w2).float() - ref).abs().max().item() / ref.abs().max().item()
        assert err <= 2e-2, (name, err)
        times[name] = time_us(lambda _: fn(x, w, ids, w1, w2), calls=4)
        print(f"T={tokens} Mixtral experts, {name:7s} routing weights: {times[name]:9.1f} us  "
              f"{flops / times[name] / 1e6:6.1f} TFLOP/s  (error {err:.1e} of the output's scale)", flush=True)
    print(f"T={tokens} Mixtral experts: float32 / bf16 routing weights = {times['float32'] / times['bf16']:.3f}",
          flush=True)
    from triton.testing import do_bench  # the loop syncs with the host (its experts' rows): no graph
    w = weights.to(torch.bfloat16)
    loop = do_bench(lambda: moe_ref.fused_moe(x, w, ids, w1, w2), warmup=5, rep=40) * 1e3
    print(f"T={tokens} Mixtral experts, per-expert loop (cuBLAS, bf16 weights): {loop:9.1f} us  "
          f"{flops / loop / 1e6:6.1f} TFLOP/s; fused / loop = {times['bf16'] / loop:.3f}", flush=True)


def router(tokens: int) -> None:
    """The MoE block's norm and router at ``tokens`` tokens: the three kernels (add + RMSNorm, router GEMV,
    router) against the fused kernel (``triton_route.add_rms_norm_route``), plain and with PDL, then, at one token,
    over its rows a program, warps and top-k way (``triton_route.TOPK_WAYS``). Each call reads another layer's
    router (copies covering the L2), as decode does."""
    from mxc.kernels import torch_ref, triton_norm, triton_route
    from mxc.kernels.context import ForwardContext

    sets = 16
    a = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    b = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    rws = [torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5 for _ in range(128)]  # 64 MB
    kw = dict(eps=1e-6, k=K, renormalize=True)
    ref = torch_ref.add_rms_norm_route(a[0], b[0], nw, rws[0], **kw)

    def three(i):
        s_, h = triton_norm.add_rms_norm(a[i % sets], b[i % sets], nw, 1e-6)
        return triton_route.route(triton_gemv.linear_small_m(h, rws[i % len(rws)]), K, renormalize=True)

    print(f"router, {tokens} tokens: add + RMSNorm, GEMV, router (3 kernels): {time_us(three):6.2f} us", flush=True)
    ctx = ForwardContext([1] * tokens, [0] * tokens, list(range(tokens)))

    def fused(i, **tile):
        return triton_route.add_rms_norm_route(a[i % sets], b[i % sets], nw, rws[i % len(rws)], ctx, **kw, **tile)

    check_route(fused(0), ref)
    print(f"router, {tokens} tokens: fused: {time_us(fused):6.2f} us (PDL {time_us(fused, pdl=True):6.2f})", flush=True)
    if tokens > 1:
        return
    for topk in triton_route.TOPK_WAYS:
        for rows in (1, 2, 4, 8):
            for warps in (1, 2, 4, 8):
                tile = dict(rows=rows, num_warps=warps, topk=topk)
                try:
                    check_route(fused(0, **tile), ref)
                    t = time_us(lambda i, tile=tile: fused(i, **tile))
                except Exception as e:  # out of resources
                    print(f"  skip {tile}: {type(e).__name__} {str(e)[:60]}")
                    continue
                print(f"router: fused, {rows} rows a program ({-(-E // rows)} programs), {warps} warps, top-k "
                      f"{topk}: {t:6.2f} us", flush=True)


def check_route(got, ref) -> None:
    """The fused router's outputs against ``torch_ref``'s: bf16 logits from another summation order tie or swap
    places among 128 experts now and then (seen at 8 tokens), so each token's weights are compared sorted and at
    least all but one expert a token must agree."""
    w, ids, ref_w, ref_ids = got[2].float(), got[3], ref[2].float(), ref[3]
    torch.testing.assert_close(w.sort(-1).values, ref_w.sort(-1).values, atol=2e-2, rtol=2e-2)
    same = (ids.sort(-1).values.unsqueeze(-1) == ref_ids.unsqueeze(-2)).any(-1).sum(-1)
    assert (same >= ids.shape[1] - 1).all(), f"other experts than the reference: {same.tolist()} of {ids.shape[1]}"


def gemvs() -> None:
    shapes = {"qwen3-moe qkv": (5120, 2048), "qwen3-moe o": (2048, 4096), "qwen3-moe router": (128, 2048),
              "llama qkv": (6144, 4096), "llama o": (4096, 4096)}
    for name, (n, k) in shapes.items():
        ws = gemv_tuning.weight_copies(n, k, torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = triton_gemv.config_for(1, n, k, torch.bfloat16)
        t = gemv_tuning.time_us(lambda x_, w_: triton_gemv.linear_small_m(x_, w_, config=cfg), x, ws)
        best, bt = gemv_tuning.tune(n, k, torch.bfloat16, 1, ws=ws)
        print(f"{name:18s} default {t:6.1f} us {n * k * 2 / t / 1e6:5.2f} TB/s {cfg}\n"
              f"{'':18s} tuned   {bt:6.1f} us {n * k * 2 / bt / 1e6:5.2f} TB/s {best}", flush=True)
        del ws


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--skip", default="", help="comma-separated: moe, router, gemv, scales")
    p.add_argument("--tokens", default="1")
    p.add_argument("--mixtral", action="store_true", help="also the Mixtral experts' routing-weight dtypes")
    args = p.parse_args()
    skip = set(args.skip.split(","))
    if "moe" not in skip:
        for t in (int(x) for x in args.tokens.split(",")):
            moe_kernels(t)
    if "router" not in skip:
        from mxc.kernels.triton_route import NORM_ROUTE_TOKENS

        for t in (int(x) for x in args.tokens.split(",")):
            if t <= NORM_ROUTE_TOKENS:  # the fused kernel's most tokens
                router(t)
    if "gemv" not in skip:
        gemvs()
    if "scales" not in skip:
        for t in (int(x) for x in args.tokens.split(",")):
            scale_formats(t)
    if args.mixtral:
        for t in (int(x) for x in args.tokens.split(",")):
            mixtral_routing_dtype(t)


if __name__ == "__main__":
    main()
