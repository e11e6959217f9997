"""Tensor-parallel decode on one host: tp=N against tp=1 in the same run, and all-reduce time per token.

Builds Llama-3-8B-shaped artifacts (random bf16 weights) at tp=1 and tp=N,
measures batch-1 decode ms/token for each (CUDA graphs, collectives captured),
and times the all-reduce of one decode step's hidden state ([1, 4096] bf16,
8 KB), which at tp=N happens 2 x layers + 1 times per token: with NCCL, and with the
artifact's peer-memory all-reduce alone (and with the residual add and RMSNorm). One tp=N
artifact per ``--modes`` entry (``--tp-allreduce`` choices; ``push-unfused``: push without
``fuse_linear_all_reduce``; ``push-noearly``: push without ``early_launch_o_proj``); ``--sweep-warps`` times
the push kernel at 1-8 warps; ``--quant fp8`` builds every artifact, tp=1 included, with fp8 weights.
Prints a table last. Usage (on a machine with N GPUs):
    python bench/decode_tp.py --tp 2 --modes push,push-unfused --out build/bench-tp
    python bench/decode_tp.py --tp 2 --quant fp8 --modes push,push-noearly --out build/bench-tp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_step

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


def _worker(rank, world_size, device, art, out, profile=False, sweep=False):
    import torch.distributed as dist

    model = mxc.load(art, device=device, rank=rank, world_size=world_size, verify=False)
    step = _step_time(model)
    table = None
    if profile:  # every rank replays the same steps (their collectives pair up); rank 0's table is printed
        from profile_step import profile_decode

        table = profile_decode(model)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    result = {"step": step, "all_reduce": _graph_time(lambda: dist.all_reduce(x)), "profile": table}
    comm = model._dist.get("peer_allreduce")
    if comm is not None:  # the artifact's peer-memory all-reduce, alone
        result["peer"] = _graph_time(lambda: comm(x))
        r, wn = torch.randn_like(x), torch.ones(4096, dtype=torch.bfloat16, device=device)
        if hasattr(comm, "add_rms_norm"):
            result["peer_norm"] = _graph_time(lambda: comm.add_rms_norm(x, r, wn, 1e-5))
        if sweep and hasattr(comm, "add"):  # the push kernel at each warp count (the build's default: row_warps(H))
            from mxc.kernels import peer_allreduce

            default = peer_allreduce.row_warps
            result["sweep"] = {}
            for w in (1, 2, 4, 8):
                peer_allreduce.row_warps = lambda H, w_=w: w_
                result["sweep"][w] = (_graph_time(lambda: comm.add(x, r)),
                                      _graph_time(lambda: comm.add_rms_norm(x, r, wn, 1e-5)))
            peer_allreduce.row_warps = default
        if hasattr(comm, "check"):
            comm.check()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default="build/bench-tp")
    p.add_argument("--config", default=str(HERE / "llama3_8b.json"))
    p.add_argument("--modes", default="nccl,one_shot,push",
                   help="--tp-allreduce choices to build and measure; push-unfused: push with the row-parallel "
                        "GEMV apart from its all-reduce (--disable-pass fuse_linear_all_reduce)")
    p.add_argument("--quant", choices=["fp8"], help="fp8 weights in every artifact (tp=1 included)")
    p.add_argument("--profile", action="store_true", help="print rank 0's per-kernel breakdown of a batch-1 step")
    p.add_argument("--sweep-warps", action="store_true", help="time the push kernel (add, add + RMSNorm) at 1-8 warps")
    args = p.parse_args()
    kw = dict(config=args.config, target="cuda", dtype="bfloat16", max_batch=8, max_seq_len=512, progress=False,
              quant=args.quant)
    single = mxc.load(mxc.build("llama.yaml", out=f"{args.out}-tp1", tp=1, **kw), device="cuda", verify=False)
    t1 = _step_time(single)
    layers = single.manifest["config"]["num_hidden_layers"]
    print(f"tp=1 decode batch 1: {t1 * 1e3:.2f} ms/token", flush=True)
    del single
    torch.cuda.empty_cache()
    rows = [("tp=1 decode batch 1", f"{t1 * 1e3:.2f} ms/token")]
    result = Path(f"{args.out}-result.json")
    for mode in args.modes.split(","):
        choice, _, variant = mode.partition("-")
        disable = {"unfused": ("fuse_linear_all_reduce",), "noearly": ("early_launch_o_proj",)}.get(variant, ())
        art = mxc.build("llama.yaml", out=f"{args.out}-tp{args.tp}-{mode}", tp=args.tp, tp_allreduce=choice,
                        disable_passes=disable, **kw)
        run_ranks(_worker, args.tp, "cuda", str(art), str(result), args.profile, args.sweep_warps)
        r = json.loads(result.read_text())
        if r["profile"]:
            print(f"\nper-kernel breakdown of one tp={args.tp} batch-1 step ({mode}), rank 0:\n{r['profile']}\n")
        rows.append((f"tp={args.tp} decode batch 1, {mode}", f"{r['step'] * 1e3:.2f} ms/token ({t1 / r['step']:.2f}x tp=1)"))
        print(rows[-1], flush=True)
        if choice == "nccl":
            rows.append(("all-reduce 8 KB (NCCL, in a graph)", f"{r['all_reduce'] * 1e6:.1f} us"))
            rows.append(("NCCL all-reduce time per token", f"{r['all_reduce'] * (2 * layers + 1) * 1e3:.2f} ms "
                         f"({2 * layers + 1} per token)"))
        elif "peer" not in r:
            rows.append((f"{mode} all-reduce", "unavailable here: the run used NCCL (see the warning)"))
        else:
            rows.append((f"{mode} all-reduce 8 KB, in a graph", f"{r['peer'] * 1e6:.1f} us"))
            if "peer_norm" in r:
                rows.append((f"{mode} all-reduce + add + RMSNorm, in a graph", f"{r['peer_norm'] * 1e6:.1f} us"))
            for w, (t_add, t_norm) in r.get("sweep", {}).items():
                rows.append((f"{mode} push kernel, {w} warps: + add / + add + RMSNorm",
                             f"{t_add * 1e6:.1f} / {t_norm * 1e6:.1f} us"))
    print("\n" + "\n".join(f"{k:44s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
