"""A/B of runtime choices in one artifact: batch-1 decode under variants, interleaved, on one GPU.

Some choices are made by a kernel wrapper each time it launches (which quantize kernel, which
config), so one artifact can hold every variant's kernels: the build here records the launches
under each variant (``aot.record`` wrapped) and compiles their union. Then each round times every
variant's decode (graphs dropped, module attributes patched, graphs re-captured: the patch is
active while the step is captured) in turn, so machine drift hits all variants alike.

    python bench/decode_ab.py --quant fp8 --out /dev/shm/ab \\
        --variant old=mxc.kernels.triton_fp8_quant.TILED_MIN_M=33,mxc.kernels.triton_fp8_quant.SILU_KERNEL_MAX_M=0 \\
        --variant new= [--bf16] [--profile new]

``--bf16`` also builds and times the bf16 artifact of the same config under each variant (the fp8 / bf16
ratio of issue #5 measured in the same run). ``--prefill N`` also times, each round and variant, a prefill of N
tokens (median of ``--prefill-reps`` after a warm-up; ``--prefill-only`` skips the decode steps): prefill figures
move between machines by more than most changes, so a prefill choice is judged within one call;
``--profile-prefill`` adds each variant's per-kernel breakdown of it. ``--timeline a,b`` prints, for those
variants, one layer's kernels as the PDL graph runs them (``profile_step.timeline_decode``: each kernel's start
against the previous one's end, its span, and the time it adds to the step), and writes the raw kernel list to
``$OUT/timeline_<variant>.json`` on the device machine. ``--batch 1,8`` times each batch size every round in the
one artifact. Prints ms/step per round and the median per variant (and batch).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mxc  # noqa: E402
from decode import bench_generate, copy_bandwidth, cuda_time, weight_bytes  # noqa: E402

HERE = Path(__file__).parent


def parse_variant(text: str) -> tuple[str, list[tuple[str, str, object]]]:
    """``name=module.attr=value,module.attr=value`` -> (name, [(module, attr, value)])."""
    name, _, rest = text.partition("=")
    patches = []
    for item in [p for p in re.split(r",(?=[\w.]+=)", rest) if p]:  # a value may hold commas
        target, _, value = item.partition("=")
        module, _, attr = target.rpartition(".")
        patches.append((module, attr, ast.literal_eval(value)))
    return name, patches


@contextmanager
def patched(patches):
    saved = []
    try:
        for module, attr, value in patches:
            mod = importlib.import_module(module)
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


@contextmanager
def recording_all(variants):
    """Builds inside record every variant's launches."""
    from mxc.codegen import aot

    original = aot.record

    def record(*args, **kwargs):
        specs = {}
        for _, patches in variants:
            with patched(patches):
                specs.update(original(*args, **kwargs))
        return specs

    aot.record = record
    try:
        yield
    finally:
        aot.record = original


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-ab")
    p.add_argument("--config", default=str(HERE / "llama3_8b.json"))
    p.add_argument("--quant", choices=["fp8"])
    p.add_argument("--quant-granularity", choices=["channel", "tensor", "block128"],
                   help="with --quant fp8 (the build's default: channel)")
    p.add_argument("--mlp-pair", action="store_true",
                   help="build with --mlp-pair (variants may set mxc.kernels.cuda_ops.MLP_PAIR=False for the chain)")
    p.add_argument("--variant", action="append", default=[], help="name=module.attr=value,... (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", default="1", help="decode batch sizes, comma-separated (each timed every round in "
                                                "one artifact; --profile and --timeline take the first)")
    p.add_argument("--bf16", action="store_true", help="also time the bf16 artifact (for the fp8 / bf16 ratio)")
    p.add_argument("--profile", default="", help="variant to print a per-kernel breakdown of (plain launches)")
    p.add_argument("--timeline", default="", help="variants (comma-separated) to print one layer's kernel timeline "
                   "of, under PDL as run")
    p.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many tokens per variant")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefills a round and variant (median)")
    p.add_argument("--prefill-only", action="store_true", help="with --prefill: time no decode step")
    p.add_argument("--profile-prefill", action="store_true",
                   help="with --prefill: a per-kernel breakdown of the prefill under each variant (plain launches)")
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError(args.batch)
    except ValueError:
        p.error(f"--batch {args.batch}: expected positive integers, comma-separated (1 or 1,8)")
    try:
        variants = [parse_variant(v) for v in args.variant] or [("default", [])]
        for _, patches in variants:
            for module, attr, _ in patches:
                getattr(importlib.import_module(module), attr)
    except (ValueError, SyntaxError, ImportError, AttributeError) as e:
        p.error(f"--variant: expected name=module.attr=python_literal,...: {type(e).__name__}: {e}")
    if args.prefill_only and not args.prefill:
        p.error("--prefill-only needs --prefill N")
    if args.profile and args.profile not in dict(variants):
        p.error(f"--profile {args.profile}: not one of the variants {sorted(dict(variants))}")
    unknown = [t for t in args.timeline.split(",") if t and t not in dict(variants)]
    if unknown:
        p.error(f"--timeline {unknown[0]}: not one of the variants {sorted(dict(variants))}")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    common = dict(config=args.config, target="cuda", dtype="bfloat16", max_batch=max(8, *batches),
                  max_seq_len=max(2049, args.prefill + 1), progress=False)
    out = Path(args.out)
    t0 = time.perf_counter()
    with recording_all(variants):
        mxc.build("llama.yaml", out=out, quant=args.quant, quant_granularity=args.quant_granularity,
                  mlp_pair=args.mlp_pair, **common)
    print(f"build {time.perf_counter() - t0:.0f} s", flush=True)
    model = mxc.load(out, device="cuda", verify=False)
    manifest = json.loads((out / "manifest.json").read_text())
    nbytes = {b: weight_bytes(manifest, out, batch=b)[0] for b in batches}  # a MoE step reads more experts a batch
    gen = lambda ids, new: model.generate(ids, max_new_tokens=new)  # noqa: E731
    times = {(name, b): [] for name, _ in variants for b in batches}
    prefills = {name: [] for name, _ in variants}
    prompt = torch.randint(0, 1000, (1, args.prefill))
    for r in range(args.rounds):
        for b in batches:
            for name, patches in variants:
                model._decoder.drop_graphs()
                with patched(patches):
                    step = float("nan") if args.prefill_only else bench_generate(gen, b, 128, 128)
                    pre = (cuda_time(lambda: model.generate(prompt, max_new_tokens=1), reps=args.prefill_reps)
                           if args.prefill and b == batches[0] else None)
                times[name, b].append(step)
                if pre is not None:
                    prefills[name].append(pre)
                print(f"round {r} {label(name, b, batches):16s} {step * 1e3:.3f} ms/step  "
                      f"{nbytes[b] / step / bw * 100:.0f}% of copy BW"
                      + (f"  prefill {args.prefill}: {pre * 1e3:.2f} ms" if pre is not None else ""), flush=True)
    if args.profile:
        from profile_step import profile_decode

        model._decoder.drop_graphs()
        with patched(dict(variants)[args.profile]):
            print(f"\nper-kernel breakdown, {args.profile}:\n" + profile_decode(model, batch=batches[0]), flush=True)
    for name in [t for t in args.timeline.split(",") if t]:
        from profile_step import timeline_decode

        model._decoder.drop_graphs()
        with patched(dict(variants)[name]):
            print(f"\none layer's kernels as run (PDL graph), {name}:\n" + timeline_decode(
                model, batch=batches[0],
                dump=f"{os.environ['OUT']}/timeline_{name}.json" if "OUT" in os.environ else None),
                  flush=True)
    if args.profile_prefill:
        from profile_step import profile_prefill

        for name, patches in variants:
            with patched(patches):
                print(f"\nper-kernel breakdown of a {args.prefill}-token prefill (plain launches), {name}:\n"
                      + profile_prefill(model, args.prefill), flush=True)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    bf16_by = {}
    if args.bf16:
        del model
        torch.cuda.empty_cache()
        with recording_all(variants):  # every variant's kernels, as for the first artifact
            mxc.build("llama.yaml", out=f"{out}-bf16", **common)
        model = mxc.load(f"{out}-bf16", device="cuda", verify=False)
        gen = lambda ids, new: model.generate(ids, max_new_tokens=new)  # noqa: E731
        bf16_times = {key: [] for key in times}
        for _ in range(args.rounds):
            for b in batches:
                for name, patches in variants:  # each variant's bf16 step too: a runtime choice changes both
                    model._decoder.drop_graphs()
                    with patched(patches):
                        bf16_times[name, b].append(bench_generate(gen, b, 128, 128))
        bf16_by = {key: statistics.median(ts) for key, ts in bf16_times.items()}
    print()
    for (name, b), m in med.items():
        ratio = (f"  bf16 {bf16_by[name, b] * 1e3:.3f} ms, bf16 / this {bf16_by[name, b] / m:.2f}x"
                 if bf16_by else "")
        print(f"{label(name, b, batches):16s} median {m * 1e3:.3f} ms/step "
              f"(rounds: {', '.join(f'{t * 1e3:.3f}' for t in times[name, b])}){ratio}")
        if prefills[name] and b == batches[0]:
            print(f"{'':16s} prefill {args.prefill}: median {statistics.median(prefills[name]) * 1e3:.2f} ms "
                  f"(rounds: {', '.join(f'{t * 1e3:.2f}' for t in prefills[name])})")
    for b in batches if bf16_by else []:
        print(f"{label('bf16', b, batches):16s} median {bf16_by[variants[0][0], b] * 1e3:.3f} ms/step "
              f"({variants[0][0]})")


def label(name: str, batch: int, batches: list[int]) -> str:
    """A variant's name in the printout, with its batch where several are timed."""
    return name if len(batches) == 1 else f"{name} b{batch}"

if __name__ == "__main__":
    main()
