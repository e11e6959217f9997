"""The decode step's small kernels, one by one, over their warps (and the attention's splits), on one GPU.

A batch-1 decode step runs, between its GEMVs, kernels that touch a few KB: the RMSNorm (and add +
RMSNorm), RoPE with the KV-cache write, decode attention (split kernel + merge), SiLU-and-mul. At
batch 1 they are latency-bound, so their launch shape (warps a program, splits) matters more than
bandwidth; the fused MoE router measured 5.35 us at one warp against 6.11 us at eight. Each is timed
as decode runs it (a CUDA graph of back-to-back calls) at every warp count, against its default,
and checked against the default's output. Shapes: Llama-3-8B at tp=1 and tp=2, Qwen3-30B-A3B.

Measured on one H200 (Triton 3.6, 2026-11-30; docs/perf.md, ninth run): the attention at 64-row blocks
(4.5 against 5.2-5.7 us at 192 visible rows) and RoPE at twice the warps (1.55 against 1.84 us) were
faster alone, but a Llama-3-8B build with both decoded at 4.20-4.22 ms/token, the same as without
them (4.20) in the same call: under programmatic dependent launch these kernels' latency hides behind
the GEMVs' weight prefetch. The defaults stayed. The norms' defaults were best or within 1%.
Usage: python bench/small_lab.py [--skip norm,rope,attention,silu]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_lab import time_us  # noqa: E402

from mxc.kernels import triton_attention, triton_elementwise, triton_norm, triton_rope  # noqa: E402

WARPS = (1, 2, 4, 8)
ROPE = {"type": "default", "theta": 500000.0, "rotary_dim": 128}
dev, bf16 = "cuda", torch.bfloat16


@contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _row(what: str, t: float, default: float) -> None:
    print(f"{what:58s} {t:6.2f} us ({t / default:.2f}x the default)", flush=True)


def norms() -> None:
    for H in (4096, 2048):
        for T in (1, 8):
            x = torch.randn(T, H, device=dev, dtype=bf16)
            r = torch.randn(T, H, device=dev, dtype=bf16)
            w = torch.randn(H, device=dev, dtype=bf16)
            cases = {"rms_norm": lambda i: triton_norm.rms_norm(x, w, 1e-5),
                     "add_rms_norm": lambda i: triton_norm.add_rms_norm(x, r, w, 1e-5)}
            for name, fn in cases.items():
                ref, default = fn(0), time_us(fn)
                print(f"{name} H={H} T={T}: default {triton_norm.row_warps(H)} warps {default:6.2f} us", flush=True)
                for warps in WARPS:
                    with patched(triton_norm, "row_warps", lambda H, w_=warps: w_):
                        got = fn(0)
                        assert all(torch.equal(a, b) for a, b in zip(got, ref)) if isinstance(ref, tuple) \
                            else torch.equal(got, ref), f"{name} at {warps} warps differs"
                        _row(f"  {name} H={H} T={T}, {warps} warps", time_us(fn), default)


def ropes() -> None:
    for label, hq, hkv, qk_norm in (("Llama-3-8B tp=1", 32, 8, False), ("Llama-3-8B tp=2", 16, 4, False),
                                    ("Qwen3-30B-A3B", 32, 4, True)):
        D, L, T = 128, 512, 1
        qkv = torch.randn(T, (hq + 2 * hkv) * D, device=dev, dtype=bf16)
        pos = torch.tensor([191], device=dev)
        cos, sin = triton_rope.rope_tables(ROPE, L, dev)
        kc, vc = (torch.zeros(1, L, hkv, D, device=dev, dtype=bf16) for _ in range(2))
        loc = torch.tensor([191], device=dev)
        qn = kn = torch.ones(D, device=dev, dtype=bf16) if qk_norm else None
        out = torch.empty(T, hq, D, device=dev, dtype=bf16)

        def fn(i, w=None):
            return triton_rope.rope_qkv_write(qkv, pos, cos, sin, kc, vc, loc, qn, kn, 1e-6, out=out, num_warps=w)

        ref, default = fn(0).clone(), time_us(fn)
        print(f"rope_qkv_write {label}: default {default:6.2f} us", flush=True)
        for warps in WARPS:
            assert torch.equal(fn(0, warps), ref), f"rope at {warps} warps differs"
            _row(f"  rope_qkv_write {label}, {warps} warps", time_us(lambda i, w=warps: fn(i, w)), default)


def attention() -> None:
    for label, hq, hkv, L in (("Llama-3-8B tp=1, L=2049", 32, 8, 2049), ("Llama-3-8B tp=2, L=512", 16, 4, 512),
                              ("Qwen3-30B-A3B, L=512", 32, 4, 512)):
        D = 128
        for kv_len in (192, 1024):
            if kv_len > L:
                continue
            q = torch.randn(1, hq, D, device=dev, dtype=bf16)
            kc, vc = (torch.randn(1, L, hkv, D, device=dev, dtype=bf16) for _ in range(2))
            slots = torch.zeros(1, device=dev, dtype=torch.int32)
            lens = torch.tensor([kv_len], device=dev, dtype=torch.int32)

            def fn(i, splits=None):
                return triton_attention.decode_attention(q, kc, vc, slots, lens, D ** -0.5, num_splits=splits)

            ref, default = fn(0), time_us(fn)
            splits0 = triton_attention.default_splits(L, hkv)
            print(f"decode attention {label}, {kv_len} rows: default ({splits0} splits, "
                  f"{triton_attention._decode_config(D)}) {default:6.2f} us", flush=True)
            for splits in (1, 2, 4, 8):
                for block_n in (64, 128):
                    for warps in (2, 4, 8):
                        cfg = (block_n, warps, 2)
                        with patched(triton_attention, "_decode_config", lambda D, c=cfg: c):
                            got = fn(0, splits)
                            err = (got.float() - ref.float()).abs().max().item()
                            assert err < 2e-2, f"attention splits={splits} {cfg} differs by {err}"
                            t = time_us(lambda i, s=splits: fn(i, s))
                        _row(f"  attention {label} {kv_len} rows, {splits} splits, BLOCK_N {block_n}, {warps} w",
                             t, default)


def silu() -> None:
    for I in (14336, 7168, 768):
        x = torch.randn(1, 2 * I, device=dev, dtype=bf16)

        def fn(i):
            return triton_elementwise.silu_mul(x)

        ref, default = fn(0), time_us(fn)
        block0, warps0 = triton_elementwise._config(I)
        print(f"silu_mul I={I}: default (BLOCK_N {block0}, {warps0} warps) {default:6.2f} us", flush=True)
        for block_n in (512, 1024, 2048):
            for warps in WARPS:
                with patched(triton_elementwise, "_config", lambda n, c=(block_n, warps): c):
                    assert torch.equal(fn(0), ref)
                    _row(f"  silu_mul I={I}, BLOCK_N {block_n}, {warps} warps", time_us(fn), default)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--skip", default="", help="comma-separated: norm, rope, attention, silu")
    skip = set(p.parse_args().skip.split(","))
    for name, fn in (("norm", norms), ("rope", ropes), ("attention", attention), ("silu", silu)):
        if name not in skip:
            fn()


if __name__ == "__main__":
    main()
