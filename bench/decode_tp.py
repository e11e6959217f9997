"""Tensor-parallel decode on one host: tp=N against tp=1 in the same run, and all-reduce time per token.

Builds Llama-3-8B-shaped artifacts (random bf16 weights) at tp=1 and tp=N,
measures batch-1 decode ms/token for each (CUDA graphs, collectives captured),
and times the all-reduce of one decode step's hidden state ([1, 4096] bf16,
8 KB) with NCCL, which at tp=N happens 2 x layers + 1 times per token. The tp=N artifact
uses NCCL (``--tp-allreduce nccl``); ``--one-shot`` adds the default one-shot build.
Prints a table last. Usage (on a machine with N GPUs):
    python bench/decode_tp.py --tp 2 --out build/bench-tp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mxc  # noqa: E402
from mxc.runtime.ranks import run_ranks  # noqa: E402

HERE = Path(__file__).parent


def _step_time(model, prompt=128, new=128) -> float:
    ids = torch.randint(0, 1000, (1, prompt))

    def timed(n):
        model.generate(ids, max_new_tokens=n)  # warm-up: captures the graph
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            model.generate(ids, max_new_tokens=n)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 3

    return (timed(new) - timed(1)) / (new - 1)


def _graph_time(fn, reps=100) -> float:
    """Seconds per call of fn() replayed from a CUDA graph of ``reps`` calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _worker(rank, world_size, device, art, out):
    import torch.distributed as dist

    model = mxc.load(art, device=device, rank=rank, world_size=world_size, verify=False)
    step = _step_time(model)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    result = {"step": step, "all_reduce": _graph_time(lambda: dist.all_reduce(x))}
    comm = model._dist.get("peer_allreduce")
    if comm is not None:  # the artifact's one-shot all-reduce, alone
        result["one_shot"] = _graph_time(lambda: comm(x))
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default="build/bench-tp")
    p.add_argument("--config", default=str(HERE / "llama3_8b.json"))
    p.add_argument("--one-shot", action="store_true",
                   help="also build tp=N with --tp-allreduce one_shot and measure it in the same run")
    args = p.parse_args()
    rows = []
    arts = {}
    for tp in (1, args.tp):
        arts[tp] = mxc.build("llama.yaml", config=args.config, out=f"{args.out}-tp{tp}", target="cuda",
                             dtype="bfloat16", tp=tp, max_batch=8, max_seq_len=512, tp_allreduce="nccl",
                             progress=False)
    if args.one_shot:
        arts["one_shot"] = mxc.build("llama.yaml", config=args.config, out=f"{args.out}-tp{args.tp}-one-shot",
                                     target="cuda", dtype="bfloat16", tp=args.tp, max_batch=8, max_seq_len=512,
                                     tp_allreduce="one_shot", progress=False)
    single = mxc.load(arts[1], device="cuda", verify=False)
    t1 = _step_time(single)
    print(f"tp=1 decode batch 1: {t1 * 1e3:.2f} ms/token", flush=True)
    del single
    torch.cuda.empty_cache()
    result = Path(f"{args.out}-result.json")
    run_ranks(_worker, args.tp, "cuda", str(arts[args.tp]), str(result))
    r = json.loads(result.read_text())
    layers = json.loads((arts[1] / "manifest.json").read_text())["config"]["num_hidden_layers"]
    rows.append(("tp=1 decode batch 1", f"{t1 * 1e3:.2f} ms/token"))
    rows.append((f"tp={args.tp} decode batch 1, NCCL", f"{r['step'] * 1e3:.2f} ms/token"))
    rows.append(("all-reduce 8 KB (NCCL, in a graph)", f"{r['all_reduce'] * 1e6:.1f} us"))
    rows.append(("all-reduce time per token", f"{r['all_reduce'] * (2 * layers + 1) * 1e3:.2f} ms "
                 f"({2 * layers + 1} per token)"))
    rows.append((f"speed-up tp={args.tp} / tp=1", f"{t1 / r['step']:.2f}x"))
    if args.one_shot:
        run_ranks(_worker, args.tp, "cuda", str(arts["one_shot"]), str(result))
        o = json.loads(result.read_text())
        rows.append((f"tp={args.tp} one-shot all-reduce decode", f"{o['step'] * 1e3:.2f} ms/token "
                     f"({t1 / o['step']:.2f}x tp=1)"))
        if "one_shot" in o:
            rows.append(("one-shot all-reduce 8 KB, in a graph", f"{o['one_shot'] * 1e6:.1f} us"))
        else:
            rows.append(("one-shot all-reduce", "unavailable here: the run used NCCL (see the warning)"))
    print("\n" + "\n".join(f"{k:40s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
