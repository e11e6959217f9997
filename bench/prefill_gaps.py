"""Where the fp8 prefill's time between kernels goes, and how much of its time the GPU's clock sets.

The plain-launch profiles leave 1.6-2.6 ms of a 2048-token fp8 prefill (30 ms) outside every kernel, and
``bench/prefill_host.py`` showed the host enqueues the forward in half the GPU's time. This script builds (or
reuses) a Llama-3-8B-shaped ``--quant fp8`` artifact and, for one prompt of ``--tokens`` tokens, times with
CUDA events (medians of ``--reps``), with PDL launches and plain:

- ``generate(max_new_tokens=1)`` (what ``bench/decode.py`` reports), the runtime's prefill alone, the prefill
  enqueued behind a 20 ms GPU sleep (the sleep's time subtracted; the host's start-up work hidden, but the
  clock also recovers during the sleep: see ``--power``) and the forward captured in a CUDA graph and replayed
  (no launch work at all);
- under torch.profiler, the idle intervals between consecutive kernels summed by the pair of kernels around
  them (a prefix of each name; any name with "cutlass" in it, cuBLAS's included, reads ``cutlass_gemm``), the
  largest first; ``--trace-dir``: also each mode's host and GPU timeline (Chrome JSON; ``--stacks`` adds Python
  stacks, which inflate the host's times several-fold; the profiler's own buffer requests show up as host time);
- ``--lead-in``: where the host's time goes before the prefill's first kernel (host clock marks at the call, the
  context's copy and the embedding's launch, medians of ``--reps``; no profiler), and ``ForwardContext.build``'s
  steps against a pageable buffer and a kept pinned one;
- ``--host-wait N``: ``generate(max_new_tokens=1)`` in N interleaved rounds, its wait for the prefill's token
  made two ways: as shipped (the copy to the host blocks in the driver) and spinning on an event in Python
  first (the host thread never sleeps); with the forward's CUDA graph replay as the no-host bound. With
  ``MXC_LAB_SCHED`` = spin, yield or blocking the process's CUDA context is created with that wait policy
  (``cuDevicePrimaryCtxSetFlags`` before torch starts CUDA; unset: the driver's automatic choice);
- ``--bucket-ab N``: ``generate(max_new_tokens=1)`` of prompts of ``--lengths`` tokens in N interleaved rounds,
  eager against the runtime's prompt-bucket CUDA graph (the artifact built with ``--prefill-graphs --tokens``,
  buckets every 256 tokens past 512): what a graph saves at a bucket's length and what padding costs below it;
- ``--replay-ab N``: why the runtime's bucket graph (29.4 ms at 2048 tokens, thirty-third run) read slower than
  this script's own capture of the forward (25.4): N rounds, each timing one call of every variant in turn
  (the GPU's clock drifts alike for all), the runtime's bucket graph replayed alone and through its ``run``
  (input refill and prompt copy), this script's one-sequence capture, the same context captured as the runtime
  captures (side-stream warm-ups, the decoder's pool), the two-sequence padded context captured this script's
  way, and ``generate(max_new_tokens=1)``; then one profile of each graph's replay, kernels summed by name;
- ``--power`` first: the 8192^3 ``torch._scaled_mm`` rate as a burst, timed as the prefill is and after 2 s of
  load, and the prefill and its graph back to back and after 200 ms of idle GPU.

Usage: python bench/prefill_gaps.py [--out DIR] [--tokens 2048] [--reuse] [--reps 7] [--power] [--lead-in]
       [--trace-dir DIR [--stacks]] [--host-wait ROUNDS] [--bucket-ab ROUNDS --lengths L,...]
       [--replay-ab ROUNDS]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import after_idle_time, cuda_time, fp8_gemm_rate, fp8_gemm_rate_as_timed  # noqa: E402
from prefill_host import fp8_prefill_model  # noqa: E402

from mxc.kernels import launch  # noqa: E402
from mxc.kernels.context import ForwardContext  # noqa: E402
from mxc.runtime_buckets import prefill_graph_bucket  # noqa: E402


def events_ms(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls timed with CUDA events (a warm-up first)."""
    return cuda_time(fn, warmup=1, reps=reps) * 1e3


def short(name: str) -> str:
    for key in ("cutlass", "nvjet", "gemm", "Gemm"):
        if key in name:
            return "cutlass_gemm" if "cutlass" in name or "Gemm" in name else name[:28]
    return name.split("(")[0][:28]


def idle_table(fn, top: int = 14, trace: Path | None = None, stacks: bool = False) -> str:
    """Profile one call of ``fn``: its kernels in start order, the idle time before each one (from the end
    of the latest-ending kernel before it), summed by (previous, next) kernel. ``trace``: also write the
    host and GPU timeline there (Chrome trace JSON: which host call launched each kernel, and when)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=acts, with_stack=bool(trace) and stacks) as prof:
        fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(trace))
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    pairs = defaultdict(list)
    busy_end, prev = None, None
    overlap = 0.0
    for start, end, name in kernels:
        if busy_end is not None:
            gap = start - busy_end
            if gap >= 0:
                pairs[(short(prev), short(name))].append(gap)
            else:
                overlap -= gap
        busy_end = end if busy_end is None else max(busy_end, end)
        prev = name
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    busy = sum(e - s for s, e, _ in kernels) / 1e3
    idle = sum(sum(v) for v in pairs.values()) / 1e3
    lines = [f"  {len(kernels)} kernels over {span:.2f} ms (first start to last end): kernel time {busy:.2f} ms, "
             f"idle between kernels {idle:.2f} ms, overlapping {overlap / 1e3:.2f} ms",
             f"  {'previous kernel':30s} {'next kernel':30s} {'count':>6s} {'idle us':>9s} {'median':>7s}"]
    for (a, b), gaps in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {a:30s} {b:30s} {len(gaps):6d} {sum(gaps):9.1f} {statistics.median(gaps):7.2f}")
    return "\n".join(lines)


def lead_in(forward, reps: int) -> str:
    """Host microseconds from ``forward()``'s call to: ``ForwardContext.build`` entered, its host arrays made, its
    copy enqueued and its return, the embedding's wrapper entered and returned (its kernel enqueued), and the
    call's return (the first call of a model's ``generate`` also copies the prompt: the first marks), and
    the GPU's time from an event recorded before the call to the call's end. Medians of ``reps`` calls, each
    after the GPU is idle (as a prompt arrives). No profiler: host clock marks in patched wrappers."""
    import time

    from mxc.kernels import context, triton_elementwise

    marks: dict[str, float] = {}
    build, embed = ForwardContext.build.__func__, triton_elementwise.embedding
    arrays, copy = context.host_arrays, context.to_device

    def marked(fn, before: str, after: str):
        def call(*a, **k):
            marks.setdefault(before, time.perf_counter())
            out = fn(*a, **k)
            marks.setdefault(after, time.perf_counter())
            return out
        return call

    rows = defaultdict(list)
    ForwardContext.build = classmethod(marked(build, "context build entered", "context built"))
    context.host_arrays = marked(arrays, "host arrays entered", "host arrays made")
    context.to_device = marked(copy, "to_device entered", "copy enqueued")
    triton_elementwise.embedding = marked(embed, "embedding entered", "embedding launched")
    try:
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            marks.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            forward()
            marks["forward returned"] = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            for name, t in sorted(marks.items(), key=lambda kv: kv[1]):
                rows[name].append((t - t0) * 1e6)
            rows["GPU: call to end (ms)"].append(start.elapsed_time(end))
    finally:
        ForwardContext.build, triton_elementwise.embedding = classmethod(build), embed
        context.host_arrays, context.to_device = arrays, copy
    lines = ["  host us after the call (medians; first call dropped):"]
    for name, ts in rows.items():
        lines.append(f"    {name:28s} {statistics.median(ts[1:]):10.1f}")
    return "\n".join(lines)


def context_pieces(d, s: int, reps: int) -> str:
    """Host microseconds of each step of ``ForwardContext.build`` for one ``s``-token prompt (medians of ``reps``,
    each after the GPU is idle): the numpy arrays, the pinned staging buffer, its fill, the copy's enqueue, the
    views, the dataclass; and the staging buffer's alternatives: pageable memory, one pinned buffer kept."""
    import time

    from mxc.kernels import context as C

    rows = defaultdict(list)
    kept = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        arrays = C.host_arrays([s], [0], [0], d.max_len)
        t.append(time.perf_counter())
        offsets, size = C._packing(arrays.values())
        stage = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        t.append(time.perf_counter())
        host = stage.numpy()
        for a, off in zip(arrays.values(), offsets):
            host[off:off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        t.append(time.perf_counter())
        dev = stage.to(d.device, non_blocking=True)
        t.append(time.perf_counter())
        views = C._views(dev, arrays.values(), offsets)
        t.append(time.perf_counter())
        tensors = dict(zip(arrays, views))
        C.ForwardContext([s], [0], [0], d.k_cache, d.v_cache, cache_loc=tensors["cache_loc"],
                         kv_lens=tensors["kv_lens"], slots_t=tensors["slots"], q_start=tensors["q_start"], max_q_len=s,
                         positions=tensors["positions"], last_rows=tensors["last_rows"])
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t2 = [time.perf_counter()]
        pageable = torch.empty(size, dtype=torch.uint8)
        pageable.numpy()[:] = host
        pageable.to(d.device, non_blocking=True)
        t2.append(time.perf_counter())
        torch.cuda.synchronize()
        t2.append(time.perf_counter())
        kept.numpy()[:size] = host
        kept[:size].to(d.device, non_blocking=True)
        t2.append(time.perf_counter())
        names = ["numpy arrays", "pinned torch.empty", "fill", "copy enqueued (.to)", "views", "ForwardContext()"]
        for name, a, b in zip(names, t, t[1:]):
            rows[name].append((b - a) * 1e6)
        rows["pageable: alloc + fill + copy"].append((t2[1] - t2[0]) * 1e6)
        rows["kept pinned: fill + copy"].append((t2[3] - t2[2]) * 1e6)
    lines = [f"  ForwardContext.build's steps, {s} tokens, host us (medians; first call dropped):"]
    for name, ts in rows.items():
        lines.append(f"    {name:32s} {statistics.median(ts[1:]):8.1f}")
    return "\n".join(lines)


def power_check(forward, replay, tokens: int) -> None:
    """Is the prefill's time set by the GPU's clock under sustained load? ``bench/decode.py`` times the
    prefill over four back-to-back calls (~120 ms) and ``torch._scaled_mm``'s 8192^3 rate over 13 short
    calls (~10 ms, from an idle GPU). Here, each measured both ways: the 8192^3 GEMM in that burst, in groups
    as long as a prefill timed as the prefill is, and after 2 s of back-to-back calls; the prefill and its
    CUDA graph back to back and each call after 200 ms of idle GPU (a sleep kernel: the clock recovers)."""
    import time

    time.sleep(1.0)
    burst = fp8_gemm_rate()
    matched = fp8_gemm_rate_as_timed(cuda_time(forward))
    hot = fp8_gemm_rate_as_timed(2.0)  # one 2 s group a call: the rate after seconds of load
    print(f"_scaled_mm 8192^3: burst (bench/decode.py's method) {burst / 1e12:.0f} TFLOP/s, in groups as long as "
          f"a prefill timed as the prefill {matched / 1e12:.0f}, in 2 s groups {hot / 1e12:.0f}", flush=True)
    for name, fn in (("forward", forward), ("its CUDA graph", replay)):
        time.sleep(1.0)
        warm = cuda_time(fn)
        cold = after_idle_time(fn)
        print(f"{tokens}-token prefill, {name}: back to back (bench/decode.py's method) {warm * 1e3:.2f} ms, after "
              f"200 ms idle {cold * 1e3:.2f} ms (median of 5; the host enqueues during the sleep)", flush=True)


def captured(model, ids, positions, rows):
    """The forward of ``ids`` captured in a CUDA graph (its context's tensors built outside the capture)."""
    d = model._decoder
    ctx = ForwardContext.build([len(ids)], [0], [0], d.k_cache, d.v_cache, model.device, **model._dist)
    ctx.rope_tables = d.rope_tables
    model._run(ctx, ids, positions, rows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model._run(ctx, ids, positions, rows)
    return graph


def set_context_wait(policy: str) -> None:
    """Create the primary context with this wait policy (before torch touches CUDA)."""
    flags = {"spin": 1, "yield": 2, "blocking": 4}[policy]  # CU_CTX_SCHED_SPIN / _YIELD / _BLOCKING_SYNC
    lib = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    code = lib.cuDevicePrimaryCtxSetFlags(dev, flags)
    print(f"CUDA context wait policy: {policy} (cuDevicePrimaryCtxSetFlags -> {code})", flush=True)


def host_wait(model, generate, replay, rounds: int, reps: int) -> None:
    """``--host-wait``: see the module docstring."""
    d = model._decoder
    shipped = type(d).generate

    def spinning(self, *a, **k):
        out = shipped(self, *a, **k)
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            pass
        return out

    times = defaultdict(list)
    try:
        for r in range(rounds):
            for name in ("shipped wait", "event spin", "graph replay"):
                type(d).generate = spinning if name == "event spin" else shipped
                times[name].append(events_ms(replay if name == "graph replay" else generate, reps))
            print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()) + " ms", flush=True)
    finally:
        type(d).generate = shipped
    print("host wait, medians of the rounds: " + ", ".join(f"{n} {statistics.median(t):.2f} ms"
                                                           for n, t in times.items()), flush=True)


def bucket_ab(model, lengths: list[int], rounds: int, reps: int) -> None:
    """``--bucket-ab``: see the module docstring."""
    d = model._decoder
    graph_tokens = d.prefill_graph_tokens
    prompts = {s: torch.randint(0, 1000, (1, s)) for s in lengths}
    times = defaultdict(list)
    try:
        for r in range(rounds):
            for s, ids in prompts.items():
                for mode in ("eager", "bucket graph"):
                    d.prefill_graph_tokens = graph_tokens if mode == "bucket graph" else 0
                    times[(s, mode)].append(events_ms(lambda ids=ids: model.generate(ids, max_new_tokens=1), reps))
            print(f"round {r}: " + ", ".join(f"{s} {m} {t[-1]:.2f}" for (s, m), t in times.items()) + " ms", flush=True)
    finally:
        d.prefill_graph_tokens = graph_tokens
    for s in lengths:
        e, g = statistics.median(times[(s, "eager")]), statistics.median(times[(s, "bucket graph")])
        print(f"{s} tokens (bucket {prefill_graph_bucket(s, graph_tokens, d.max_len)}): eager {e:.2f} ms, bucket graph "
              f"{g:.2f} ms ({e / g:.3f}x), medians of {rounds} rounds", flush=True)


def kernel_sums(fn) -> tuple[dict[str, float], float]:
    """One profiled call of ``fn``: microseconds of kernel time by kernel name, and the span (first start to last
    end) in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    sums = defaultdict(float)
    for start, end, name in kernels:
        sums[short(name)] += end - start
    span = max(k[1] for k in kernels) - min(k[0] for k in kernels) if kernels else 0.0
    return dict(sums), span


def replay_ab(model, s: int, rounds: int) -> None:
    """``--replay-ab``: see the module docstring."""
    from mxc.runtime.graph_capture import capture
    from mxc.runtime_buckets import padded_prefill

    d = model._decoder
    ids = torch.randint(0, 1000, (s,), device="cuda")
    size = prefill_graph_bucket(s, d.prefill_graph_tokens, d.max_len)
    assert size is not None, f"no prompt bucket holds {s} tokens (built with --prefill-graphs {d.prefill_graph_tokens})"
    d.prefill(ids.reshape(1, s))  # captures the bucket's graph
    bucket = d.prefill_graphs[size]
    positions = torch.arange(s, device="cuda")
    rows = torch.tensor([s - 1], device="cuda")
    own = captured(model, ids, positions, rows)

    def runtime_way():  # the one-sequence context, captured as PrefillGraph captures
        ctx = ForwardContext.build([s], [0], [0], d.k_cache, d.v_cache, model.device, **model._dist)
        ctx.rope_tables = d.rope_tables
        return capture(lambda: d.forward(ctx, ids, ctx.positions, rows), d.launcher, d.pool)[0]

    def padded_own_way():  # the bucket's two-sequence context, captured as ``captured`` captures
        seq_lens, past_lens, slots = padded_prefill(s, size, d.scratch_slot)
        ctx = ForwardContext.build(seq_lens, past_lens, slots, d.k_cache, d.v_cache, model.device, **model._dist)
        ctx.rope_tables = d.rope_tables
        tokens = torch.zeros(size, dtype=torch.int64, device="cuda")
        tokens[:s] = ids
        with launch.using(model._launcher):
            model._run(ctx, tokens, ctx.positions, ctx.last_rows[:1])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model._run(ctx, tokens, ctx.positions, ctx.last_rows[:1])
        return graph

    graphs = {"runtime bucket graph": bucket.graph, "own capture": own,
              "one sequence, runtime's capture": runtime_way(), "two sequences, own capture": padded_own_way()}
    ids_cpu = ids.cpu().reshape(1, s)
    calls = {**{name: g.replay for name, g in graphs.items()},
             "bucket run (refill + replay)": lambda: bucket.run(d, ids),
             "generate(1), bucket": lambda: model.generate(ids_cpu, max_new_tokens=1)}
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    times = defaultdict(list)
    for r in range(rounds):
        for name, fn in calls.items():
            times[name].append(events_ms(fn, 1))
        print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()) + " ms", flush=True)
    print(f"{s} tokens (bucket {size}), medians of {rounds} interleaved rounds: "
          + ", ".join(f"{n} {statistics.median(t):.2f} ms" for n, t in times.items()), flush=True)
    profiles = {name: kernel_sums(g.replay) for name, g in graphs.items()}
    names = sorted({k for sums, _ in profiles.values() for k in sums},
                   key=lambda k: -max(sums.get(k, 0.0) for sums, _ in profiles.values()))
    print("kernel time by name, us (one profiled replay each): " + " | ".join(profiles), flush=True)
    for k in names:
        print(f"  {k:30s} " + " ".join(f"{sums.get(k, 0.0):10.1f}" for sums, _ in profiles.values()), flush=True)
    totals = " ".join(f"{sum(sums.values()):10.1f}" for sums, _ in profiles.values())
    print(f"  {'all kernels':30s} {totals}", flush=True)
    print(f"  {'span':30s} " + " ".join(f"{span:10.1f}" for _, span in profiles.values()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-prefill-gaps")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--power", action="store_true", help="first: the GEMM rate and the prefill, burst against sustained")
    p.add_argument("--trace-dir", default="", help="also write each mode's host + GPU timeline (Chrome JSON) here")
    p.add_argument("--stacks", action="store_true", help="with --trace-dir: Python stacks in the timeline")
    p.add_argument("--lead-in", action="store_true", help="the host's time before the first kernel, by clock marks")
    p.add_argument("--host-wait", type=int, default=0, metavar="ROUNDS",
                   help="only: generate(1) with the shipped wait for its token against a spinning one")
    p.add_argument("--bucket-ab", type=int, default=0, metavar="ROUNDS",
                   help="only: generate(1) eager against the runtime's prompt-bucket graph at --lengths")
    p.add_argument("--lengths", default="2048,1793,1900")
    p.add_argument("--replay-ab", type=int, default=0, metavar="ROUNDS",
                   help="only: the runtime's bucket graph against this script's capture, and why they differ")
    args = p.parse_args()
    if os.environ.get("MXC_LAB_SCHED"):
        set_context_wait(os.environ["MXC_LAB_SCHED"])
    model, ids = fp8_prefill_model(Path(args.out), args.tokens, args.reuse,
                                   prefill_graphs=args.tokens if args.bucket_ab or args.replay_ab else None)
    if args.bucket_ab:
        bucket_ab(model, [int(t) for t in args.lengths.split(",")], args.bucket_ab, args.reps)
        return
    if args.replay_ab:
        replay_ab(model, args.tokens, args.replay_ab)
        return
    s = args.tokens
    ids_cpu = ids.cpu().reshape(1, s)
    positions = torch.arange(s, device="cuda")
    rows = torch.tensor([s - 1], device="cuda")
    d = model._decoder
    ids2d = ids.reshape(1, s)

    def forward():  # the prefill of ``generate``, without its sampling and copy to the host
        return d.prefill(ids2d)

    def generate():
        return model.generate(ids_cpu, max_new_tokens=1)

    if args.host_wait:
        graph = captured(model, ids, positions, rows)
        host_wait(model, generate, graph.replay, args.host_wait, args.reps)
        return
    if args.power:
        graph = captured(model, ids, positions, rows)
        power_check(forward, graph.replay, s)
        del graph
    launcher = model._launcher
    for mode in ("pdl", "plain"):
        if mode == "pdl" and not getattr(launcher, "pdl", False):
            continue
        with launcher.plain() if mode == "plain" else nullcontext():
            t_gen = events_ms(generate, args.reps)
            t_fwd = events_ms(forward, args.reps)
            t_graph = None
            try:
                graph = captured(model, ids, positions, rows)
                t_graph = events_ms(graph.replay, args.reps)
                del graph
            except Exception as e:  # a launch that cannot be captured: say so and go on
                print(f"{mode}: the forward could not be captured in a CUDA graph: {str(e).splitlines()[0]}")
            # the forward behind a 20 ms GPU sleep: the host enqueues its start while the GPU is busy
            sleep = lambda: torch.cuda._sleep(40_000_000)  # noqa: E731
            t_sleep = events_ms(sleep, args.reps)
            t_ahead = events_ms(lambda: (sleep(), forward()), args.reps) - t_sleep
            print(f"{mode}: {s}-token fp8 prefill, medians of {args.reps}: generate(max_new_tokens=1) {t_gen:.2f} ms, "
                  f"forward {t_fwd:.2f} ms, forward enqueued behind a GPU sleep {t_ahead:.2f} ms"
                  + (f", forward as a CUDA graph replay {t_graph:.2f} ms" if t_graph else ""), flush=True)
            print(idle_table(forward), flush=True)
            if args.lead_in:
                for name, fn in (("the runtime's prefill", forward), ("generate(max_new_tokens=1)", generate)):
                    print(f"{mode}: {name}\n" + lead_in(fn, args.reps), flush=True)
                print(context_pieces(d, s, args.reps), flush=True)
            if args.trace_dir:
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                idle_table(forward, trace=Path(args.trace_dir) / f"prefill_{mode}.json", stacks=args.stacks)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
