"""Is the fp8 prefill bound by the host? Host enqueue time against GPU time of one 2048-token prefill.

Builds (or reuses, ``--reuse``) a Llama-3-8B-shaped ``--quant fp8`` cuda artifact, then for one prompt of
``--tokens`` tokens: the wall time until the forward returns to Python (every kernel enqueued; nothing in
the prefill waits for the GPU) and until the GPU finishes, medians of five; then a cProfile of one forward's
host side, the functions that take the most time themselves. If the enqueue time approaches the GPU time
the GPU starves, as the plain-launch profiles' gaps suggest on some machines.
Usage: python bench/prefill_host.py [--out DIR] [--tokens 2048] [--reuse]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mxc  # noqa: E402

HERE = Path(__file__).parent


def fp8_prefill_model(out: Path, tokens: int, reuse: bool):
    """The Llama-3-8B-shaped ``--quant fp8`` cuda artifact at ``out`` (built unless ``reuse`` finds one), loaded, and
    a prompt of ``tokens`` random ids on the GPU: (model, ids [tokens])."""
    if not (reuse and (out / "manifest.json").exists()):
        mxc.build("llama.yaml", config=str(HERE / "llama3_8b.json"), out=out, target="cuda", dtype="bfloat16",
                  quant="fp8", max_batch=1, max_seq_len=tokens + 1, progress=False)
    return mxc.load(out, device="cuda", verify=False), torch.randint(0, 1000, (tokens,), device="cuda")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-prefill-host")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reuse", action="store_true")
    args = p.parse_args()
    model, ids = fp8_prefill_model(Path(args.out), args.tokens, args.reuse)
    s = args.tokens
    ids2d = ids.reshape(1, s)

    def forward():  # the runtime's prefill (``generate``'s, without its sampling): its RoPE tables made at load
        return model._decoder.prefill(ids2d)

    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    enqueue, total = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enqueue.append(t1 - t0)
        total.append(t2 - t0)
    print(f"{s}-token fp8 prefill: host enqueue {statistics.median(enqueue) * 1e3:.1f} ms, "
          f"until the GPU is done {statistics.median(total) * 1e3:.1f} ms (medians of 5)")
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    forward()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue())


if __name__ == "__main__":
    main()
