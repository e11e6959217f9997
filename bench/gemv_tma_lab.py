"""Lab: the decode fp8 GEMV (e4m3 wgmma, weights on the wide side as ``SWAP_AB``) fed by TMA loads of the weights.

The shipped tensor-core GEMV (``triton_fp8_gemv._qgemv_kernel`` with ``SWAP_AB``) loads its [BLOCK_N, BLOCK_K] weight
tiles through pointers; at one token the fp8 GEMVs run ~2 us a GEMV over their bytes at the copy rate, against ~1 us
for bf16's (``docs/perf.md``, twenty-fifth run). Now that the AOT launcher passes tensor descriptors (thirty-fourth
run), this lab prices the same product with each weight tile a TMA copy into shared memory (``tl.range`` stages
pipelined by Triton with mbarriers), for the Llama-3-8B linears at one and eight tokens: microseconds and weight
TB/s as decode runs them (``gemv_tuning.time_us``: a CUDA graph of back-to-back calls over weight copies covering 4x
the L2), the activation quantize included on both sides, and the largest difference from the product of the
dequantized operands (relative to its largest value: bf16 rounding is ~4e-3).

Usage: python bench/gemv_tma_lab.py [--m 1,8] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import triton_fp8, triton_fp8_gemv, triton_fp8_quant, triton_gemv  # noqa: E402
from mxc.kernels.gemv_tuning import LLAMA3_8B_SHAPES, copies_for, time_us  # noqa: E402
from mxc.loaders.quantize import quantize_fp8  # noqa: E402


@triton.jit
def tma_gemv_kernel(w_desc, x_ptr, xs_ptr, s_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    STAGES: tl.constexpr):
    """Columns [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over K slice pid_k: acc^T = w @ xq^T (e4m3 wgmma), the
    weight tiles by TMA. SPLIT_K == 1: y in x's dtype, scaled; else the fp32 partials [SPLIT_K, M, N], scaled."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K_PER_SPLIT: tl.constexpr = K // SPLIT_K
    k0 = pid_k * K_PER_SPLIT
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :]
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([pid_n * BLOCK_N, k0 + k])
        xq = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
        acc_t = tl.dot(w, tl.trans(xq), acc_t)
    acc = tl.trans(acc_t)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    xs = tl.load(xs_ptr + offs_m, mask=row_ok, other=0.0)
    ws = tl.load(s_ptr + offs_n)
    acc = acc * xs[:, None] * ws[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(y_ptr + pid_k * M * N + offs, acc, mask=row_ok[:, None])


def tma_gemv(x, w, s, bn: int, bk: int, split: int, stages: int, warps: int):
    """y = x @ (w * s)^T through the lab kernel (x quantized per token first, as the shipped PREQUANT path does)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[0]
    xq, xs = triton_fp8_quant._prequantize(x, M, K, False, triton_fp8_quant._quant_block(K))
    bm = max(16, triton.next_power_of_2(M))
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    tma_gemv_kernel[(N // bn, split)](desc, xq, xs, s, out, M, N=N, K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                      SPLIT_K=split, STAGES=stages, num_warps=warps, num_stages=1)
    if split > 1:
        block_r = max(64, 1024 // bm)
        triton_fp8_gemv._qgemv_reduce_kernel[(triton.cdiv(N, block_r),)](
            out, None, None, y, M, N=N, SPLIT_K=split, BLOCK_M=bm, BLOCK_R=block_r, HAS_BIAS=False,
            HAS_RESIDUAL=False, num_warps=4, num_stages=1)
    return y


def configs(n: int, k: int):
    for bn in (64, 128):
        for bk in (256, 512):
            if k % bk:
                continue
            splits = {1, triton_gemv.split_k_for(n // bn, k, bk)}
            for split in sorted(s for s in splits if k % (s * bk) == 0):
                for stages in (3, 5):
                    yield bn, bk, split, stages, 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,8")
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = p.parse_args()
    for name in args.shapes.split(","):
        n, k = LLAMA3_8B_SHAPES[name]
        w = torch.randn(n, k, device="cuda") * k ** -0.5
        q, s = quantize_fp8(w.cpu(), "channel")
        ws = [q.cuda().clone() for _ in range(copies_for(n * k))]
        s = s.cuda()
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = triton_fp8.config_for(triton_gemv.bucket(m), n, k, torch.bfloat16, "channel")
            xq, xs = triton_fp8_quant._prequantize(x, m, k, False, triton_fp8_quant._quant_block(k))
            ref = (xq.float() * xs[:, None]) @ (ws[0].float() * s[:, None]).T  # the lab's numerics, in fp32
            us = time_us(lambda x_, w_: triton_fp8.qlinear_small_m(x_, w_, s, config=cfg), x, ws)
            print(f"{name} M={m} shipped {cfg}: {us:.1f} us {n * k / us / 1e6:.2f} TB/s", flush=True)
            for bn, bk, split, stages, warps in configs(n, k):
                label = f"{name} M={m} TMA BLOCK_N={bn} BLOCK_K={bk} SPLIT_K={split} stages={stages} warps={warps}"
                try:
                    got = tma_gemv(x, ws[0], s, bn, bk, split, stages, warps).float()
                    us = time_us(lambda x_, w_: tma_gemv(x_, w_, s, bn, bk, split, stages, warps), x, ws)
                except Exception as e:  # out of shared memory, a block shape TMA refuses: say so and go on
                    print(f"{label}: failed: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                diff = ((got - ref).abs().max() / ref.abs().max()).item()
                print(f"{label}: {us:.1f} us {n * k / us / 1e6:.2f} TB/s  max diff {diff:.1e}", flush=True)
        del ws


if __name__ == "__main__":
    main()
