"""Causal prefill attention on one GPU: mxc's Triton kernel against torch's SDPA backends.

One sequence of T tokens with nothing cached before it (a prompt's prefill), Llama-3-8B heads
(32 q heads, 8 kv heads, head_dim 128, bf16). mxc's kernel reads k and v from the KV cache
([slots, L, HKV, D]) that the RoPE kernel wrote; SDPA gets views of the same cache rows
([1, HKV, T, D], strided) and the queries as [1, HQ, T, D] views of [T, HQ, D], with
``enable_gqa`` (or k/v repeated to HQ heads where a backend refuses GQA, which the table says).
Prints ms, TFLOP/s (causal: 2 * T^2 * D * HQ multiply-adds, i.e. half the square) and the max
difference from mxc's output. ``--sweep`` also times mxc's kernel over tile configs (BLOCK_M,
BLOCK_N, warps, stages); ``--new-lengths`` times the first cuDNN call at prompt lengths it has not
seen (its execution plan is built per shape); ``--orders`` times mxc's grid in both orders (the
short query blocks first, or the longest first). Usage:
python bench/attention_lab.py [--tokens 2048,4096] [--sweep] [--orders] [--no-sdpa] [--new-lengths 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import triton_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128
SWEEP = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3),
         (128, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 128, 4, 2)]


def ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200)


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="2048,4096")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--new-lengths", type=int, default=0)
    p.add_argument("--orders", action="store_true",
                   help="time mxc's grid in both orders (triton_attention.PREFILL_LONGEST_FIRST off and on)")
    p.add_argument("--no-sdpa", action="store_true", help="mxc's kernel only")
    args = p.parse_args()
    orders = (False, True) if args.orders else (triton_attention.PREFILL_LONGEST_FIRST,)
    dev = "cuda"
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for T in [int(t) for t in args.tokens.split(",")]:
        L = T + 64
        q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
        slots = torch.zeros(1, dtype=torch.int32, device=dev)
        kv_lens = torch.full((1,), T, dtype=torch.int32, device=dev)
        q_start = torch.tensor([0, T], dtype=torch.int32, device=dev)
        scale = D ** -0.5
        flops = 2 * T * T * D * HQ  # causal: half of 4 * T^2 * D * HQ

        def mxc_attn():
            return triton_attention.prefill_attention(q, kc, vc, slots, kv_lens, q_start, T, scale)

        shipped = triton_attention.PREFILL_LONGEST_FIRST
        ref = mxc_attn()
        for order in orders:
            triton_attention.PREFILL_LONGEST_FIRST = order
            o = mxc_attn()
            t = ms(mxc_attn)
            diff = (o.float() - ref.float()).abs().max().item()
            label = "mxc Triton (FA2)" + (", longest first" if order else "")
            print(f"T={T:5d} {label:34s} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s  max diff {diff:.2e}")
            if args.sweep:
                default = triton_attention._prefill_config
                for cfg in SWEEP:
                    triton_attention._prefill_config = lambda D, n, cfg=cfg: cfg
                    try:
                        o = mxc_attn()
                        tc = ms(mxc_attn)
                        diff = (o.float() - ref.float()).abs().max().item()
                        print(f"T={T:5d}   mxc {str(cfg):28s} {tc:7.3f} ms {flops / tc / 1e9:6.0f} TFLOP/s  "
                              f"max diff {diff:.2e}", flush=True)
                    except Exception as e:  # out of shared memory
                        print(f"T={T:5d}   mxc {str(cfg):28s} failed: {str(e).splitlines()[0][:80]}")
                    finally:
                        triton_attention._prefill_config = default
        triton_attention.PREFILL_LONGEST_FIRST = shipped
        qv = q.transpose(0, 1).unsqueeze(0)  # [1, HQ, T, D] view
        kv_ = kc[0, :T].transpose(0, 1).unsqueeze(0)  # [1, HKV, T, D] view
        vv = vc[0, :T].transpose(0, 1).unsqueeze(0)
        backends = (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION))
        for name, backend in () if args.no_sdpa else backends:
            for gqa in (True, False):
                k_in = kv_ if gqa else kv_.repeat_interleave(HQ // HKV, dim=1)
                v_in = vv if gqa else vv.repeat_interleave(HQ // HKV, dim=1)

                def run(k_in=k_in, v_in=v_in, gqa=gqa, backend=backend):
                    with sdpa_kernel(backend):
                        o = sdpa(qv, k_in, v_in, is_causal=True, scale=scale, enable_gqa=gqa)
                    return o[0].transpose(0, 1)

                label = f"SDPA {name}" + (" (enable_gqa)" if gqa else " (k/v repeated)")
                try:
                    o = run()
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    print(f"T={T:5d} {label:34s} refused: {str(e).splitlines()[0][:90]}")
                    continue
                t = ms(run)
                diff = (o.float() - ref.float()).abs().max().item()
                print(f"T={T:5d} {label:34s} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s  max diff {diff:.2e}  "
                      f"out contiguous as [T, HQ, D]: {o.is_contiguous()}", flush=True)
    if args.new_lengths:
        import time

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for T in range(1000, 1000 + args.new_lengths):
                qv = torch.randn(1, HQ, T, D, device=dev, dtype=torch.bfloat16)
                kv = torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                sdpa(qv, kv, kv, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                sdpa(qv, kv, kv, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                print(f"cuDNN at a new length T={T}: first call {first * 1e3:.1f} ms, "
                      f"second {(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
