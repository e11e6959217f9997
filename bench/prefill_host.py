"""Is the fp8 prefill bound by the host? Host enqueue time against GPU time of one prompt's prefill.

Builds (or reuses, ``--reuse``, when its ``--max-seq-len`` is large enough) one Llama-3-8B-shaped
``--quant fp8`` cuda artifact, then for a prompt of each of ``--tokens`` (a comma list): the wall time until
the forward returns to Python (every kernel enqueued; nothing in the prefill waits for the GPU) and until the
GPU finishes, medians of five; and where the artifact has a prefill graph for the length (``--prefill-graphs``),
the time until its replay's GPU work is done. ``--profile`` adds a cProfile of one forward's host side for the last count
(the functions that take the most time themselves). Where the enqueue time approaches the GPU time the GPU
starves: the prompt's time to first token is the host's.
Usage: python bench/prefill_host.py [--out DIR] [--tokens 128,512,2048] [--reuse] [--profile] [--prefill-graphs N]
"""

from __future__ import annotations

import argparse
import cProfile
import json
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


def fp8_prefill_model(out: Path, tokens: int, reuse: bool, prefill_graphs: int | None = None):
    """The Llama-3-8B-shaped ``--quant fp8`` cuda artifact at ``out`` (built unless ``reuse`` finds one whose
    ``--max-seq-len`` holds ``tokens`` + 1 and, where given, with ``--prefill-graphs prefill_graphs``), loaded,
    and a prompt of ``tokens`` random ids on the GPU: (model, ids [tokens])."""
    manifest = out / "manifest.json"
    options = json.loads(manifest.read_text())["options"] if reuse and manifest.exists() else None
    if not (options and options["max_seq_len"] > tokens
            and prefill_graphs in (None, options.get("prefill_graph_tokens"))):
        mxc.build("llama.yaml", config=str(HERE / "llama3_8b.json"), out=out, target="cuda", dtype="bfloat16",
                  quant="fp8", max_batch=1, max_seq_len=tokens + 1, prefill_graphs=prefill_graphs, progress=False)
    return mxc.load(out, device="cuda", verify=False), prompt(tokens)


def prompt(tokens: int) -> torch.Tensor:
    return torch.randint(0, 1000, (tokens,), device="cuda")


def enqueue_and_total(forward, reps: int = 5) -> tuple[float, float]:
    """Medians over ``reps`` calls from an idle GPU, in seconds: until ``forward`` returns, until the GPU is done."""
    for _ in range(2):
        forward()
    enqueue, total = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enqueue.append(t1 - t0)
        total.append(t2 - t0)
    return statistics.median(enqueue), statistics.median(total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-prefill-host")
    p.add_argument("--tokens", default="128,512,2048", help="prompt lengths, a comma list")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--profile", action="store_true", help="a cProfile of the last length's forward")
    p.add_argument("--prefill-graphs", type=int, help="the build's --prefill-graphs (default: the builder's)")
    args = p.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    model, _ = fp8_prefill_model(Path(args.out), max(counts), args.reuse, args.prefill_graphs)
    graphs = model._decoder.prefill_graphs
    print(f"prefill graphs: buckets {sorted(graphs)} (--prefill-graphs); eager is the runtime's prefill without them")
    print("| fp8 prefill, one prompt (medians of 5) | eager: host enqueue | eager: until the GPU is done "
          "| graph replay: until the GPU is done | graph / eager |")
    print("|---|---|---|---|---|")
    for s in counts:
        ids2d = prompt(s).reshape(1, s)

        def forward():  # the runtime's prefill (``generate``'s, without its sampling): RoPE tables made at load
            return model._decoder.prefill(ids2d, graphs=False)

        enqueue, total = enqueue_and_total(forward)
        graph = "-"
        if any(s <= t for t in graphs):
            _, replay = enqueue_and_total(lambda: model._decoder.prefill(ids2d))
            graph = f"{replay * 1e3:.2f} ms | {total / replay:.2f}x faster"
        else:
            graph += " | -"
        print(f"| {s} tokens | {enqueue * 1e3:.2f} ms | {total * 1e3:.2f} ms | {graph} |")
    print(f"GPU memory: {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved at most "
          f"({torch.cuda.memory_reserved() / 2**30:.2f} now)")
    if args.profile:
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
