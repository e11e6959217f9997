"""Where a decode step's or a prefill's time goes: per-kernel GPU time, and the gaps between kernels.

``profile_decode(model)`` replays the captured decode graph of a batch bucket under
torch.profiler and returns a table: kernel name, calls per step, microseconds
per step, share of the step; the last lines compare the sum of kernel time
with the step's wall time (the difference is launch gaps inside the graph).
Kernels built for programmatic dependent launch overlap their neighbours, and a
kernel's time then includes its wait for the one ahead (on the H200 the sum
came to 140% of the step): by default the step is re-captured with the same
cubins launched plainly for the profile, and the PDL graph restored after.
``profile_prefill(model, tokens)`` does the same for one eager prefill of
``tokens`` tokens (one sequence, the LM head on its last row).
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def plain_launches(model):
    """The model's PDL cubins launched without the PDL attribute (no overlap), graphs re-captured;
    re-captured again as built afterwards. A no-op for artifacts without PDL."""
    launcher = model._launcher
    if not getattr(launcher, "pdl", False):
        yield
        return
    model._decoder.drop_graphs()
    try:
        with launcher.plain():
            yield
    finally:
        model._decoder.drop_graphs()


def profile_decode(model, steps: int = 10, prompt: int = 128, batch: int = 1, plain: bool = True) -> str:
    if plain:
        with plain_launches(model):
            return "(kernels launched without PDL, so that their times do not overlap)\n" + \
                profile_decode(model, steps, prompt, batch, plain=False)
    dec = model._decoder
    model.generate(torch.randint(0, 1000, (batch, prompt)), max_new_tokens=4)  # fills the cache, captures the bucket
    bucket = dec.buckets[batch]
    for _ in range(3):
        bucket.step(dec)
    return _timed_profile(lambda: bucket.step(dec), steps, "step (graph replay, CUDA events)")


def timeline_decode(model, steps: int = 5, prompt: int = 128, batch: int = 1, dump: str | None = None) -> str:
    """One layer of the decode step as run: the PDL graph replayed under torch.profiler, kernels in
    launch order, the step's layers folded onto the layer's kernel sequence. Per position: median over
    layers and steps of its start after the previous kernel's end (negative: it started earlier, under
    PDL), its span, and the time it adds to the step (its end after the previous kernel's end).
    ``dump``: a JSON file for the raw (start, end, name) list."""
    from torch.profiler import ProfilerActivity, profile

    dec = model._decoder
    model.generate(torch.randint(0, 1000, (batch, prompt)), max_new_tokens=4)
    bucket = dec.buckets[batch]
    for _ in range(3):
        bucket.step(dec)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            bucket.step(dec)
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[1])
    if dump:
        Path(dump).write_text(json.dumps(kernels))
    return layer_table(kernels)


def layer_table(kernels: list) -> str:
    """``timeline_decode``'s table from (start, end, name) kernels in launch order: sorted by end, since under
    PDL a kernel may start before the one ahead of it does, but each waits for it before it ends."""
    from statistics import median

    names = [k[2] for k in kernels]
    n = len(names)
    lo, hi = n // 8, n - n // 8

    # the layer's period: the step's first and last kernels break the pattern once a step, so the step's own
    # period matches best; take the shortest period that matches at least 80% and no worse than its double
    share = {p: sum(names[i] == names[i + p] for i in range(lo, hi - p)) / max(1, hi - p - lo) for p in range(2, 128)}
    period = next((p for p in range(2, 64) if share[p] >= 0.8 and share[p] >= share[2 * p]), None)
    if period is None:
        return "timeline: no repeating layer found"
    pattern = names[lo:lo + period]
    rows = [[] for _ in range(period)]
    phase, prev_in_layer = 0, False
    for i in range(lo + 1, hi):  # the step's other kernels (embedding, LM head, sampling) are skipped
        if names[i] != pattern[(phase + 1) % period]:
            prev_in_layer = False
            continue
        phase = (phase + 1) % period
        if prev_in_layer:
            prev_end = kernels[i - 1][1]
            start, end, _ = kernels[i]
            rows[phase].append((start - prev_end, end - start, end - prev_end))
        prev_in_layer = True
    lines = [f"{'kernel (one layer, launch order)':48s} {'start':>7s} {'span':>7s} {'adds':>7s}   us"]
    total = 0.0
    for j in range(period):
        gap, span, adds = (median(r[k] for r in rows[j]) for k in range(3))
        total += adds
        lines.append(f"{pattern[j][:48]:48s} {gap:7.2f} {span:7.2f} {adds:7.2f}")
    lines.append(f"{'layer':48s} {'':7s} {'':7s} {total:7.2f}")
    return "\n".join(lines)


def profile_prefill(model, tokens: int = 2048, reps: int = 3) -> str:
    """Per-kernel breakdown of one prefill of ``tokens`` tokens, its kernels launched without PDL."""
    from contextlib import nullcontext

    launcher = model._launcher
    ids = torch.randint(0, 1000, (1, tokens))
    with launcher.plain() if getattr(launcher, "pdl", False) else nullcontext():
        model.generate(ids, max_new_tokens=1)  # warm-up
        return _timed_profile(lambda: model.generate(ids, max_new_tokens=1), reps, "prefill (CUDA events)")


def _timed_profile(fn, reps: int, wall_label: str) -> str:
    """Time ``reps`` calls of ``fn`` with CUDA events, then profile ``reps`` more: the per-kernel table."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return _table(prof, reps, wall_us, wall_label)


def _table(prof, reps: int, wall_us: float, wall_label: str) -> str:
    """Kernel name, calls, microseconds and share of ``wall_us`` per repetition, heaviest first."""
    per_kernel = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name][0] += 1
            per_kernel[evt.name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for _, v in rows) / reps
    lines = [f"{'kernel':60s} {'calls':>6s} {'us/step':>9s} {'share':>6s}"]
    for name, (calls, us) in rows[:20]:
        lines.append(f"{name[:60]:60s} {calls // reps:6d} {us / reps:9.1f} {us / reps / wall_us * 100:5.1f}%")
    lines.append(f"{'sum of kernel time':60s} {'':6s} {total:9.1f} {total / wall_us * 100:5.1f}%")
    lines.append(f"{wall_label:60s} {'':6s} {wall_us:9.1f} 100.0%")
    lines.append(f"{'gaps between kernels':60s} {'':6s} {wall_us - total:9.1f} {(wall_us - total) / wall_us * 100:5.1f}%")
    return "\n".join(lines)
