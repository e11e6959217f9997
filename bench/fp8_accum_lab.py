"""How precisely the Triton fp8 kernels accumulate on sm_90, and what promoting their sums costs.

Triton lowers an e4m3 x e4m3 -> fp32 ``tl.dot`` on sm_90 to wgmma accumulating in the tensor cores' own
accumulator, which keeps fewer bits than fp32 (DeepSeek-V3's report, section 3.3.2: about 14), unless the dot's
``max_num_imprecise_acc`` asks for the partial sums to be added into an fp32 accumulator every that many K
elements. Its default on sm_90 is 2**30: never. ``--promote N`` sets ``triton_fp8_quant.FP8_ACC_PROMOTE`` (the
fp8 GEMV and GEMM then promote every N elements, at least once a dot; 32: after every wgmma), so the same
kernels can be compared run against run:

1. each Llama-3-8B-shaped fp8 linear (the GEMVs at 1-16 rows, the Triton GEMM above) against the exact product
   of the same e4m3 operands (float64), bf16 and float32 outputs, and the bf16 times in a CUDA graph;
2. a tiny float32 fp8 Llama's cuda logits against its CPU artifact's (the W8A8 scheme computed in float32).

Usage: python bench/fp8_accum_lab.py [--promote N] [--skip linears,tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _exact(x, q, s, granularity, weight_only):
    from mxc.kernels import fp8_ref

    if weight_only:
        xf = x.double()
    else:
        xq, xs = fp8_ref.quantize_rows(x)
        xf = xq.double() * xs.double()[:, None]
    w = q.double()
    if granularity == "block128":
        n, k = w.shape
        w = w * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        w = w * s.double()[:, None]
    return xf @ w.t()


def linears() -> None:
    from triton.testing import do_bench_cudagraph

    from mxc.kernels import triton_fp8
    from mxc.loaders.quantize import quantize_fp8

    print("linear                 gran      dtype     M  max err / max |y|  mean err / mean |y|   us (graph)")
    for n, k in ((6144, 4096), (4096, 14336)):
        for granularity in ("channel", "block128"):
            q, s = quantize_fp8(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02, granularity)
            q, s = q.cuda(), s.cuda()
            for dtype in (torch.bfloat16, torch.float32):
                for m in (1, 4, 16, 80, 2048):
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    cfg = triton_fp8.config_for(1, n, k, dtype, granularity) if m == 1 else None
                    weight_only = bool(cfg and cfg.WEIGHT_ONLY)
                    y = triton_fp8.qlinear(x, q, s, granularity=granularity).double()
                    ref = _exact(x, q, s, granularity, weight_only)
                    d = (y - ref).abs()
                    t = ""
                    if dtype == torch.bfloat16 and m != 80:
                        us = 1e3 * do_bench_cudagraph(lambda: triton_fp8.qlinear(x, q, s, granularity=granularity))
                        t = f"{us:8.2f}"
                    print(f"N={n:5d} K={k:5d}{' w-only' if weight_only else '       '} {granularity:9s} "
                          f"{str(dtype)[6:]:9s} {m:4d}  {float(d.max() / ref.abs().max()):.2e}           "
                          f"{float(d.mean() / ref.abs().mean()):.2e}          {t}", flush=True)


def tiny() -> None:
    import mxc
    from tests.conftest import make_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "ckpt"
        make_hf_model("LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4).save_pretrained(ckpt, safe_serialization=True)
        for dtype in ("float32", "bfloat16"):
            for granularity in ("channel", "tensor", "block128"):
                kw = dict(quant="fp8", quant_granularity=granularity, dtype=dtype, progress=False, log=lambda m: None)
                out = tmp / f"{dtype}-{granularity}"
                gpu = mxc.load(mxc.build(str(ckpt), out=out / "gpu", target="cuda", max_batch=4, max_seq_len=64,
                                         **kw), device="cuda")
                cpu = mxc.load(mxc.build(str(ckpt), out=out / "cpu", **kw))
                for seq in (9, 40):
                    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(3))
                    a, b = gpu.logits(ids).cpu().float(), cpu.logits(ids).float()
                    print(f"tiny Llama {dtype:8s} {granularity:8s} 2 x {seq:2d} tokens: cuda vs cpu logits, max err / "
                          f"max |logit| {float((a - b).abs().max() / b.abs().max()):.2e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--promote", type=int, default=0, help="triton_fp8_quant.FP8_ACC_PROMOTE (default 0: never)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: linears, tiny")
    a = p.parse_args()
    from mxc.kernels import triton_fp8_quant

    triton_fp8_quant.FP8_ACC_PROMOTE = a.promote
    print(f"# {torch.cuda.get_device_name()}: fp8 dots' sums promoted to fp32 every "
          f"{a.promote or 'no'} elements of K")
    skip = set(filter(None, a.skip.split(",")))
    if "linears" not in skip:
        linears()
    if "tiny" not in skip:
        tiny()


if __name__ == "__main__":
    main()
