"""Decode and prefill benchmark on one GPU: mxc vs the bandwidth/compute floor and vs Hugging Face.

Builds a Llama-3-8B-shaped artifact with deterministic random bf16 weights
(``bench/llama3_8b.json``, no download), then in the same run measures:
  - the copy bandwidth and the cuBLAS bf16 GEMM rate (the ceilings),
  - mxc decode (prompt 128, 128 new tokens) at batch 1, 8, 32: ms/token,
    weight GB/s and the fraction of the measured copy bandwidth,
  - mxc prefill of 2048 tokens: ms and TFLOP/s against the measured GEMM rate,
  - Hugging Face transformers with a static cache + torch.compile at the same
    shapes (``--hf-batches``), for the ratio,
  - cold kernel-build time and artifact load -> first token time.
Prints a table last. Usage: python bench/decode.py --out DIR [--config FILE] [--hf-batches 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mxc  # noqa: E402
from mxc.runtime.artifact import verify_files  # noqa: E402

HERE = Path(__file__).parent


def event_seconds(fn) -> float:
    """Seconds of one fn() timed with CUDA events (the host waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def cuda_time(fn, warmup=1, reps=3) -> float:
    """Median seconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = sorted(event_seconds(fn) for _ in range(reps))
    return times[len(times) // 2]


def interleaved_graph_us(graphs: dict, rounds: int, reps: int, per: int = 1) -> dict[str, list[float]]:
    """Each round replays every graph once untimed, then ``reps`` times timed (CUDA events); the median us a
    replay divided by ``per`` (layers a replay), for each round, by name. Rounds interleave the graphs, so a
    drift of the GPU's clocks reaches every variant alike; each round is printed as it ends."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for r in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            times[name].append(statistics.median(event_seconds(graph.replay) * 1e6 / per for _ in range(reps)))
        print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()) + " us a layer")
    return times


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), warmup=3, reps=10)
    return 2 * x.numel() * 2 / t


def _fp8_mm(n: int):
    """One ``torch._scaled_mm`` of random n x n e4m3 operands, as a call."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def fp8_gemm_rate(n=8192) -> float:
    return 2 * n**3 / cuda_time(_fp8_mm(n), warmup=3, reps=10)


def fp8_gemm_rate_as_timed(seconds: float, n=8192) -> float:
    """``fp8_gemm_rate``'s GEMM timed as a prefill is (``cuda_time``: a warm-up, then the median of three), each
    timed call a group of back-to-back GEMMs lasting ``seconds`` (one prefill). Under sustained load the GPU's
    power limit lowers its clock (the 13-call burst of ``fp8_gemm_rate`` runs before it does): this is the
    rate under the load a prefill benchmark puts on it."""
    mm = _fp8_mm(n)
    calls = max(1, round(seconds / cuda_time(mm, warmup=3, reps=5)))

    def group():
        for _ in range(calls):  # each output dropped at once: a 2 s group kept every 128 MiB output (out of memory)
            mm()

    return 2 * n**3 * calls / cuda_time(group)


def prefill_gemms(config_path, tokens: int):
    """A call running, with ``torch._scaled_mm`` (e4m3, tensor scales: cuBLASLt), the GEMMs of a ``tokens``-token
    prefill's decoder layers, back to back as the prefill runs them: per layer qkv, o, gate/up (merged) and down
    at M = tokens, each layer its own random weights (so none stay in L2); and their FLOPs. Without the LM head
    (mxc runs it on the last row only) and without the attention, norms and quantizes: the time the prefill's
    linears alone take in cuBLASLt."""
    cfg = json.loads(Path(config_path).read_text())
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv, d = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or h // heads
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]  # (N, K) per linear
    f8 = torch.float8_e4m3fn
    xs = {k: torch.randn(tokens, k, device="cuda").to(f8) for _, k in shapes}
    ws = [[torch.randn(n, k, device="cuda").to(f8) for n, k in shapes] for _ in range(layers)]
    one = torch.ones((), device="cuda")

    def run():
        for layer in ws:
            for w in layer:
                torch._scaled_mm(xs[w.shape[1]], w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return run, 2 * tokens * layers * sum(n * k for n, k in shapes)


def after_idle_time(fn, idle_s=0.2, reps=5) -> float:
    """Median seconds of fn() timed with CUDA events, each call after ``idle_s`` of a sleeping GPU (its clock
    back up, as when a burst is measured; the host enqueues the call's start meanwhile)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(int(idle_s * 2e9))  # cycles, ~2 GHz
        times.append(event_seconds(fn))
    return sorted(times)[len(times) // 2]


def gemm_rate(n=8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: a @ b, warmup=3, reps=10)
    return 2 * n**3 / t


def weight_bytes(manifest: dict, art: Path, batch: int = 1) -> tuple[int, int]:
    """(bytes a ``batch``-token decode step reads = all weights but the embedding table, with only the experts a MoE
    model's tokens pick of its stacked experts (``.we_`` tensors): k / E of them at one token, and at ``batch``
    tokens the expected share that uniform routing touches, 1 - (1 - k / E) ** batch; linear params for FLOPs)."""
    from safetensors import safe_open

    size = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
    cfg = manifest.get("config", {})
    active = 1.0
    if cfg.get("num_experts"):
        active = 1 - (1 - cfg.get("num_experts_per_tok", 1) / cfg["num_experts"]) ** batch
    total, linear = 0, 0
    with safe_open(art / "weights" / "rank0.safetensors", "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            shape = sl.get_shape()
            n = 1
            for d in shape:
                n *= d
            if name == "embed":
                continue
            total += n * size[sl.get_dtype()] * (active if ".we_" in name else 1)
            if len(shape) == 2 and not name.endswith("_scale"):
                linear += n
    return int(total), linear


def executed_prefill_flops(config_path, nlinear: int, tokens: int) -> int:
    """FLOPs a prefill of one ``tokens``-token sequence executes: every linear over every row but the LM head,
    which runs on the last row only, plus causal attention (2 * T^2 * head_dim * heads a layer: half of QK^T and
    PV). The headline rate uses the usual 2 * linear params * tokens, which counts the LM head on every row."""
    cfg = json.loads(Path(config_path).read_text())
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    head = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * hidden  # in nlinear when not tied
    return 2 * (nlinear - head) * tokens + 2 * cfg["vocab_size"] * hidden + layers * 2 * tokens**2 * head_dim * heads


def bench_generate(gen, batch, prompt, new) -> float:
    """Seconds per decode step: (t(new) - t(1)) / (new - 1)."""
    ids = torch.randint(0, 1000, (batch, prompt))
    t_new = cuda_time(lambda: gen(ids, new))
    t_one = cuda_time(lambda: gen(ids, 1))
    return (t_new - t_one) / (new - 1)


def hf_model(config_path: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_path.parent if config_path.name == "config.json"
                                                     else _as_dir(config_path))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model


def _as_dir(config_path: Path) -> Path:
    d = Path("/tmp/mxc_bench_cfg")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(config_path.read_text())
    return d


def hf_decode_step_time(model, batch: int, prompt: int, new: int) -> tuple[float, float]:
    """HF static cache + torch.compile(reduce-overhead), gpt-fast style: (seconds per decode step, warm-up s).

    Prefill runs eagerly; the compiled forward runs one token per step at fixed
    shapes, so it compiles once per batch size.
    """
    from transformers import StaticCache

    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, 1000, (batch, prompt), device="cuda")

    def run(steps: int) -> None:
        cache = StaticCache(config=model.config, max_cache_len=prompt + new)
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, cache_position=torch.arange(prompt, device="cuda"),
                           use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            for i in range(steps):
                pos = torch.tensor([prompt + i], device="cuda")
                tok = compiled(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1:].argmax(-1)

    t0 = time.perf_counter()
    run(3)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    t_all = cuda_time(lambda: run(new - 1), warmup=1, reps=3)
    t_none = cuda_time(lambda: run(0), warmup=1, reps=3)
    return (t_all - t_none) / (new - 1), warm


class _Rows(list):
    """Table rows, each also printed as it is measured (a crash keeps what was measured)."""

    def append(self, row):
        print(f"  {row[0]:42s} {row[1]}", flush=True)
        super().append(row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="build/bench-llama3-8b")
    p.add_argument("--config", default=str(HERE / "llama3_8b.json"))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--hf-batches", default="1,8,32", help="batches to measure HF compiled at ('' to skip)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--reuse", action="store_true", help="reuse an existing artifact at --out")
    p.add_argument("--profile", nargs="?", const="1", default="",
                   help="print a per-kernel breakdown of a decode step at these batch buckets (default 1); "
                        "with --quant, of the fp8 step at batch 1 too")
    p.add_argument("--profile-prefill", action="store_true",
                   help="print a per-kernel breakdown of the prefill (bf16, and fp8 with --quant)")
    p.add_argument("--quant", choices=["fp8"], help="also build an fp8 artifact and compare it with bf16")
    p.add_argument("--quant-lm-head", action="store_true",
                   help="with --quant: also time batch-1 decode of an fp8 build whose LM head is fp8 too")
    p.add_argument("--disable-pass", action="append", default=[], help="build without this optional pass")
    p.add_argument("--pdl-ab", action="store_true",
                   help="also time each batch with the same kernels launched without the PDL attribute")
    p.add_argument("--no-pdl", dest="pdl", action="store_const", const=False, default=None,
                   help="build without programmatic dependent launch (on by default on sm_90)")
    args = p.parse_args()
    out = Path(args.out)
    rows = _Rows()

    bw, gemm = copy_bandwidth(), gemm_rate()
    rows.append(("copy bandwidth (measured)", f"{bw / 1e12:.2f} TB/s"))
    rows.append(("bf16 GEMM 8192^3 cuBLAS (measured)", f"{gemm / 1e12:.0f} TFLOP/s"))

    batches = [int(x) for x in args.batches.split(",") if x]
    max_batch = max([32, *batches])  # the cache's slots: every measured batch fits
    if not (args.reuse and (out / "manifest.json").exists()
            and json.loads((out / "manifest.json").read_text())["options"]["max_batch"] >= max_batch):
        t0 = time.perf_counter()
        mxc.build("llama.yaml", config=args.config, out=out, target="cuda", dtype="bfloat16", max_batch=max_batch,
                  max_seq_len=max(args.prefill + 1, args.prompt + args.new), progress=False,
                  disable_passes=args.disable_pass, pdl=args.pdl)
        rows.append(("build (random weights + kernels)", f"{time.perf_counter() - t0:.1f} s"))
    manifest = json.loads((out / "manifest.json").read_text())
    t0 = time.perf_counter()
    model = mxc.load(out, device="cuda", verify=False)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1)
    torch.cuda.synchronize()
    rows.append(("load -> first token (no sha256 check)", f"{time.perf_counter() - t0:.1f} s"))
    t0 = time.perf_counter()
    verify_files(out, manifest)  # what verify=True adds to a load: every file's sha256, the weights' by pieces
    rows.append(("sha256 check of the artifact (load's verify=True)",
                 f"{time.perf_counter() - t0:.1f} s on {os.cpu_count()} cores"))

    nbytes, nlinear = weight_bytes(manifest, out)
    floor = nbytes / bw
    rows.append(("weights read per step", f"{nbytes / 1e9:.2f} GB  (floor {floor * 1e3:.2f} ms at measured copy BW)"))
    mxc_gen = lambda ids, new: model.generate(ids, max_new_tokens=new)  # noqa: E731
    results = {}
    reads = {b: weight_bytes(manifest, out, batch=b)[0] for b in batches}  # a MoE batch reads more experts
    for b in batches:
        step = bench_generate(mxc_gen, b, args.prompt, args.new)
        results[b] = step
        rows.append((f"mxc decode batch {b}", f"{step * 1e3:.2f} ms/step  {reads[b] / step / 1e12:.2f} TB/s  "
                     f"{reads[b] / step / bw * 100:.0f}% of copy BW"))

    if args.pdl_ab and manifest["options"].get("pdl"):
        from profile_step import plain_launches

        from mxc.runtime.decode_graphs import PDL_MAX_BUCKET

        with plain_launches(model):  # the same cubins launched plainly: no kernel overlaps the one ahead
            for b in [b for b in results if b <= PDL_MAX_BUCKET]:  # larger buckets run plainly anyway
                step = bench_generate(mxc_gen, b, args.prompt, args.new)
                rows.append((f"mxc decode batch {b}, PDL launch off", f"{step * 1e3:.2f} ms/step  "
                             f"{reads[b] / step / bw * 100:.0f}% of copy BW (same cubins, plain launches)"))

    ids = torch.randint(0, 1000, (1, args.prefill))
    t_pre = cuda_time(lambda: model.generate(ids, max_new_tokens=1))
    flops = 2 * nlinear * args.prefill
    rows.append((f"mxc prefill {args.prefill} tokens", f"{t_pre * 1e3:.1f} ms  {flops / t_pre / 1e12:.0f} TFLOP/s  "
                 f"{flops / t_pre / gemm * 100:.0f}% of cuBLAS rate"))

    if args.profile_prefill:
        from profile_step import profile_prefill

        print(f"\nper-kernel breakdown of a {args.prefill}-token prefill (bf16):\n"
              + profile_prefill(model, args.prefill) + "\n", flush=True)
    if args.profile:
        from profile_step import profile_decode

        for b in [int(x) for x in args.profile.split(",")]:
            print(f"\nper-kernel breakdown of one batch-{b} decode step:\n" + profile_decode(model, batch=b) + "\n",
                  flush=True)

    if args.quant:
        del model
        torch.cuda.empty_cache()
        fp8_out = Path(f"{out}-fp8")
        fp8_kw = dict(config=args.config, target="cuda", dtype="bfloat16", quant="fp8", max_batch=max_batch,
                      max_seq_len=max(args.prefill + 1, args.prompt + args.new), progress=False,
                      disable_passes=args.disable_pass, pdl=args.pdl)
        mxc.build("llama.yaml", out=fp8_out, **fp8_kw)
        model = mxc.load(fp8_out, device="cuda", verify=False)
        fbytes, _ = weight_bytes(json.loads((fp8_out / "manifest.json").read_text()), fp8_out)
        step = bench_generate(lambda ids, new: model.generate(ids, max_new_tokens=new), 1, args.prompt, args.new)
        rows.append(("mxc fp8 decode batch 1", f"{step * 1e3:.2f} ms/step  {fbytes / 1e9:.2f} GB  "
                     f"{fbytes / step / bw * 100:.0f}% of copy BW"))
        if 1 in results:
            rows.append(("ratio fp8 / bf16 decode batch 1", f"{results[1] / step:.2f}x faster"))
        for b in [b for b in batches if b > 1]:  # larger batches: above 32 rows the linears are CUTLASS GEMMs
            fstep = bench_generate(lambda ids, new: model.generate(ids, max_new_tokens=new), b, args.prompt, args.new)
            rows.append((f"mxc fp8 decode batch {b}", f"{fstep * 1e3:.2f} ms/step  {b / fstep:.0f} tok/s"))
            if b in results:
                rows.append((f"ratio fp8 / bf16 decode batch {b}", f"{results[b] / fstep:.2f}x faster"))
        if args.profile:
            from profile_step import profile_decode

            print("\nper-kernel breakdown of one batch-1 fp8 decode step:\n" + profile_decode(model, batch=1) + "\n",
                  flush=True)
        if args.quant_lm_head:
            head_out = Path(f"{out}-fp8-head")
            mxc.build("llama.yaml", out=head_out, quant_lm_head=True, **fp8_kw)
            head_model = mxc.load(head_out, device="cuda", verify=False)
            hbytes, _ = weight_bytes(json.loads((head_out / "manifest.json").read_text()), head_out)
            hstep = bench_generate(lambda ids, new: head_model.generate(ids, max_new_tokens=new), 1, args.prompt,
                                   args.new)
            rows.append(("mxc fp8 + fp8 LM head decode batch 1", f"{hstep * 1e3:.2f} ms/step  {hbytes / 1e9:.2f} GB  "
                         f"{hbytes / hstep / bw * 100:.0f}% of copy BW"))
            if 1 in results:
                rows.append(("ratio fp8 (+ LM head) / bf16 batch 1", f"{results[1] / hstep:.2f}x faster"))
            del head_model
            torch.cuda.empty_cache()
        rate = fp8_gemm_rate()
        t_pre = cuda_time(lambda: model.generate(ids, max_new_tokens=1))
        rows.append(("fp8 GEMM 8192^3 torch._scaled_mm (measured)", f"{rate / 1e12:.0f} TFLOP/s"))
        rows.append((f"mxc fp8 prefill {args.prefill} tokens", f"{t_pre * 1e3:.1f} ms  {flops / t_pre / 1e12:.0f} "
                     f"TFLOP/s  {flops / t_pre / rate * 100:.0f}% of the _scaled_mm rate"))
        done = executed_prefill_flops(args.config, nlinear, args.prefill)
        rows.append(("  the same, FLOPs executed", f"{done / 1e12:.1f} of {flops / 1e12:.1f} TFLOP (the LM head on the "
                     f"last row, causal attention): {done / t_pre / rate * 100:.0f}% of the _scaled_mm rate"))
        # the GPU's power limit: the rate above is a 10 ms burst, the prefill four back-to-back 30 ms calls; the
        # same two measured alike, each way
        matched = fp8_gemm_rate_as_timed(t_pre)
        rows.append(("fp8 GEMM 8192^3, timed as the prefill", f"{matched / 1e12:.0f} TFLOP/s (back-to-back groups as "
                     f"long as one prefill)  prefill: {flops / t_pre / matched * 100:.0f}% of it"))
        gemms, gemm_flops = prefill_gemms(args.config, args.prefill)
        t_gemms = cuda_time(gemms)
        del gemms
        torch.cuda.empty_cache()
        rows.append(("the prefill's layer GEMMs alone, torch._scaled_mm", f"{t_gemms * 1e3:.1f} ms  "
                     f"{gemm_flops / t_gemms / 1e12:.0f} TFLOP/s (back to back, as the prefill; no LM head)  prefill: "
                     f"{gemm_flops / t_pre / 1e12:.0f} TFLOP/s of them = {t_gemms / t_pre * 100:.0f}% of that rate"))
        t_idle = after_idle_time(lambda: model.generate(ids, max_new_tokens=1))
        rows.append((f"mxc fp8 prefill {args.prefill} tokens after 200 ms idle", f"{t_idle * 1e3:.1f} ms  "
                     f"{flops / t_idle / 1e12:.0f} TFLOP/s  {flops / t_idle / rate * 100:.0f}% of the burst rate"))
        if args.profile_prefill:
            from profile_step import profile_prefill

            print(f"\nper-kernel breakdown of a {args.prefill}-token prefill (fp8):\n"
                  + profile_prefill(model, args.prefill) + "\n", flush=True)

    hf_batches = [int(x) for x in args.hf_batches.split(",") if x]
    if hf_batches:
        del model
        torch.cuda.empty_cache()
        try:
            hf = hf_model(Path(args.config))
            for b in hf_batches:
                step, warm = hf_decode_step_time(hf, b, args.prompt, args.new)
                rows.append((f"HF static+compile decode batch {b}", f"{step * 1e3:.2f} ms/step (warm-up {warm:.0f} s)"))
                if b in results:
                    rows.append((f"ratio mxc / HF batch {b}", f"{step / results[b]:.2f}x faster"))
        except Exception as e:  # keep mxc's figures when the HF side fails
            rows.append(("HF static+compile", f"failed: {type(e).__name__}: {str(e)[:200]}"))
    for b, step in results.items():
        rows.append((f"ratio floor / mxc batch {b}", f"{floor / step * 100:.0f}% of the bandwidth floor"))

    print("\n" + "\n".join(f"{k:42s} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
