"""The persistent fp8 attention block against the kernel chain it would replace, over a model's worth of layers.

Step 2 of docs/persistent_decode.md, measured before anything is wired to it. ``bench/csrc/attn_block_fp8.cu``
does in one launch what today's fp8 batch-1 decode does in six (RMSNorm-quantize, qkv GEMV, RoPE + KV write,
split attention, merge, o GEMV with the residual). Fixed shape: Llama-3-8B (hidden 4096, 32 q / 8 kv heads of
128), one token. Each variant runs ``--layers`` layers (each with its own weights and KV cache, so nothing is
served from L2) captured in one CUDA graph, every kernel launched for programmatic dependent launch as a ``pdl``
artifact's are:

- ``chain``: per layer ``cuda_ops.rms_norm_qlinear_small_m`` (qkv), ``triton_rope.rope_qkv_write``,
  ``triton_attention.decode_attention`` (early launch of the o GEMV) and the o GEMV with the residual;
- ``block``: per layer one ``attn_block_fp8`` launch;
- ``chain+mlp`` / ``block+mlp``: the same followed by the layer's fp8 MLP (``cuda_ops.rms_norm_mlp_small_m``:
  RMSNorm-quantize, gate/up GEMV with SiLU, down GEMV), so the block is timed between the kernels it sits
  between in a step.

First the two are compared on one layer: the attention output's delta (relative to its scale) and the cache
rows they write. The block quantizes the attention output per token before the o GEMV (the chain's one-token o
GEMV is weight-only), so the two differ by that rounding. Rounds interleave the variants (medians of ``--reps``
replays a round).

``--libs`` adds libraries built with the kernel's lab knobs (``--compile-variants DIR``: ``LAB_VARIANTS``); a
``trace`` build records each CTA's stage times (%globaltimer), printed per stage after the timing.

    python bench/attn_block_lab.py [--context 192] [--layers 32] [--rounds 3] [--libs DIR/trace.so,...]
    python bench/attn_block_lab.py --compile-variants build/attn_block      (nvcc, no GPU needed)
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import copy_bandwidth, interleaved_graph_us  # noqa: E402

from mxc.kernels import cuda_ops, launch, triton_attention, triton_fp8, triton_rope  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "csrc" / "attn_block_fp8.cu"
FP8 = torch.float8_e4m3fn
H, HQ, HKV, D, INTER = 4096, 32, 8, 128, 14336  # --tp2: one rank's share (HQ 16, HKV 4, INTER 7168)
EPS = 1e-5


# name -> nvcc flags (the knobs at the top of attn_block_fp8.cu)
LAB_VARIANTS = {
    "attn_block_fp8": [],
    "trace": ["-DMXC_AB_TRACE=1"],          # stage times (adds a few stores)
    "late_o": ["-DMXC_AB_LATE_O=1"],        # the o copies after the merge (HBM idle during the exchanges)
    "late_o_trace": ["-DMXC_AB_LATE_O=1", "-DMXC_AB_TRACE=1"],
    "cluster": ["-DMXC_AB_CLUSTER=1"],      # a kv group a cluster of 16, exchanges in distributed shared memory
    "cluster_trace": ["-DMXC_AB_CLUSTER=1", "-DMXC_AB_TRACE=1"],
    "cluster_tp2": ["-DMXC_AB_CLUSTER=1", "-DMXC_AB_HQ=16", "-DMXC_AB_HKV=4"],  # one rank at tp = 2 (--tp2)
    "cluster_tp2_trace": ["-DMXC_AB_CLUSTER=1", "-DMXC_AB_HQ=16", "-DMXC_AB_HKV=4", "-DMXC_AB_TRACE=1"],
    "tags": ["-DMXC_AB_SYNC=0"],            # no counters: readers poll the tagged words (no fences)
    "tags_trace": ["-DMXC_AB_SYNC=0", "-DMXC_AB_TRACE=1"],
    "tags_late_o_trace": ["-DMXC_AB_SYNC=0", "-DMXC_AB_LATE_O=1", "-DMXC_AB_TRACE=1"],
    "tags_volatile": ["-DMXC_AB_SYNC=0", "-DMXC_AB_STORE=1"],  # st/ld.volatile tagged words
    "tags_exch": ["-DMXC_AB_SYNC=0", "-DMXC_AB_STORE=2"],      # tagged words stored by atom.exch (at L2)
}
TRACE_POINTS = ["start", "pdl wait", "norm+quant", "qkv weights in", "qkv mma", "qkv stored", "o copies issued",
                "q, k, v in", "attention stored", "splits' m in", "merge stored", "attention row in",
                "o input quantized", "o weights in", "o mma", "end"]


def compile_library(out: str, flags=()) -> Path:
    from mxc.kernels import nvcc
    return nvcc.compile_so(SOURCE.read_text(), out, what="fp8 attention block (lab)", extra_flags=list(flags))


def print_trace(block: "Block", layers: int) -> None:
    """Per stage boundary: when the CTAs reached it after the first CTA passed its PDL wait (us; medians over the
    last ``layers`` launches of the median and the last CTA)."""
    n = 64 * 128 * len(TRACE_POINTS)  # TRACE_LAUNCHES x CTAs x points
    buf, count = (ctypes.c_ulonglong * n)(), ctypes.c_uint(0)
    if block.lib.mxc_attn_block_fp8_trace(buf, ctypes.byref(count)):
        return
    t = torch.tensor(list(buf), dtype=torch.float64).view(64, 128, len(TRACE_POINTS))
    idx = [(count.value - 1 - i) % 64 for i in range(min(layers, count.value, 64))]
    t = t[idx]                                                 # [layers, CTAs, points]
    rel = (t - t[:, :, 1].min(dim=1).values[:, None, None]) / 1e3
    med = rel.median(dim=1).values.median(dim=0).values
    last = rel.max(dim=1).values.median(dim=0).values
    first = rel.min(dim=1).values.median(dim=0).values
    print(f"trace ({len(idx)} launches): us after the first CTA passed its PDL wait (first / median / last CTA)")
    for i, name in enumerate(TRACE_POINTS):
        print(f"  {i:2d} {name:20s} {float(first[i]):7.2f} {float(med[i]):7.2f} {float(last[i]):7.2f}")


class Block:
    """The lab library, opened with ctypes."""

    def __init__(self, so: str):
        lib = ctypes.CDLL(so)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.mxc_attn_block_fp8.argtypes = [p, p, f, p, p, p, p, p, p, p, p, i, p, p, p, p, f, p, p, p, p, p, p, i, p]
        lib.mxc_attn_block_fp8.restype = i
        lib.mxc_attn_block_fp8_error.restype = ctypes.c_char_p
        self.lib = lib
        status = lib.mxc_attn_block_fp8_prepare()
        if status:
            raise RuntimeError(f"attn block {so}: prepare status {status} ({lib.mxc_attn_block_fp8_error().decode()}; "
                               f"active clusters {lib.mxc_attn_block_fp8_active_clusters()})")
        self.cluster = bool(lib.mxc_attn_block_fp8_cluster())
        self.ctas = lib.mxc_attn_block_fp8_ctas()
        # tagged words (zero before the first launch): qkv and attn 32-bit, the partials 64-bit
        self.ws = dict(qkv=torch.zeros((HQ + 2 * HKV) * D, dtype=torch.int32, device="cuda"),
                       part=torch.zeros(2 * lib.mxc_attn_block_fp8_part_floats(), dtype=torch.int32, device="cuda"),
                       attn=torch.zeros(H, dtype=torch.int32, device="cuda"),
                       sync=torch.zeros(lib.mxc_attn_block_fp8_sync_words(), dtype=torch.int32, device="cuda"),
                       acc=torch.zeros(H, dtype=torch.float32, device="cuda"))

    def __call__(self, x, layer, step, pdl: bool):
        """x [1, H] bf16, updated in place: x + o(attention(qkv(rms_norm(x))))."""
        ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        ws = self.ws
        w = "grouped" if self.cluster else "sw"
        status = self.lib.mxc_attn_block_fp8(
            ptr(x), ptr(layer["norm"]), EPS, ptr(layer[f"w_qkv_{w}"]), ptr(layer[f"s_qkv_{w}"]), ptr(layer[f"w_o_{w}"]),
            ptr(layer["s_o"]), ptr(step["cos"]), ptr(step["sin"]), ptr(layer["k_cache"]), ptr(layer["v_cache"]),
            layer["k_cache"].shape[1], ptr(step["slots"]), ptr(step["kv_lens"]), ptr(step["positions"]),
            ptr(step["cache_loc"]), step["qk_scale"], ptr(x), ptr(ws["qkv"]), ptr(ws["part"]), ptr(ws["attn"]),
            ptr(ws["sync"]), ptr(ws["acc"]), int(pdl), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if status:
            raise RuntimeError(f"attn block: launch status {status} ({self.lib.mxc_attn_block_fp8_error().decode()})")
        return x


def swizzle(w: torch.Tensor) -> torch.Tensor:
    """``w`` [R, K] e4m3 with each row's 16-byte chunk c of every 128 bytes moved to c ^ (row & 7)."""
    R, K = w.shape
    chunks = w.view(torch.uint8).view(R, K // 128, 8, 16)
    out = torch.empty_like(chunks)
    for r in range(8):
        perm = torch.tensor([p ^ r for p in range(8)], device=w.device)  # stored chunk p holds chunk p ^ r
        out[r::8] = chunks[r::8][:, :, perm]
    return out.view(R, K).view(FP8)


def qkv_group_order() -> torch.Tensor:
    """The qkv rows in MXC_AB_CLUSTER's order: for each kv group, its four q heads, its k head, its v head."""
    order = []
    for g in range(HKV):
        order += range(g * (HQ // HKV) * D, (g + 1) * (HQ // HKV) * D)
        order += range(HQ * D + g * D, HQ * D + (g + 1) * D)
        order += range((HQ + HKV) * D + g * D, (HQ + HKV) * D + (g + 1) * D)
    return torch.tensor(order)


def o_blocks(w_o: torch.Tensor) -> torch.Tensor:
    """w_o [H, HQ * D] as MXC_AB_CLUSTER's CTAs read it: block (group g, rank r) = rows 256r.., columns 512g.. (the
    group's heads), contiguous and swizzled, in CTA order."""
    cols = (HQ // HKV) * D
    blocks = [swizzle(w_o[256 * r:256 * (r + 1), cols * g:cols * (g + 1)].contiguous())
              for g in range(HKV) for r in range(H // 256)]
    return torch.stack([b.view(torch.uint8) for b in blocks]).view(w_o.shape).view(FP8)


def fp8_weight(rows, cols, gen):
    q = (torch.randn(rows, cols, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8)
    s = torch.full((rows,), 0.02 / 64, device="cuda") * (1 + 0.1 * torch.rand(rows, device="cuda", generator=gen))
    return q, s


def make_layer(gen, L, context, mlp: bool):
    w_qkv, s_qkv = fp8_weight((HQ + 2 * HKV) * D, H, gen)
    w_o, s_o = fp8_weight(H, HQ * D, gen)
    k = torch.zeros(1, L, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    k[0, :context - 1] = torch.randn(context - 1, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    v[0, :context - 1] = torch.randn(context - 1, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    order = qkv_group_order().to(w_qkv.device)
    layer = dict(w_qkv=w_qkv, s_qkv=s_qkv, w_o=w_o, s_o=s_o, w_qkv_sw=swizzle(w_qkv), w_o_sw=swizzle(w_o),
                 s_qkv_sw=s_qkv, w_qkv_grouped=swizzle(w_qkv[order].contiguous()), s_qkv_grouped=s_qkv[order].contiguous(),
                 w_o_grouped=o_blocks(w_o),
                 norm=(1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(torch.bfloat16),
                 k_cache=k, v_cache=v)
    if mlp:
        layer["w_gu"], layer["s_gu"] = fp8_weight(2 * INTER, H, gen)
        layer["w_d"], layer["s_d"] = fp8_weight(H, INTER, gen)
        layer["norm2"] = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(torch.bfloat16)
    return layer


def make_step(context, L):
    pos = context - 1
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.arange(L, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    return dict(cos=freqs.cos().contiguous(), sin=freqs.sin().contiguous(),
                slots=torch.zeros(1, dtype=torch.int32, device="cuda"),
                kv_lens=torch.full((1,), context, dtype=torch.int32, device="cuda"),
                positions=torch.full((1,), pos, dtype=torch.int64, device="cuda"),
                cache_loc=torch.full((1,), pos, dtype=torch.int64, device="cuda"),
                qk_scale=1.0 / math.sqrt(D) * math.log2(math.e), scale=1.0 / math.sqrt(D))


def chain_attn(x, layer, step):
    qkv = cuda_ops.rms_norm_qlinear_small_m(x, layer["norm"], layer["w_qkv"], layer["s_qkv"], eps=EPS)
    q = triton_rope.rope_qkv_write(qkv, step["positions"], step["cos"], step["sin"], layer["k_cache"],
                                   layer["v_cache"], step["cache_loc"], None, None, EPS)
    a = triton_attention.decode_attention(q, layer["k_cache"], layer["v_cache"], step["slots"], step["kv_lens"],
                                          step["scale"], early_dependents=True)
    return triton_fp8.qlinear_small_m(a.view(1, HQ * D), layer["w_o"], layer["s_o"], residual=x, out=x)


def mlp(x, layer):
    return cuda_ops.rms_norm_mlp_small_m(x, layer["norm2"], layer["w_gu"], layer["s_gu"], layer["w_d"], layer["s_d"],
                                         eps=EPS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=192, help="rows attended, the new one included")
    ap.add_argument("--max-len", type=int, default=2049, help="cache rows a slot (the decode splits follow it)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-mlp", action="store_true", help="skip the variants with the MLP")
    ap.add_argument("--tp2", action="store_true", help="one rank's shapes at tp = 2 (no all-reduce); the block is "
                    "then the cluster build cluster_tp2")
    ap.add_argument("--lib", default=None, help="the block's library (default build/attn_block/attn_block_fp8.so, "
                    "with --tp2 cluster_tp2.so)")
    ap.add_argument("--libs", default="", help="comma-separated lab libraries to time as well")
    ap.add_argument("--compile-variants", default=None, metavar="DIR", help="compile LAB_VARIANTS into DIR, exit")
    args = ap.parse_args()
    if args.compile_variants:
        for name, flags in LAB_VARIANTS.items():
            print(compile_library(str(Path(args.compile_variants) / f"{name}.so"), flags), " ".join(flags))
        return
    if args.tp2:
        global HQ, HKV, INTER
        HQ, HKV, INTER = 16, 4, 7168
    torch.manual_seed(0)
    block = Block(args.lib or f"build/attn_block/{'cluster_tp2' if args.tp2 else 'attn_block_fp8'}.so")
    extra = {Path(so).stem: Block(so) for so in filter(None, args.libs.split(","))}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with_mlp = not args.no_mlp
    layers = [make_layer(gen, args.max_len, args.context, with_mlp) for _ in range(args.layers)]
    step = make_step(args.context, args.max_len)
    x0 = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)

    with launch.using(launch.jit_launch_pdl):
        # one layer each, from the same x and cache
        caches = [(layers[0]["k_cache"].clone(), layers[0]["v_cache"].clone())]
        xc = chain_attn(x0.clone(), layers[0], step)
        kc, vc = layers[0]["k_cache"].clone(), layers[0]["v_cache"].clone()
        layers[0]["k_cache"].copy_(caches[0][0])
        layers[0]["v_cache"].copy_(caches[0][1])
        xb = block(x0.clone(), layers[0], step, pdl=True)
        torch.cuda.synchronize()
        pos = args.context - 1
        dc, db = (xc.float() - x0.float()), (xb.float() - x0.float())
        print(f"one layer: block against chain, attention output delta: max {float((db - dc).abs().max()):.3e} "
              f"({float((db - dc).abs().max() / dc.abs().max()):.2%} of its scale {float(dc.abs().max()):.3e})")
        for name, lib in extra.items():
            for _ in range(2):  # twice: the second launch runs on the workspace the first left
                layers[0]["k_cache"].copy_(caches[0][0])
                layers[0]["v_cache"].copy_(caches[0][1])
                xe = lib(x0.clone(), layers[0], step, pdl=True)
            torch.cuda.synchronize()
            de = xe.float() - x0.float()
            print(f"one layer: {name} against chain: {float((de - dc).abs().max() / dc.abs().max()):.2%} of the "
                  f"delta's scale; k row max diff {float((kc[0, pos] - layers[0]['k_cache'][0, pos]).float().abs().max()):.3e}")
        layers[0]["k_cache"].copy_(caches[0][0])
        layers[0]["v_cache"].copy_(caches[0][1])
        xb = block(x0.clone(), layers[0], step, pdl=True)
        torch.cuda.synchronize()
        for name, a, b in (("k", kc, layers[0]["k_cache"]), ("v", vc, layers[0]["v_cache"])):
            row = (a[0, pos].float() - b[0, pos].float()).abs().max()
            rest = torch.equal(a[0, :pos], b[0, :pos]) and torch.equal(a[0, pos + 1:], b[0, pos + 1:])
            print(f"one layer: new {name} row max |block - chain| {float(row):.3e} "
                  f"(row scale {float(a[0, pos].float().abs().max()):.3e}); other rows equal: {rest}")
        # replays leave the counters at zero
        for _ in range(3):
            block(x0.clone(), layers[0], step, pdl=True)
        torch.cuda.synchronize()
        assert int(block.ws["sync"][0]) == 0, "attn block: the exit count not reset"

        variants = {"chain": lambda x: [chain_attn(x, layer, step) for layer in layers],
                    "block": lambda x: [block(x, layer, step, pdl=True) for layer in layers]}
        if with_mlp:
            def chain_full(x):
                for layer in layers:
                    x = mlp(chain_attn(x, layer, step), layer)

            def block_full(x):
                for layer in layers:
                    x = mlp(block(x, layer, step, pdl=True), layer)
            variants.update({"chain+mlp": chain_full, "block+mlp": block_full})
        for name, lib in extra.items():
            variants[f"block:{name}"] = lambda x, lib=lib: [lib(x, layer, step, pdl=True) for layer in layers]
            if with_mlp:
                def lib_full(x, lib=lib):
                    for layer in layers:
                        x = mlp(lib(x, layer, step, pdl=True), layer)
                variants[f"block:{name}+mlp"] = lib_full
        xs = {name: x0.clone() for name in variants}
        graphs = {}
        for name, fn in variants.items():
            fn(xs[name])  # warm-up outside capture (compiles the Triton kernels)
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn(xs[name])

    bw = copy_bandwidth()
    attn_bytes = (HQ + 2 * HKV) * D * H + H * HQ * D
    mlp_bytes = 3 * INTER * H
    print(f"context {args.context}, {args.layers} layers; copy rate {bw / 1e12:.2f} TB/s: attention weights "
          f"{attn_bytes / bw * 1e6:.2f} us a layer, MLP {mlp_bytes / bw * 1e6:.2f}")
    times = interleaved_graph_us(graphs, args.rounds, args.reps, args.layers)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, us in med.items():
        print(f"{name}: {us:.2f} us a layer ({args.layers * us / 1e3:.3f} ms for {args.layers} layers)")
    for a, b in (("chain", "block"), ("chain+mlp", "block+mlp")):
        if a in med and b in med:
            print(f"{b} saves {med[a] - med[b]:.2f} us a layer against {a} "
                  f"({(med[a] - med[b]) * 32 / 1e3:.3f} ms a 32-layer step)")
    for name, lib in extra.items():
        for suffix in ("", "+mlp"):
            if f"block:{name}{suffix}" in graphs:
                graphs[f"block:{name}{suffix}"].replay()
                torch.cuda.synchronize()
                if lib.lib.mxc_attn_block_fp8_traced():
                    print(f"block:{name}{suffix}:", end=" ")
                    print_trace(lib, args.layers)


if __name__ == "__main__":
    main()
