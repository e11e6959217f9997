"""Lab: the causal prefill attention with TMA loads of K/V and the softmax's scale folded into one FMA.

The shipped kernel (``triton_attention``, template ``prefill_attention.py.j2``) loads K^T and V through
pointers and scales ``s`` before its row maximum. This lab's kernel takes the same cache ([S, L, HKV, D])
and queries ([T, HQ, D]) and differs in two switches, so each can be priced alone:

- ``TMA``: K and V blocks (and the q block) loaded through host-built tensor descriptors (the cache viewed as
  [S * L, HKV * D]); V rows past the causal limit zeroed in the diagonal blocks (the cache beyond a sequence's
  rows is not initialised).
- ``FMA``: the row maximum taken on the unscaled ``s`` (the scale is positive) and ``p = exp2(s * c - m)``
  one FMA an element, as Triton's Hopper attention tutorial does.

Prints ms and TFLOP/s (causal: half the square) for the shipped kernel and each variant and config, and the
largest difference from the shipped output. Usage: python bench/attention_tma_lab.py [--tokens 2048,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxc.kernels import triton_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128


@triton.jit
def _inner(acc, l_i, m_i, q, k_desc, v_desc, kt_ptrs, v_ptrs, row0, col, start, end, pos_m, hi, c,
           MASKED: tl.constexpr, TMA: tl.constexpr, FMA: tl.constexpr, ROW_STRIDE: tl.constexpr,
           BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        pos_n = start_n + offs_n
        mask_n = pos_n < hi
        if TMA:
            kt = tl.trans(k_desc.load([row0 + start_n, col]))
            v = v_desc.load([row0 + start_n, col])
            if MASKED:
                v = tl.where(mask_n[:, None], v, 0.0)
        elif MASKED:
            kt = tl.load(kt_ptrs + start_n * ROW_STRIDE, mask=mask_n[None, :], other=0.0)
            v = tl.load(v_ptrs + start_n * ROW_STRIDE, mask=mask_n[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs + start_n * ROW_STRIDE)
            v = tl.load(v_ptrs + start_n * ROW_STRIDE)
        s = tl.dot(q, kt)
        if MASKED:
            s = tl.where(mask_n[None, :] & (pos_n[None, :] <= pos_m[:, None]), s, float("-inf"))
        if FMA:
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            p = tl.exp2(s * c - m_new[:, None])
        else:
            s = s * c
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def lab_kernel(q_ptr, q_desc, k_desc, v_desc, k_ptr, v_ptr, slots_ptr, kv_lens_ptr, q_start_ptr, out_ptr, c,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, FMA: tl.constexpr):
    """Grid (HQ, B, query blocks), the longest blocks first (as shipped). No window, causal."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
    kvh = h // (HQ // HKV)
    tok0 = tl.load(q_start_ptr + b)
    n_q = tl.load(q_start_ptr + b + 1) - tok0
    start_m = pid_m * BLOCK_M
    if start_m >= n_q:
        return
    slot = tl.load(slots_ptr + b)
    past = tl.load(kv_lens_ptr + b) - n_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    pos_m = past + offs_m
    q_offs = ((tok0 + offs_m[:, None]) * HQ + h) * D + offs_d[None, :]
    if TMA:
        q = q_desc.load([tok0 + start_m, h * D])
    else:
        q = tl.load(q_ptr + q_offs, mask=(offs_m < n_q)[:, None], other=0.0)
    ROW: tl.constexpr = HKV * D
    base = slot.to(tl.int64) * (L * ROW) + kvh * D
    kt_ptrs = k_ptr + base + offs_n[None, :] * ROW + offs_d[:, None]
    v_ptrs = v_ptr + base + offs_n[:, None] * ROW + offs_d[None, :]
    row0 = slot * L
    first = past + start_m
    hi = past + tl.minimum(start_m + BLOCK_M, n_q)
    full_hi = (first + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_desc, v_desc, kt_ptrs, v_ptrs, row0, kvh * D, 0, full_hi, pos_m, hi,
                           c, False, TMA, FMA, ROW, BLOCK_N)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_desc, v_desc, kt_ptrs, v_ptrs, row0, kvh * D, full_hi, hi, pos_m, hi,
                           c, True, TMA, FMA, ROW, BLOCK_N)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < n_q)[:, None])


def lab(q, kc, vc, slots, kv_lens, q_start, T, scale, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages, tma, fma = cfg
    S, L = kc.shape[:2]
    out = torch.empty_like(q)
    q2, k2, v2 = q.view(q.shape[0], HQ * D), kc.view(S * L, HKV * D), vc.view(S * L, HKV * D)
    qd = TensorDescriptor.from_tensor(q2, [bm, D])
    kd = TensorDescriptor.from_tensor(k2, [bn, D])
    vd = TensorDescriptor.from_tensor(v2, [bn, D])
    grid = (HQ, slots.numel(), triton.cdiv(T, bm))
    lab_kernel[grid](q, qd, kd, vd, kc, vc, slots, kv_lens, q_start, out, scale * 1.4426950408889634,
                     HQ=HQ, HKV=HKV, D=D, L=L, BLOCK_M=bm, BLOCK_N=bn, TMA=tma, FMA=fma,
                     num_warps=warps, num_stages=stages)
    return out


CONFIGS = [(bm, bn, w, s, tma, fma) for tma in (False, True) for fma in (False, True)
           for bm, bn, w, s in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3))]


def main() -> None:
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="2048,4096")
    args = p.parse_args()
    dev = "cuda"
    for T in [int(t) for t in args.tokens.split(",")]:
        L = T + 64
        q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
        kc[0, T:] = float("nan")  # rows past the sequence: a kernel that lets them in fails the diff
        vc[0, T:] = float("nan")
        slots = torch.zeros(1, dtype=torch.int32, device=dev)
        kv_lens = torch.full((1,), T, dtype=torch.int32, device=dev)
        q_start = torch.tensor([0, T], dtype=torch.int32, device=dev)
        scale = D ** -0.5
        flops = 2 * T * T * D * HQ

        def shipped():
            return triton_attention.prefill_attention(q, kc, vc, slots, kv_lens, q_start, T, scale)

        ref = shipped()
        t = do_bench(shipped, warmup=25, rep=200)
        print(f"T={T:5d} shipped                            {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s", flush=True)
        for cfg in CONFIGS:
            try:
                o = lab(q, kc, vc, slots, kv_lens, q_start, T, scale, cfg)
                tc = do_bench(lambda cfg=cfg: lab(q, kc, vc, slots, kv_lens, q_start, T, scale, cfg), warmup=25,
                              rep=200)
                diff = (o.float() - ref.float()).abs().max().item()
                print(f"T={T:5d} lab {str(cfg):32s} {tc:7.3f} ms {flops / tc / 1e9:6.0f} TFLOP/s  max diff "
                      f"{diff:.2e}", flush=True)
            except Exception as e:  # out of shared memory, or a descriptor the Triton version refuses
                print(f"T={T:5d} lab {str(cfg):32s} failed: {str(e).splitlines()[0][:100]}", flush=True)
        qv, kv_, vv = q.transpose(0, 1)[None], kc[0, :T].transpose(0, 1)[None], vc[0, :T].transpose(0, 1)[None]

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(qv, kv_, vv, is_causal=True, scale=scale, enable_gqa=True)

        try:
            cudnn()
            tc = do_bench(cudnn, warmup=25, rep=200)
            print(f"T={T:5d} cuDNN                              {tc:7.3f} ms {flops / tc / 1e9:6.0f} TFLOP/s")
        except RuntimeError as e:
            print(f"cuDNN refused: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
