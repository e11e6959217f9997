"""Mixture-of-experts benchmark on one GPU (Qwen3-30B-A3B shape, random bf16 weights).

In one run: batch-1 decode ms/token against the active-weight bandwidth floor
(the weights one token touches: attention, router, its 8 experts per layer,
the LM head), batch-64 decode against Hugging Face eager, and the fused MoE
kernel against a per-expert loop (the reference) at decode and prefill token
counts. Prints a table last. Usage: python bench/moe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mxc  # noqa: E402
from decode import _Rows, bench_generate, copy_bandwidth, cuda_time, hf_model, weight_bytes  # noqa: E402
from profile_step import profile_decode  # noqa: E402

HERE = Path(__file__).parent


def kernel_vs_loop(rows) -> None:
    from mxc.kernels import moe_ref, triton_moe, triton_moe_decode

    e, h, i, k = 128, 2048, 768, 8
    w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    for t in (1, 64, 2048):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w, ids = moe_ref.route(torch.randn(t, e, device="cuda"), k, renormalize=True)
        fused = cuda_time(lambda: triton_moe.fused_moe(x, w.to(x.dtype), ids, w1, w2), warmup=3, reps=10)
        loop = cuda_time(lambda: moe_ref.fused_moe(x, w.to(x.dtype), ids, w1, w2), warmup=1, reps=3)
        rows.append((f"fused MoE layer, {t} tokens", f"{fused * 1e6:.0f} us vs per-expert loop {loop * 1e6:.0f} us "
                     f"({loop / fused:.1f}x)"))
        if t <= 4:  # the per-pair decode kernels (the default at <= 4 tokens), with their own weight bytes
            pairs = cuda_time(lambda: triton_moe_decode.fused_moe(x, w.to(x.dtype), ids, w1, w2), warmup=3, reps=10)
            nbytes = t * k * 3 * h * i * 2
            rows.append((f"per-pair MoE layer, {t} tokens", f"{pairs * 1e6:.0f} us ({nbytes / pairs / 1e12:.2f} TB/s "
                         f"of expert weights; sorted path {fused * 1e6:.0f} us)"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-qwen3-30b-a3b")
    p.add_argument("--config", default=str(HERE / "qwen3_30b_a3b.json"))
    p.add_argument("--hf", action="store_true", help="also measure HF eager at batch 64")
    p.add_argument("--no-batch1", dest="batch1", action="store_false",
                   help="skip batch-1 decode and its profile (measured in an earlier run)")
    p.add_argument("--batch1-only", action="store_true", help="batch-1 decode and its profile only")
    args = p.parse_args()
    rows = _Rows()  # each row also printed as measured
    bw = copy_bandwidth()
    rows.append(("copy bandwidth (measured)", f"{bw / 1e12:.2f} TB/s"))
    t0 = time.perf_counter()
    art = mxc.build("llama.yaml", config=args.config, out=args.out, target="cuda", dtype="bfloat16", max_batch=64,
                    max_seq_len=512, progress=False)
    rows.append(("build", f"{time.perf_counter() - t0:.0f} s"))
    model = mxc.load(art, device="cuda", verify=False)
    nbytes, _ = weight_bytes(json.loads((Path(art) / "manifest.json").read_text()), Path(art))
    floor = nbytes / bw
    rows.append(("active weights per token", f"{nbytes / 1e9:.2f} GB (floor {floor * 1e3:.2f} ms)"))
    if args.batch1:
        step = bench_generate(lambda ids, new: model.generate(ids, max_new_tokens=new), 1, 128, 64)
        rows.append(("mxc decode batch 1", f"{step * 1e3:.2f} ms/token, {floor / step * 100:.0f}% of the floor"))
        print("\nper-kernel breakdown of one batch-1 decode step:\n" + profile_decode(model) + "\n", flush=True)
    if args.batch1_only:
        print("\n" + "\n".join(f"{k:36s} {v}" for k, v in rows))
        return
    step64 = bench_generate(lambda ids, new: model.generate(ids, max_new_tokens=new), 64, 128, 32)
    rows.append(("mxc decode batch 64", f"{step64 * 1e3:.2f} ms/step"))
    kernel_vs_loop(rows)
    if args.hf:
        del model
        torch.cuda.empty_cache()
        hf = hf_model(Path(args.config))
        ids = torch.randint(0, 1000, (64, 128), device="cuda")

        def gen(n):
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        t_hf = (cuda_time(lambda: gen(32), warmup=1, reps=1) - cuda_time(lambda: gen(1), warmup=1, reps=1)) / 31
        rows.append(("HF eager decode batch 64", f"{t_hf * 1e3:.1f} ms/step; mxc is {t_hf / step64:.1f}x faster"))
    print("\n" + "\n".join(f"{k:36s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
