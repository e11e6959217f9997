"""The register-fed mma.sync fp8 GEMV (``cuda_fp8_gemv``) against the Triton fp8 GEMV in a decode chain, one GPU.

Each variant runs one batch-``--m`` decode step's linears for ``--layers`` Llama-3-8B-shaped layers (each its own
weights, so nothing is served from L2), captured in a CUDA graph, every kernel launched for programmatic
dependent launch as a ``pdl`` artifact's are. Per layer: the qkv input's RMSNorm-quantize and the qkv GEMV, the
o GEMV with the residual (Triton weight-only, both variants), the gate/up input's RMSNorm-quantize and the gate/up
GEMV with SiLU-and-mul in its epilogue, the down GEMV with the residual (Triton, both variants):

- ``triton``: qkv and gate/up by ``triton_fp8.qlinear_small_m`` (today's decode kernels);
- ``mma@KSxU``: qkv and gate/up by the mma GEMV with KS warps a CTA and U chunks in flight a thread.

``--only qkv`` / ``--only gate_up`` time chains of that GEMV and its quantize alone. ``--compile-variants DIR``
builds the kernel's lab knobs (``LAB_VARIANTS``) into DIR (no GPU needed); ``--variant-lib DIR`` then times
``mma:NAME@KSxU`` for each (the ``tiled`` ones on weights rearranged into their layout, checked bit for bit). Rounds interleave the
variants (medians of ``--reps`` replays a round); the copy rate measured in the run gives the bytes' floor.
Before timing, each GEMV's output is compared with the torch reference and with the Triton GEMV (M = 1..8 and a
ragged N).

    python bench/gemv_mma_lab.py [--m 1] [--layers 32] [--configs 4x4,2x4,8x2] [--only qkv]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import copy_bandwidth, interleaved_graph_us  # noqa: E402

from mxc.kernels import cuda_fp8_gemv, launch, triton_fp8, triton_fp8_gemv, triton_fp8_quant  # noqa: E402

FP8 = torch.float8_e4m3fn
EPS = 1e-5
LAB_VARIANTS = {  # name -> nvcc flags (the knobs at the top of gemv_fp8_mma.cu)
    "l2hint": ["-DMXC_GEMV_L2HINT=1"],
    "interleave": ["-DMXC_GEMV_INTERLEAVE=1"],
    "tiled": ["-DMXC_GEMV_TILED=1"],
    "tiled_l2hint": ["-DMXC_GEMV_TILED=1", "-DMXC_GEMV_L2HINT=1"],
}


def compile_variants(out_dir):
    from mxc.kernels import nvcc
    for name, flags in LAB_VARIANTS.items():
        so = nvcc.compile_so(cuda_fp8_gemv.source(), Path(out_dir) / f"{name}.so", what=f"fp8 mma GEMV ({name})",
                             extra_flags=flags)
        print(f"{so}: {' '.join(flags)}")


def tiled(w: torch.Tensor, silu: bool) -> torch.Tensor:
    """w [N, K] e4m3 in MXC_GEMV_TILED's layout: per 16-row tile (SiLU: 8 gate rows and their up rows) and 64-byte
    chunk, 1 KB: lane l's 16 bytes of A-row l // 4 at 16 l, of A-row l // 4 + 8 at 512 + 16 l."""
    N, K = w.shape
    b = w.view(torch.uint8)
    if silu:
        I = N // 2  # noqa: E741
        rows = torch.cat([b[:I].view(I // 8, 8, K), b[I:].view(I // 8, 8, K)], dim=1)  # [T, 16, K]
    else:
        rows = b.view(N // 16, 16, K)
    T = rows.shape[0]
    return rows.view(T, 2, 8, K // 64, 4, 16).permute(0, 3, 1, 2, 4, 5).contiguous().view(N, K).view(FP8)


def fp8_weight(rows, cols, gen):
    q = (torch.randn(rows, cols, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8)
    s = torch.full((rows,), 0.02 / 64, device="cuda") * (1 + 0.1 * torch.rand(rows, device="cuda", generator=gen))
    return q, s


def check(gemv, gen):
    """The mma GEMV against the torch reference and the Triton GEMV, relative to the output's scale."""
    worst = 0.0
    for M, N, K, epi in [(1, 6144, 4096, None), (1, 28672, 4096, "silu_mul"), (8, 6144, 4096, None),
                         (3, 28672, 4096, "silu_mul"), (5, 1000, 640, None), (2, 4096, 14336, "residual"),
                         (7, 998, 192, "silu_mul")]:
        w, s = fp8_weight(N, K, gen)
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        xq, xs = triton_fp8_quant._prequantize(x, M, K, False, K)
        residual = (torch.randn(M, N, device="cuda", generator=gen)).to(torch.bfloat16) if epi == "residual" else None
        mine = gemv(xq, xs, w, s, residual, epilogue=None if epi == "residual" else epi)
        ref = cuda_fp8_gemv.reference(xq, xs, w, s, residual, None if epi == "residual" else epi)
        tri = triton_fp8.qlinear_small_m(x, w, s, residual=residual, epilogue=None if epi == "residual" else epi)
        scale = ref.float().abs().max()
        err_ref = float((mine.float() - ref.float()).abs().max() / scale)
        err_tri = float((mine.float() - tri.float()).abs().max() / scale)
        worst = max(worst, err_ref)
        print(f"check M={M} N={N} K={K} {epi}: against torch {err_ref:.2e}, against Triton {err_tri:.2e} of the "
              f"output's scale")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=1, help="tokens (1-8)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--qkv", type=int, default=6144)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="4x4,2x4,8x2,4x2,4x8,8x4,1x8", help="KSxU configs of the mma GEMV")
    ap.add_argument("--only", choices=["qkv", "gate_up"], default=None)
    ap.add_argument("--lib", default=None, help="the mma GEMV library (default: built here or the env's)")
    ap.add_argument("--variant-lib", default=None, help="a folder of lab variant libraries (--compile-variants)")
    ap.add_argument("--variant-configs", default="4x4,8x2", help="KSxU configs the variant libraries run")
    ap.add_argument("--compile-variants", default=None, metavar="DIR", help="build the lab variants into DIR, exit")
    args = ap.parse_args()
    if args.compile_variants:
        return compile_variants(args.compile_variants)
    M, H, Q, I, L = args.m, args.hidden, args.qkv, args.intermediate, args.layers  # noqa: E741
    gemv = cuda_fp8_gemv.load(args.lib)
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = check(gemv, gen)
    if worst > 2e-2:
        sys.exit(f"the mma GEMV is off the reference by {worst:.2e} of the output's scale")

    layers = [dict(qkv=fp8_weight(Q, H, gen), o=fp8_weight(H, H, gen), gu=fp8_weight(2 * I, H, gen),
                   down=fp8_weight(H, I, gen)) for _ in range(L)]
    x0 = (torch.randn(M, H, device="cuda", generator=gen)).to(torch.bfloat16)
    attn = (torch.randn(M, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    g1 = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(torch.bfloat16)
    g2 = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(torch.bfloat16)
    qbk = {n: triton_fp8_gemv.config_for(1 if M == 1 else triton_fp8_gemv.bucket(M), n, H, torch.bfloat16,
                                         "channel").QUANT_BLOCK_K for n in (Q, 2 * I)}
    h_buf = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
    qkv_buf = torch.empty(M, Q, dtype=torch.bfloat16, device="cuda")

    def step(use_mma, ks=4, u=4, lib=gemv, tiles=None):
        def qkv(res, layer):
            w, s = layer["qkv"] if tiles is None else tiles[id(layer)]["qkv"]
            if not use_mma:
                return triton_fp8.qlinear_small_m(res, w, s, prologue="rms_norm", norm_weight=g1, eps=EPS,
                                                  out=qkv_buf)
            xq, xs = triton_fp8_quant._prequantize(res, M, H, False, qbk[Q], norm_weight=g1, eps=EPS)
            return lib(xq, xs, w, s, out=qkv_buf, ks=ks, u=u, pdl=True)

        def gate_up(res, layer):
            w, s = layer["gu"] if tiles is None else tiles[id(layer)]["gu"]
            if not use_mma:
                return triton_fp8.qlinear_small_m(res, w, s, prologue="rms_norm", norm_weight=g2, eps=EPS,
                                                  epilogue="silu_mul")
            xq, xs = triton_fp8_quant._prequantize(res, M, H, False, qbk[2 * I], norm_weight=g2, eps=EPS)
            return lib(xq, xs, w, s, out=h_buf, epilogue="silu_mul", ks=ks, u=u, pdl=True)

        def run(res, layers):
            for layer in layers:
                if args.only == "qkv":
                    qkv(res, layer)
                    continue
                if args.only == "gate_up":
                    gate_up(res, layer)
                    continue
                qkv(res, layer)
                triton_fp8.qlinear_small_m(attn, *layer["o"], residual=res, out=res)
                h = gate_up(res, layer)
                triton_fp8.qlinear_small_m(h, *layer["down"], residual=res, out=res)
        return run

    variants = {"triton": step(False)}
    for cfg in filter(None, args.configs.split(",")):
        ks, u = (int(v) for v in cfg.split("x"))
        variants[f"mma@{cfg}"] = step(True, ks, u)
    tile_weights = {}
    for so in sorted(Path(args.variant_lib).glob("*.so")) if args.variant_lib else ():
        lib = cuda_fp8_gemv.GemvFp8Mma(so)
        tiles = None
        if so.stem.startswith("tiled"):
            if not tile_weights:
                tile_weights.update({id(layer): dict(qkv=(tiled(layer["qkv"][0], False), layer["qkv"][1]),
                                                     gu=(tiled(layer["gu"][0], True), layer["gu"][1]))
                                     for layer in layers})
            tiles = tile_weights
            xq, xs = triton_fp8_quant._prequantize(x0, M, H, False, H)
            for key, epi in (("qkv", None), ("gu", "silu_mul")):
                same = torch.equal(lib(xq, xs, *tile_weights[id(layers[0])][key], epilogue=epi),
                                   gemv(xq, xs, *layers[0][key], epilogue=epi))
                print(f"{so.stem} on its layout equals the row-major kernel ({key}): {same}")
        for cfg in filter(None, args.variant_configs.split(",")):
            ks, u = (int(v) for v in cfg.split("x"))
            variants[f"mma:{so.stem}@{cfg}"] = step(True, ks, u, lib, tiles)
    outs = {name: x0.clone() for name in variants}
    with launch.using(launch.jit_launch_pdl):
        for name, fn in variants.items():  # one layer eagerly (compiles the Triton kernels outside capture)
            fn(outs[name], layers[:1])
        torch.cuda.synchronize()
        if args.only is None:
            base = outs["triton"].float() - x0.float()
            for name in variants:
                rel = float(((outs[name].float() - x0.float()) - base).abs().max() / base.abs().max())
                print(f"one layer, {name} against triton: {rel:.2e} of the layer's update")
        graphs = {}
        for name, fn in variants.items():
            fn(outs[name], layers)
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn(outs[name], layers)
    bw = copy_bandwidth()
    sizes = {"qkv": Q * H, "gate_up": 2 * I * H}
    nbytes = sizes[args.only] if args.only else Q * H + H * H + 2 * I * H + H * I
    floor_us = nbytes / bw * 1e6
    print(f"M={M} layers={L} only={args.only}: copy rate {bw / 1e12:.2f} TB/s, weight bytes' floor "
          f"{floor_us:.2f} us a layer")
    times = interleaved_graph_us(graphs, args.rounds, args.reps, L)
    base = statistics.median(times["triton"])
    for name, t in times.items():
        us = statistics.median(t)
        print(f"{name}: {us:.2f} us a layer ({min(t):.2f}-{max(t):.2f}), {floor_us / us:.0%} of the floor, "
              f"{(base - us) * L / 1e3:+.3f} ms a step against triton")


if __name__ == "__main__":
    main()
