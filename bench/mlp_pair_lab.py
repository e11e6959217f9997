"""The persistent fp8 MLP pair against the kernel chain it replaces, over a model's worth of layers, on one GPU.

Step 1 of docs/persistent_decode.md, measured before anything is built on it. Each variant runs one decode
step's MLPs (``--layers`` of them, each with its own weights, so nothing is served from L2) captured in a CUDA
graph, every kernel launched for programmatic dependent launch as a ``pdl`` artifact's are:

- ``chain``: per layer the gate/up input's RMSNorm-quantize, the gate/up GEMV, SiLU-and-mul, the down input's
  quantize and the down GEMV with the residual (``triton_fp8.qlinear_small_m`` twice: today's decode kernels);
- ``pair``: per layer the same RMSNorm-quantize, then ``mlp_pair_fp8`` (two launches);
- ``norm_pair``: per layer ``mlp_pair_fp8``'s ``rms_norm_pair`` (the RMSNorm and quantize inside: one launch).

Rounds interleave the variants (medians of ``--reps`` replays a round); the copy rate measured in the run gives
the weight bytes' floor. The first layer's outputs are compared (relative to their scale) before timing.

Where the pair's time goes: ``--stages 2,3,4`` adds the pair with fewer ring stages; ``--pair-lib DIR`` adds
``pair`` and ``norm_pair`` of every library in DIR, built on a machine with nvcc by ``--compile-variants DIR``
with the kernel's lab knobs (``LAB_VARIANTS``: some skip work and give wrong results, timing only).

    python bench/mlp_pair_lab.py [--m 1] [--layers 32] [--rounds 3] [--no-pdl] [--stages 2,4] [--pair-lib DIR]
    python bench/mlp_pair_lab.py --compile-variants build/mlp_pair/lab      (no GPU needed)
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

from mxc.kernels import launch, mlp_pair_fp8, triton_fp8, triton_fp8_quant  # noqa: E402

FP8 = torch.float8_e4m3fn
EPS = 1e-5
# name -> nvcc flags (the knobs at the top of mlp_pair_fp8.cu)
LAB_VARIANTS = {
    "nomma": ["-DMXC_PAIR_DIAG=1"],           # consumers skip the MMAs (wrong results)
    "noepi": ["-DMXC_PAIR_DIAG=2"],           # consumers skip the epilogues (wrong results)
    "stream": ["-DMXC_PAIR_DIAG=3"],          # both: the ring and the boundary alone
    "bigcopy": ["-DMXC_PAIR_DIAG=4"],         # 8 KB contiguous copies instead of 1 KB rows (wrong results)
    "stream_big": ["-DMXC_PAIR_DIAG=7"],
    "nohint": ["-DMXC_PAIR_DIAG=8"],           # the weight copies without the L2 evict-first hint
    "pitch128": ["-DMXC_PAIR_DIAG=16"],        # rows 128-byte aligned in the ring (bank conflicts)
    "pitch128_nomma": ["-DMXC_PAIR_DIAG=17"],
    "lds32": ["-DMXC_PAIR_LDSM=0"],            # weight fragments by four 32-bit shared loads
    "tiled": ["-DMXC_PAIR_TILED=1"],           # the weights in ring-stage order (stage_order): 4 copies a stage
    "tiled_nowait": ["-DMXC_PAIR_TILED=1", "-DMXC_PAIR_DIAG=32"],  # no boundary wait (wrong results)
    "tiled_stream": ["-DMXC_PAIR_TILED=1", "-DMXC_PAIR_DIAG=3"],   # the stage-ordered ring alone
    "kt2048": ["-DMXC_PAIR_KT=2048"],          # 2 KB a row a stage (half the copies, 66 KB stages; batch <= 4)
    "noprefetch": ["-DMXC_PAIR_PREFETCH=0"],  # epilogue operands loaded in the epilogue
    "div": ["-DMXC_PAIR_RCP=0"],              # quantize by IEEE division (the chain's)
}


def stage_order(w: torch.Tensor, unit_rows: list[torch.Tensor], kt: int = 1024) -> torch.Tensor:
    """``w`` [R, K] e4m3 in the order an MXC_PAIR_TILED ring reads it: for each unit (``unit_rows[u]``: its 32
    row indices, as the ring stage holds them) and each KT-column chunk, one contiguous block of 32 rows x KT
    bytes, each row's 16-byte chunks at chunk ^ (row & 7) within their 128 bytes. Same shape as ``w``."""
    K = w.shape[1]
    rows = torch.stack(unit_rows)                                           # [U, 32]
    blocks = w.view(torch.uint8)[rows].view(len(unit_rows), 32, K // kt, kt // 128, 8, 16)
    swizzled = torch.empty_like(blocks)
    for r in range(8):  # row r & 7 == r: stored chunk p holds chunk p ^ r
        perm = torch.tensor([p ^ r for p in range(8)], device=w.device)
        swizzled[:, r::8] = blocks[:, r::8][:, :, :, :, perm]
    return swizzled.permute(0, 2, 1, 3, 4, 5).contiguous().view(w.shape).view(FP8)


def tiled_layer(w_gu, s_gu, w_d, s_d):
    """A layer's weights in stage order: gate/up unit u = gate rows 16u.. and up rows I + 16u..; down unit v =
    rows 32v..32v+31."""
    I, H = w_d.shape[1], w_d.shape[0]  # noqa: E741
    dev = w_gu.device
    up_units = [torch.cat([torch.arange(16 * u, 16 * u + 16), torch.arange(I + 16 * u, I + 16 * u + 16)]).to(dev)
                for u in range(I // 16)]
    down_units = [torch.arange(32 * v, 32 * v + 32, device=dev) for v in range(H // 32)]
    return stage_order(w_gu, up_units), s_gu, stage_order(w_d, down_units), s_d


def compile_variants(out_dir):
    from mxc.kernels import nvcc
    out_dir = Path(out_dir)
    for name, flags in LAB_VARIANTS.items():
        nvcc.compile_so(mlp_pair_fp8.source(), out_dir / f"{name}.so", what=f"fp8 MLP pair ({name})",
                        extra_flags=flags)
        print(f"{out_dir / name}.so: {' '.join(flags)}")


def layer_weights(H, I, gen):  # noqa: E741
    def fp8(rows, cols):
        q = (torch.randn(rows, cols, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8)
        return q, torch.full((rows,), 0.02 / 64, device="cuda") * (1 + 0.1 * torch.rand(rows, device="cuda", generator=gen))
    return (*fp8(2 * I, H), *fp8(H, I))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=1, help="tokens (1-8)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-pdl", action="store_true", help="plain launches (no programmatic dependent launch)")
    ap.add_argument("--stages", default="", help="comma-separated ring depths to time the pair with as well")
    ap.add_argument("--pair-lib", default=None, help="a folder of variant libraries (--compile-variants) to time")
    ap.add_argument("--compile-variants", default=None, metavar="DIR", help="build the lab variants into DIR, exit")
    args = ap.parse_args()
    if args.compile_variants:
        return compile_variants(args.compile_variants)
    M, H, I, L = args.m, args.hidden, args.intermediate, args.layers  # noqa: E741
    pdl = not args.no_pdl
    pair = mlp_pair_fp8.load(str(mlp_pair_fp8.library()))
    stages, ctas = pair.plan(M, H, I)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(H, I, gen) for _ in range(L)]
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(torch.bfloat16)
    residual = (torch.randn(M, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    ws = mlp_pair_fp8.Workspace.new(I, "cuda")
    launcher = launch.jit_launch_pdl if pdl else launch.jit_launch

    def chain(out, layers):
        for w_gu, s_gu, w_d, s_d in layers:
            gate_up = triton_fp8.qlinear_small_m(x, w_gu, s_gu, prologue="rms_norm", norm_weight=g, eps=EPS)
            triton_fp8.qlinear_small_m(gate_up, w_d, s_d, residual=out, prologue="silu_mul", out=out)

    def fused(lib=pair, weights=lambda layer: layer, **kw):
        """Per layer the RMSNorm-quantize, then ``lib``'s pair on ``weights(layer)``."""
        def run(out, layers):
            for layer in layers:
                xq, xs = triton_fp8_quant._prequantize(x, M, H, False, H, norm_weight=g, eps=EPS)
                lib(xq, xs, *weights(layer), out, out, ws, pdl=pdl, **kw)
        return run

    def norm_fused(lib=pair, weights=lambda layer: layer, **kw):
        """Per layer ``lib``'s rms_norm_pair on ``weights(layer)``."""
        def run(out, layers):
            for layer in layers:
                lib.rms_norm_pair(x, g, EPS, *weights(layer), out, out, ws, pdl=pdl, **kw)
        return run

    variants = {"chain": chain, "pair": fused(), "norm_pair": norm_fused()}
    for s in filter(None, args.stages.split(",")):
        variants[f"pair@{s}stages"] = fused(stages=int(s))
        variants[f"norm_pair@{s}stages"] = norm_fused(stages=int(s))
    tiled = {}  # the layers in stage order, for the MXC_PAIR_TILED variants (their own weights)
    for so in sorted(Path(args.pair_lib).glob("*.so")) if args.pair_lib else ():
        lib = mlp_pair_fp8.load(str(so))
        try:
            lib.plan(M, H, I)
        except RuntimeError as e:  # e.g. kt2048's ring does not fit beside 8 tokens' activations
            print(f"{so.stem}: skipped ({e})")
            continue
        if so.stem.startswith("tiled") and not tiled:
            tiled.update({id(layer): tiled_layer(*layer) for layer in layers})
        own = (lambda layer: tiled[id(layer)]) if so.stem.startswith("tiled") else (lambda layer: layer)
        variants[f"pair:{so.stem}"] = fused(lib, own)
        variants[f"norm_pair:{so.stem}"] = norm_fused(lib, own)
    outs = {name: residual.clone() for name in variants}
    with launch.using(launcher):
        # one layer, eagerly, against each other (and compile the Triton kernels outside capture)
        for name, fn in variants.items():
            fn(outs[name], layers[:1])
        torch.cuda.synchronize()
        delta = {k: (v.float() - residual.float()) for k, v in outs.items()}
        for name in (n for n in variants if n.startswith("pair:tiled")):
            print(f"one layer, {name} equals pair bit for bit: {torch.equal(outs[name], outs['pair'])}")
        for name in variants:
            if name == "chain":
                continue
            rel = float((delta[name] - delta["chain"]).abs().max() / delta["chain"].abs().max())
            print(f"one layer, {name} against chain: {rel:.2e} of the MLP output's scale")
        graphs = {}
        for name, fn in variants.items():
            fn(outs[name], layers)  # warm-up outside capture
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn(outs[name], layers)

    bw = copy_bandwidth()
    nbytes = L * (2 * I * H + H * I)
    floor_us = nbytes / bw * 1e6 / L
    print(f"M={M} H={H} I={I} layers={L} pdl={pdl}; pair: {stages} ring stages, {ctas} CTAs; "
          f"copy rate {bw / 1e12:.2f} TB/s: weight bytes' floor {floor_us:.2f} us a layer")
    times = interleaved_graph_us(graphs, args.rounds, args.reps, L)
    for name, t in times.items():
        us = statistics.median(t)
        print(f"{name}: {us:.2f} us a layer, {floor_us / us:.0%} of the bytes' floor, "
              f"{L * us / 1e3:.3f} ms for {L} layers")
    chain_us = statistics.median(times["chain"])
    for name in variants:
        if name == "chain":
            continue
        us = statistics.median(times[name])
        print(f"{name} saves {chain_us - us:.2f} us a layer ({(chain_us - us) * L / 1e3:.3f} ms a step)")


if __name__ == "__main__":
    main()
