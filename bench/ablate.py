"""What each kernel costs a decode step: batch-1 decode with kernels left out, on one GPU.

Under programmatic dependent launch a kernel's share of the step is not its duration: the GEMV
after a run of small kernels asks L2 for its weights while they run, and two kernels' tails and
heads overlap. So the profile's per-kernel times (taken with plain launches) do not say what
fusing a kernel away would save. This does: each variant skips the launches of the named kernels
while the decode graph is captured (the step's outputs are then wrong; only its time is read),
and the step is timed against the full one in interleaved rounds.

    python bench/ablate.py --quant fp8 --out /dev/shm/abl \\
        --skip quant=_quant_tile_kernel --skip rope=rope_qkv_write_kernel --skip small=ALL_BUT_GEMV

A kernel is named by its function (``_qgemv_kernel``, ``decode_split_kernel``...), optionally with
constexprs it must be launched with (``_qgemv_kernel:K=14336``: the down projection's GEMV); ``--list``
prints the kernels a 16-token prefill and one captured step launch, with counts. ``ALL_BUT_GEMV``
skips every kernel but the GEMVs (the step's weight streaming alone), ``ONLY_GEMV`` the GEMVs.
``--set name=module.attr=value,...`` adds a variant that patches module attributes instead, as
``bench/decode_ab.py`` does (the artifact holds every variant's kernels).

MoE models: a skipped kernel leaves its output stale or non-finite, and NaN router logits send all
k pairs to one expert, whose rows then hit in L2 (the experts' loads, most of the step, would look
cheap): measured so on the H200, skipping the attention "saved" 12.4 us a layer with the real router
and 3.9 with this fix. So in every variant of a MoE model the batch-1 router's outputs are replaced
by fixed ids (k distinct random experts a layer) and equal weights; its kernel still runs.
Run-to-run spread: on the H200 one variant's median of three rounds moved by 7% between two calls
(the full step by 1.5%), so a difference of a few percent needs repeating before it is believed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mxc  # noqa: E402
from decode import bench_generate, copy_bandwidth, cuda_time  # noqa: E402
from decode_ab import parse_variant, patched, recording_all  # noqa: E402

HERE = Path(__file__).parent
GEMVS = {"_gemv_kernel", "_qgemv_kernel", "_splitk_reduce_kernel", "_qgemv_reduce_kernel"}  # with split-K sums


def kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def matches(entry: str, name: str, constexprs: dict) -> bool:
    """``entry`` is a kernel name, optionally with constexprs that must match: ``_qgemv_kernel:K=14336``."""
    kname, *conds = entry.split(":")
    return kname == name and all(str(constexprs.get(c.partition("=")[0])) == c.partition("=")[2] for c in conds)


@contextmanager
def fixed_routing(layers: int, experts: int, k: int, device):
    """The batch-1 router's outputs replaced by fixed ids (k distinct random experts a layer) and equal
    weights: its kernel still runs, but a skipped kernel's stale or non-finite values can no longer
    steer the experts' loads (NaN logits route every pair to one expert, whose rows then hit in L2)."""
    from mxc.kernels import triton_route

    g = torch.Generator().manual_seed(0)
    ids = [torch.randperm(experts, generator=g)[:k].view(1, k).to(device) for _ in range(layers)]
    original = triton_route.add_rms_norm_route
    calls = [0]

    def route(*args, **kwargs):
        s, h, weights, _ = original(*args, **kwargs)
        layer_ids = ids[calls[0] % layers]
        calls[0] += 1
        return s, h, torch.full_like(weights, 1.0 / k), layer_ids.expand(weights.shape[0], k)

    triton_route.add_rms_norm_route = route
    try:
        yield
    finally:
        triton_route.add_rms_norm_route = original


GROUPS = {"ALL_BUT_GEMV", "ONLY_GEMV"}


@contextmanager
def skipping(launcher, skip: set[str], seen: Counter | None = None, matched: set | None = None):
    """Launches through ``launcher`` of kernels named in ``skip`` do nothing inside this block
    (``ALL_BUT_GEMV`` / ``ONLY_GEMV`` as in the module doc); ``seen`` counts every launch by name,
    ``matched`` collects the entries of ``skip`` that matched a launch."""
    call = type(launcher).__call__

    def maybe(self, kernel, grid, args, constexprs, num_warps, num_stages):
        name = kernel_name(kernel)
        if seen is not None:
            seen[name] += 1
        gemv = name in GEMVS
        hits = [e for e in skip if e not in GROUPS and matches(e, name, constexprs)]
        if matched is not None:
            matched.update(hits)
        if hits or ("ALL_BUT_GEMV" in skip and not gemv) or ("ONLY_GEMV" in skip and gemv):
            return
        call(self, kernel, grid, args, constexprs, num_warps, num_stages)

    type(launcher).__call__ = maybe
    try:
        yield
    finally:
        type(launcher).__call__ = call


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-ablate")
    p.add_argument("--config", default=str(HERE / "llama3_8b.json"))
    p.add_argument("--quant", choices=["fp8"])
    p.add_argument("--max-seq-len", type=int, default=2049)
    p.add_argument("--skip", action="append", default=[], help="name=kernel+kernel+... (repeatable)")
    p.add_argument("--set", action="append", default=[],
                   help="name=module.attr=value,... : a variant that patches module attributes instead (as "
                        "bench/decode_ab.py; the artifact is built under every one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--list", action="store_true", help="print the kernels one decode step launches")
    p.add_argument("--replay", action="store_true", help="also time the full step as bare graph replays")
    args = p.parse_args()
    variants = [("full", set(), [])]
    for text in args.skip:
        name, _, kernels = text.partition("=")
        if not name or not kernels:
            p.error(f"--skip {text!r}: expected name=kernel+kernel+...")
        variants.append((name, set(kernels.split("+")), []))
    for text in args.set:
        name, patches = parse_variant(text)
        variants.append((name, set(), patches))
    config = json.loads(Path(args.config).read_text())
    moe = "num_experts" in config or "num_local_experts" in config
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    out = Path(args.out)
    with recording_all([(name, patches) for name, _, patches in variants]):
        mxc.build("llama.yaml", config=args.config, out=out, target="cuda", dtype="bfloat16", quant=args.quant,
                  max_batch=8, max_seq_len=args.max_seq_len, progress=False)
    print(f"build {time.perf_counter() - t0:.0f} s", flush=True)
    model = mxc.load(out, device="cuda", verify=False)
    launcher = model._launcher
    gen = lambda ids, new: model.generate(ids, max_new_tokens=new)  # noqa: E731
    if args.list:
        seen: Counter = Counter()
        model._decoder.drop_graphs()
        with skipping(launcher, set(), seen):
            gen(torch.randint(0, 1000, (1, 16)), 2)  # the prefill, then one step captured
        print("launches in a prefill of 16 tokens + one captured step:")
        for name, n in seen.most_common():
            print(f"  {n:5d}  {name}")
    layers = int(config["num_hidden_layers"])
    routing = (lambda: fixed_routing(layers, config.get("num_experts") or config.get("num_local_experts"),
                                     config["num_experts_per_tok"], "cuda")) if moe else nullcontext
    if moe:
        print("MoE: the router's outputs replaced by fixed random experts in every variant")
    times = {name: [] for name, _, _ in variants}
    for r in range(args.rounds):
        for name, skip, patches in variants:
            model._decoder.drop_graphs()
            matched: set = set()
            with skipping(launcher, skip, matched=matched), patched(patches), routing():
                step = bench_generate(gen, 1, 128, 128)
            if skip - GROUPS - matched:  # a misspelt kernel would time the full step under another name
                sys.exit(f"ablate.py: --skip {name}: {', '.join(sorted(skip - GROUPS - matched))} matched no launch; "
                         f"--list prints the kernels a step launches")
            times[name].append(step)
            print(f"round {r} {name:14s} {step * 1e3:.3f} ms/step", flush=True)
    model._decoder.drop_graphs()
    full = statistics.median(times["full"])
    print(f"\n{'variant':14s} {'ms/step':>8s} {'saved':>8s} {'us/layer':>9s}  skipped")
    for name, skip, patches in variants:
        m = statistics.median(times[name])
        what = "+".join(sorted(skip)) or ",".join(f"{mod}.{attr}={val!r}" for mod, attr, val in patches) or "-"
        print(f"{name:14s} {m * 1e3:8.3f} {(full - m) * 1e3:8.3f} {(full - m) * 1e6 / layers:9.2f}  {what}")
    if args.replay:
        # the full step as graph replays alone: what generate's per-step work between replays (the token,
        # position and cache-slot copies, sampling: eager kernels) adds to it
        with routing():
            gen(torch.randint(0, 1000, (1, 128)), 2)  # a prompt in the cache (greedy: the greedy graph captured)
            dec = model._decoder
            bucket = dec.buckets[1]  # its sampling-path step graph: captured by its first step (the warm-up)
            replay = statistics.median(cuda_time(lambda: [bucket.step(dec) for _ in range(100)]) / 100
                                       for _ in range(5))
        print(f"\nthe full step as graph replays alone: {replay * 1e3:.3f} ms (in generate: {full * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
