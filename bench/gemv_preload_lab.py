"""Lab: the one-token fp8 wgmma GEMV with its first weight stages loaded into shared memory before the PDL wait.

The experiment planned in docs/persistent_decode.md ("What 1.8x needs"). The shipped qkv and gate/up GEMVs
(``triton_fp8_gemv``, v3 SWAP_AB) ask L2 for 512 B a row before ``griddepcontrol.wait`` and issue their
cp.async pipeline after it: Triton's pipeliner keeps the weight stages with the x tiles that share the loop.
This kernel is written in Gluon (``triton.experimental.gluon``), where the ring is explicit: with ``EARLY`` the
TMA loads of weight stages 0..STAGES-1 are issued before the wait (weights are never written by a kernel of the
step), x's tiles after it. ``EARLY=False`` is the same kernel with every load after the wait: the control.

    y[m, n] = (sum_k xq[m, k] * w[n, k]) * xs[m] * s[n]      xq, w e4m3; xs [M], s [N] float32; y bf16

One program per ``block_n`` (64 or 128) weight rows: wgmma with the weights on the M side and the (up to 16)
tokens on N, as SWAP_AB does. ``VARIANTS`` lists the rings measured (depth, 128-byte boxes a stage, one step's
wgmmas kept in flight). Not wired into any build.

On the GPU machine (Hopper, Triton 3.6 or later, which have Gluon; `bash bench/gpu_session.sh preload`):

    python bench/gemv_preload_lab.py            # correctness against the torch reference, then the timings

checks the kernel against the torch reference, then times 32 layers of [RMSNorm-quantize kernel -> GEMV] in
one CUDA graph with PDL, for the qkv (6144 x 4096) and gate/up (28672 x 4096, without its SiLU epilogue)
shapes: ``triton_fp8_gemv.qlinear_small_m`` (the shipped GEMV), then each variant with ``EARLY`` off and on. The
kill criterion: no gain of EARLY over the shipped GEMV in the chain.

On the CPU, ``tests/bench/test_gemv_preload_lab.py`` compiles the kernel for sm_90 and checks where its loads sit
against the PDL wait.

Measured on one H200 (2026-12-03, docs/perf.md, thirty-seventh run; three calls): loading the weight stages before
the wait saves 0.5-0.8 us a layer against the same kernel loading them after it, but no variant beats the shipped
GEMV by more than the spread: qkv, best 10.18 us a layer against the shipped 9.28; gate/up, best 30.72 against
30.99. The kill criterion is met; nothing is wired.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from gluon_common import gdc_launch_dependents as _gdc_launch_dependents
from gluon_common import gdc_wait as _gdc_wait
from gluon_common import tma_load as _tma_load

BLOCK_N = 64  # weight rows a program: wgmma's M
BLOCK_K = 128  # bytes of a weight row a stage: one 128-byte swizzled TMA box
BLOCK_M = 16  # tokens, padded: wgmma's N


@gluon.jit
def _load_stage(desc, bar, smem, stage, k_step, row, SUB: gl.constexpr):
    """TMA-load K step ``k_step`` (SUB boxes of 128 B a row) of ``desc``'s rows from ``row`` into ring stage
    ``stage``, under that stage's barrier."""
    BK: gl.constexpr = desc.block_type.shape[1]
    mbarrier.expect(bar.index(stage), SUB * desc.block_type.nbytes)
    for j in gl.static_range(SUB):
        _tma_load(desc, [row, (k_step * SUB + j) * BK], bar.index(stage), smem.index(stage * SUB + j))


@gluon.jit
def qgemv_preload_kernel(w_desc, x_desc, s_ptr, xs_ptr, y_ptr, M, N: gl.constexpr, K: gl.constexpr,
                         STAGES: gl.constexpr, EARLY: gl.constexpr, USE_PDL: gl.constexpr, PIPE: gl.constexpr,
                         SUB: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    NUM_K: gl.constexpr = K // (BK * SUB)  # K steps of SUB boxes
    gl.static_assert(NUM_K >= STAGES, "fewer K steps than stages")
    off_n = gl.program_id(0) * BN

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * SUB, BN, BK], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * SUB, BM, BK], x_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(i), count=1)
        mbarrier.init(x_bar.index(i), count=1)
    fence_async_shared()

    if EARLY:  # the weights stream in while the kernel ahead finishes
        for i in gl.static_range(STAGES):
            _load_stage(w_desc, w_bar, w_smem, i, i, off_n, SUB)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    if not EARLY:
        for i in gl.static_range(STAGES):
            _load_stage(w_desc, w_bar, w_smem, i, i, off_n, SUB)
    for i in gl.static_range(STAGES):  # x is written by the kernel ahead: only after the wait
        _load_stage(x_desc, x_bar, x_smem, i, i, 0, SUB)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM, 32])
    acc = gl.zeros((BN, BM), dtype=gl.float32, layout=mma_layout)
    for k in range(NUM_K):
        s = k % STAGES
        phase = (k // STAGES) & 1
        mbarrier.wait(w_bar.index(s), phase)
        mbarrier.wait(x_bar.index(s), phase)
        for j in gl.static_range(SUB):
            acc = warpgroup_mma(w_smem.index(s * SUB + j), x_smem.index(s * SUB + j).permute((1, 0)), acc,
                                is_async=True)
        if PIPE:  # keep this step's wgmmas in flight; the step before is done, so refill its stage
            acc = warpgroup_mma_wait(num_outstanding=SUB, deps=(acc, ))
            pk = k - 1 + STAGES
            if (k >= 1) & (pk < NUM_K):
                _load_stage(w_desc, w_bar, w_smem, (k - 1) % STAGES, pk, off_n, SUB)
                _load_stage(x_desc, x_bar, x_smem, (k - 1) % STAGES, pk, 0, SUB)
        else:  # wait for this step's wgmmas, then refill the stage just read
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if k + STAGES < NUM_K:
                _load_stage(w_desc, w_bar, w_smem, s, k + STAGES, off_n, SUB)
                _load_stage(x_desc, x_bar, x_smem, s, k + STAGES, 0, SUB)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(i))
        mbarrier.invalidate(x_bar.index(i))

    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, mma_layout))
    m_ok = offs_m < M
    s_n = gl.load(s_ptr + offs_n)
    xs_m = gl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    y = acc * gl.expand_dims(s_n, 1) * gl.expand_dims(xs_m, 0)
    ptrs = y_ptr + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1)
    gl.store(ptrs, y.to(gl.bfloat16), mask=gl.expand_dims(m_ok, 0))


def descriptors(w: torch.Tensor, xq: torch.Tensor, block_n: int = BLOCK_N):
    """The TMA descriptors of w [N, K] and xq [M, K] (e4m3): [block_n, BLOCK_K] and [BLOCK_M, BLOCK_K] boxes,
    x's rows past M read as zeros."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.float8e4nv)
    x_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(w, [block_n, BLOCK_K], w_layout),
            TensorDescriptor.from_tensor(xq, [BLOCK_M, BLOCK_K], x_layout))


def qgemv_preload(xq, xs, w, s, *, stages: int = 6, early: bool = True, use_pdl: bool = False, pipe: bool = False,
                  block_n: int = BLOCK_N, sub: int = 1, descs=None, out=None):
    """y [M, N] bf16 of xq [M, K] e4m3 (M <= 16), xs [M] and w [N, K] e4m3, s [N] (float32 scales). ``pipe`` keeps
    one step's wgmmas in flight and refills the stage before it; a ring stage holds ``sub`` 128-byte boxes a row."""
    M, K = xq.shape
    N = w.shape[0]
    assert M <= BLOCK_M and N % block_n == 0 and K % (BLOCK_K * sub) == 0, (M, N, K)
    w_desc, x_desc = descs if descs is not None else descriptors(w, xq, block_n)
    y = out if out is not None else torch.empty((M, N), dtype=torch.bfloat16, device=xq.device)
    qgemv_preload_kernel[(N // block_n, )](w_desc, x_desc, s, xs, y, M, N, K, stages, early, use_pdl, pipe, sub,
                                           num_warps=4, **({"launch_pdl": True} if use_pdl else {}))
    return y


# (label, stages, pipe, block_n, sub): the ring's depth, whether one step's wgmmas stay in flight, weight rows a
# program, 128-byte boxes a row a stage. The third call's set; the second call's also had, slower than these
# (docs/perf.md, thirty-seventh run): 6 stages of 64 rows without ``pipe`` (0.4-0.7 us a layer slower than with
# it) and 12 stages of 128 B, pipelined (over 8 stages by 1.4 us on qkv and 7 us on gate/up).
VARIANTS = (("64 rows, 8 x 128 B", 8, True, 64, 1), ("64 rows, 4 x 256 B", 4, True, 64, 2),
            ("64 rows, 5 x 256 B", 5, True, 64, 2), ("128 rows, 6 x 128 B", 6, True, 128, 1),
            ("128 rows, 3 x 256 B", 3, True, 128, 2), ("128 rows, 4 x 256 B", 4, True, 128, 2))


def check(device="cuda") -> None:
    """Against the project's reference, ``fp8_ref.qlinear`` (x quantized per token by ``fp8_ref.quantize_rows``, as the
    quantize kernel does), at 1, 3 and 16 tokens, every variant whose ring fits K."""
    from mxc.kernels import fp8_ref
    from mxc.loaders.quantize import quantize_fp8

    torch.manual_seed(0)
    for M, N, K in ((1, 6144, 4096), (3, 256, 1024), (16, 128, 768)):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w, s = quantize_fp8(torch.randn(N, K, device=device), "channel")
        want = fp8_ref.qlinear(x, w, s).float()
        xq, xs = fp8_ref.quantize_rows(x)
        for label, stages, pipe, block_n, sub in VARIANTS:
            if stages > K // (BLOCK_K * sub) or N % block_n:
                continue
            for early in (False, True):
                got = qgemv_preload(xq, xs, w, s, stages=stages, early=early, pipe=pipe, block_n=block_n,
                                    sub=sub).float()
                err = float((got - want).abs().max() / want.abs().max())
                print(f"check M={M} N={N} K={K} {label}, early={early}: max err {err:.2e}")
                assert err < 2e-2, err


def _bench_chain(n: int, k: int, layers: int = 32) -> None:
    """32 layers of RMSNorm-quantize then the GEMV, one CUDA graph with PDL: shipped against this kernel."""
    from triton.testing import do_bench_cudagraph

    from mxc.kernels import launch as L
    from mxc.kernels import triton_fp8_gemv as g
    from mxc.kernels.triton_fp8_quant import _prequantize

    dev = "cuda"
    ws = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(layers)]
    ss = [torch.rand(n, device=dev) / 64 for _ in range(layers)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    g_norm = torch.ones(k, device=dev, dtype=torch.bfloat16)
    ys = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    block_k = g.config_for(1, n, k, torch.bfloat16, "channel").QUANT_BLOCK_K  # the shipped RMSNorm-quantize

    def shipped():
        for i in range(layers):
            g.qlinear_small_m(x, ws[i], ss[i], prologue="rms_norm", norm_weight=g_norm, out=ys[i])

    def preload(stages, early, pipe, block_n, sub):
        def run():
            for i in range(layers):
                xq, xs = _prequantize(x, 1, k, False, block_k, g_norm, 1e-6)
                # descriptors of this call's xq: under graph capture its address is the replay's
                qgemv_preload(xq, xs, ws[i], ss[i], stages=stages, early=early, use_pdl=True, pipe=pipe,
                              block_n=block_n, sub=sub, descs=descriptors(ws[i], xq, block_n), out=ys[i])
        return run

    rows = [("shipped", shipped)]
    for label, stages, pipe, block_n, sub in VARIANTS:
        for early in (False, True):
            rows.append((f"gluon, {label}, weights {'before' if early else 'after'} the wait",
                         preload(stages, early, pipe, block_n, sub)))
    with L.using(L.jit_launch_pdl):
        for name, fn in rows:
            try:
                us = do_bench_cudagraph(fn, rep=200) * 1e3 / layers
            except Exception as e:  # a lab: say what failed and go on
                print(f"chain {n} x {k}: {name}: failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"chain {n} x {k}: {name:62s} {us:6.2f} us a layer (bytes at 4.2 TB/s: {n * k / 4.2e6:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args()
    if not args.skip_check:
        check()
    torch.cuda.synchronize()
    for n, k in ((6144, 4096), (28672, 4096)):
        _bench_chain(n, k)


if __name__ == "__main__":
    main()
