"""Lab: the batch-1 MoE down GEMV with the token's whole down slice TMA-loaded into shared memory before its PDL wait.

Today (``triton_moe_decode``) a Qwen3-30B-A3B layer's experts take two kernels at one token: the gate/up pair kernel
(14.3 us a layer in the step for 12.1 us of bytes on the H200) and the tiled down kernel (9.1 us for 6.1 us of
bytes). The down kernel is latency-bound: its 1024 programs start loading only once the gate/up kernel is done.
Two earlier tries to start those loads sooner lost (``triton_moe_decode._default_configs``' docstring): the down
tile loaded into registers before the wait (few of the 1024 register-heavy programs fit beside the gate/up
kernel's, so most loaded after it as before), and the down matrices asked of L2 before the wait (the lines
streamed beside the gate/up kernel were evicted by its own 50 MB before use: it slowed by 3.8 us, the down kernel
gained 0.35).

Here the down kernel is ``H / BN`` programs (256 at BN = 8, the best), each holding its output rows' slice of all k
chosen experts, [k, BN, I] (98 KB in bf16 at BN = 8, and h's 16 KB), in shared memory: before
``griddepcontrol.wait`` a program reads the router's ids (written two kernels back, done once the gate/up kernel
ahead has passed its own wait, which it does before it lets this kernel launch) and issues the TMA loads of its
slice on one mbarrier; after the wait it loads h [k, I] by one more TMA load and multiplies out of shared memory.
The gate/up kernel (4 warps, 142 registers a thread on sm_90 under Triton 3.6, 512 B of shared memory; 384 programs,
at most three an SM) leaves about 10K registers and 220 KB of shared memory an SM free, so a program of 4 warps at
up to 80 registers a thread fits beside it from its start: the down bytes stream while the gate/up kernel runs (the
two kernels share HBM), and no line is read twice. An SM runs blocks of one L1 / shared-memory carveout at a time,
so each variant is timed three ways: the driver's carveout, every kernel of the chain asking for the most shared
memory, and the experts' kernels only (``set_carveout``).

    out[n] = r[n] + sum_j  round(round(h_j @ down_{e_j}[n]) * w_j)        (the pair kernels' rounding)

On the GPU machine (Hopper, Triton 3.6 or later; `bash bench/gpu_session.sh moedownsmem`): checks every variant
against the torch reference (an invalid id included), then times 32 layers of [router -> gate/up -> down ->
RMSNorm] in one CUDA graph with PDL, the shipped down kernel against each variant, rounds interleaved. Kill
criterion: no variant at least 1.5 us a layer under the shipped chain.
On the CPU, ``tests/bench/test_moe_down_smem_lab.py`` compiles the kernel for sm_90 and checks that every TMA load
of the slice sits before the PDL wait (after it in the controls) and h's after it.

Measured on one H100 (2026-12-07, docs/perf.md, seventy-seventh run; three calls, correct every time): 8 rows a
program at 4 warps, with every kernel of the chain asking for the most shared memory, is 1.60-1.68 us a layer under
the shipped chain (two calls; 1.0 at the driver's carveout); the same kernel loading its slice after the wait is
0.7 slower than shipped. The kill criterion is met on the H100, barely. A third call (seventy-eighth run): -1.73.
Not wired: a uniform max carveout (``mxc.runtime.cuda_launch.CARVEOUT = 100``) costs the whole Qwen3-30B-A3B step
1.1 us a layer (2.981 against 2.928 ms on the H100), so the kernel would gain about 1.1 us a layer in the step
(1.7%), under the kill criterion; the H200's figure is the one not measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier  # noqa: E402

from gluon_common import gdc_launch_dependents as _gdc_launch_dependents  # noqa: E402
from gluon_common import gdc_wait as _gdc_wait  # noqa: E402
from gluon_common import tma_load as _tma_load  # noqa: E402


@gluon.jit
def _load_slice(w_desc, w_smem, bar, ids_ptr, n0, E: gl.constexpr, H: gl.constexpr, KS: gl.constexpr,
                TOP_K: gl.constexpr):
    """TMA-load rows [n0, n0 + BN) of the k chosen experts' down matrices into ``w_smem`` under ``bar``."""
    BK: gl.constexpr = w_desc.block_type.shape[1]
    mbarrier.expect(bar.index(0), TOP_K * KS * w_desc.block_type.nbytes)
    for j in gl.static_range(TOP_K):
        e = gl.load(ids_ptr + j, cache_modifier=".cg")
        e = gl.where((e >= 0) & (e < E), e, 0).to(gl.int32)  # an invalid id reads expert 0; its term is dropped
        for kb in gl.static_range(KS):
            _tma_load(w_desc, [e * H + n0, kb * BK], bar.index(0), w_smem.index(j * KS + kb))


@gluon.jit
def down_smem_kernel(h_desc, w_desc, wts_ptr, ids_ptr, r_ptr, out_ptr, E: gl.constexpr, H: gl.constexpr,
                     I: gl.constexpr, TOP_K: gl.constexpr, HAS_R: gl.constexpr, USE_PDL: gl.constexpr,
                     EARLY: gl.constexpr = True):
    """One token. Program p: output rows [p * BN, (p + 1) * BN) of every chosen expert, [TOP_K * I / BK] boxes of
    [BN, BK] from ``w_desc`` (the down weights [E, H, I] as [E * H, I]), all in shared memory at once."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    KS: gl.constexpr = I // BK
    gl.static_assert(KS * BK == I, "I must be a multiple of the box's columns")
    ty: gl.constexpr = h_desc.dtype
    wty: gl.constexpr = wts_ptr.dtype.element_ty  # each product rounded to it (the pair kernels' rounding)
    n0 = gl.program_id(0) * BN

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [TOP_K * KS, BN, BK], w_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    # Before the wait: the router's ids (two kernels back: finished once the gate/up kernel ahead passed its wait,
    # which it does before it lets this kernel launch; read past L1) and the weights, which no kernel writes.
    if EARLY:
        _load_slice(w_desc, w_smem, bar, ids_ptr, n0, E, H, KS, TOP_K)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    if not EARLY:  # the control: the same loads after the wait
        _load_slice(w_desc, w_smem, bar, ids_ptr, n0, E, H, KS, TOP_K)

    NW: gl.constexpr = gl.num_warps()
    # a warp reads BK contiguous elements of one row (512 B at BK = 256 in bf16)
    layout: gl.constexpr = gl.BlockedLayout([1, BK // 32], [1, 32], [NW, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    offs_n = n0 + gl.arange(0, BN, layout=rows)
    # Past the wait, every global load at once (one round trip, not one an expert): h [TOP_K, I] as its TOP_K * KS
    # rows of BK by one TMA load (no registers), the k routing weights and ids, the residual.
    h_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
    h_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(h_bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(h_bar.index(0), h_desc.block_type.nbytes)
    _tma_load(h_desc, [0, 0], h_bar.index(0), h_smem)
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    offs_j = gl.arange(0, TOP_K, layout=vec)
    wts = gl.load(wts_ptr + offs_j).to(gl.float32)
    ids = gl.load(ids_ptr + offs_j)
    ok = (ids >= 0) & (ids < E)
    wts = gl.where(ok, wts, 0.0)
    if HAS_R:
        r = gl.load(r_ptr + offs_n).to(gl.float32)
    total = gl.zeros([BN], gl.float32, rows)
    mbarrier.wait(h_bar.index(0), 0)
    mbarrier.wait(bar.index(0), 0)
    for j in gl.static_range(TOP_K):
        acc = gl.zeros([BN, BK], gl.float32, layout)
        for kb in gl.static_range(KS):
            # row j * KS + kb of h as [1, BK], loaded in the weight tile's layout: a broadcast over its rows
            hk = h_smem.slice(j * KS + kb, 1, dim=0).load(layout).to(gl.float32)
            w = w_smem.index(j * KS + kb).load(layout).to(gl.float32)
            acc += w * hk
        y = gl.sum(acc, axis=1)
        wt = gl.sum(gl.where(offs_j == j, wts, 0.0), axis=0)
        valid = gl.sum(gl.where((offs_j == j) & ok, 1, 0), axis=0) > 0
        z = (y.to(ty).to(gl.float32) * wt).to(wty).to(gl.float32)
        total += gl.where(valid, z, 0.0)
    mbarrier.invalidate(bar.index(0))
    mbarrier.invalidate(h_bar.index(0))
    out = total.to(ty)
    if HAS_R:
        out = (r + out.to(gl.float32)).to(ty)
    gl.store(out_ptr + offs_n, out)


def descriptor(t: torch.Tensor, box: list[int]):
    """The TMA descriptor of a 2-D t, ``box`` boxes, no swizzle (a warp reads 512 contiguous bytes of one row: no
    bank conflicts)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * t.element_size(), rank=2)
    return TensorDescriptor.from_tensor(t, box, layout)


def down_descriptor(w_down: torch.Tensor, bn: int, bk: int):
    """The down weights [E, H, I] as [E * H, I], [bn, bk] boxes."""
    E, H, I = w_down.shape
    return descriptor(w_down.view(E * H, I), [bn, bk])


def down_smem(h, weights, ids, w_down, residual, desc, *, warps: int = 4, maxnreg: int | None = None,
              early: bool = True, use_pdl: bool = False, out=None):
    """out [1, H] of h [k, I] (the pair kernel's), weights and ids [1, k], down [E, H, I] (desc: ``descriptor``)."""
    E, H, I = w_down.shape
    k = ids.shape[1]
    bn, bk = desc.block_shape
    assert ids.shape[0] == 1 and H % bn == 0 and I % bk == 0, (ids.shape, H, bn)
    # h's descriptor: this call's tensor (under graph capture, the address the replays use)
    rows = k * I // bk  # a box of rows past them (a power of two) reads zeros
    h_desc = descriptor(h.view(rows, bk), [1 << (rows - 1).bit_length(), bk])
    out = out if out is not None else torch.empty((1, H), dtype=h.dtype, device=h.device)
    down_smem_kernel[(H // bn, )](h_desc, desc, weights, ids, residual if residual is not None else out, out, E, H, I,
                                  k, residual is not None, use_pdl, early, num_warps=warps,
                                  **({"maxnreg": maxnreg} if maxnreg else {}),
                                  **({"launch_pdl": True} if use_pdl else {}))
    return out


def experts(x, weights, ids, w1, w2, residual, desc, *, warps: int, maxnreg: int | None, early: bool = True,
            use_pdl: bool):
    """The shipped gate/up pair kernel (``triton_moe_decode``, its default config), then ``down_smem``."""
    from mxc.kernels import triton_moe_decode as tmd
    from mxc.kernels.launch import cdiv, launch

    H, E, I, k = x.shape[1], w1.shape[0], w2.shape[2], ids.shape[1]
    up, _ = tmd.config_for(H, I, x.dtype, k)
    h = torch.empty((k, I), dtype=x.dtype, device=x.device)
    launch(tmd._pair_up_kernel, (k, cdiv(I, up.BLOCK_N)), [x, w1, None, ids, h],
           dict(E=E, H=H, I=I, TOP_K=k, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K,
                **({"UNROLL": True} if up.UNROLL else {})), num_warps=up.num_warps, num_stages=1)
    return down_smem(h, weights, ids, w2, residual, desc, warps=warps, maxnreg=maxnreg, early=early,
                     use_pdl=use_pdl)


# (label, BN rows a program, BK columns a box, warps, registers a thread at most, the slice loaded before the wait).
# BN = 16: 128 programs of 208 KB at the 30B shape; BN = 8: 256 of 112 KB. The register cap (ptxas' maxnreg) keeps a
# program within what three gate/up programs leave an SM (10,240 registers): unrolled, the 16-row kernel holds 101
# a thread at 4 warps otherwise (Triton 3.6, sm_90), and at 80 it keeps 24 bytes of stack. Measured on one H100
# (2026-12-07; us a layer against the shipped chain, same call): the first call (no carveout set, a bug) 2 warps
# +13.5, 16 rows +1.1 (uncapped +0.4), 8 rows -1.0; the second, the carveout at max for every kernel of the chain
# against the driver's: 8 rows -1.68 / -1.03, 16 rows +2.95 / +1.30 (uncapped +0.49 / +0.56, 128-column boxes
# +2.11 / +0.64), the controls loading after the wait 8 rows +0.74 / +0.65 and 16 rows uncapped +2.64 / +2.55, and the
# shipped chain itself +0.48 at max.
VARIANTS = (("8 rows, 4 warps", 8, 256, 4, 80, True), ("8 rows, 4 warps, uncapped", 8, 256, 4, None, True),
            ("8 rows, 128-column boxes, 4 warps", 8, 128, 4, 80, True), ("4 rows, 4 warps", 4, 256, 4, 80, True),
            ("16 rows, 4 warps, uncapped", 16, 256, 4, None, True))


def check(device: str = "cuda") -> None:
    """Against ``moe_ref.fused_moe`` plus the residual (rounded as the pair kernels round), every variant, an
    invalid id among the k."""
    from mxc.kernels import moe_ref

    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16
    for E, H, I, K in ((128, 2048, 768, 8), (16, 256, 512, 4)):
        w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dt).to(device)
        w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(dt).to(device)
        x = torch.randn(1, H, generator=g).to(dt).to(device)
        r = torch.randn(1, H, generator=g).to(dt).to(device)
        wts, ids = torch.topk(torch.randn(1, E, generator=g).softmax(-1), K, dim=-1)
        wts, ids = (wts / wts.sum(-1, keepdim=True)).to(dt).to(device), ids.to(device)
        ids[0, -1] = E + 3  # an invalid id contributes nothing
        y = moe_ref.fused_moe(x, wts.masked_fill(ids >= E, 0), ids.clamp(max=E - 1), w1, w2)
        want = (r.float() + y.float()).to(dt).float()
        for label, bn, bk, warps, maxnreg, early in VARIANTS:
            if H % bn or I % bk:
                continue
            got = experts(x, wts, ids, w1, w2, r, down_descriptor(w2, bn, bk), warps=warps, maxnreg=maxnreg,
                          early=early, use_pdl=False).float()
            err = float((got - want).abs().max() / want.abs().max())
            print(f"check E={E} H={H} I={I} k={K} {label}: max err {err:.2e}", flush=True)
            assert err < 1e-2, (label, err)


def jit_functions(modules) -> list:
    """The Triton and Gluon kernels defined or imported at the top level of ``modules``."""
    from triton.runtime.jit import JITFunction

    fns = []
    for mod in modules:
        for obj in vars(mod).values():
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)  # autotuner wrappers
            if isinstance(fn, JITFunction) and fn not in fns:
                fns.append(fn)
    return fns


def set_carveout(fns, percent: int) -> int:
    """Set every compiled kernel of the Triton / Gluon functions ``fns`` to prefer ``percent`` of the SM's unified
    L1 / shared memory as shared memory (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``; -1: no preference,
    the driver's choice). An SM runs blocks of one carveout at a time, so a down kernel of 112-208 KB a program may
    wait for the gate/up kernel's blocks to drain from an SM the driver configured small. Returns how many compiled
    kernels were set."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    n = 0
    for fn in fns:
        for cache in fn.device_caches.values():
            for kernel in cache[0].values():
                kernel._init_handles()
                rc = cu.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, ctypes.c_int(percent))
                assert rc == 0, f"cuFuncSetAttribute: CUresult {rc}"
                n += 1
    return n


def bench(rounds: int) -> None:
    from moe_lab import chain_inputs, time_us

    from mxc.kernels import triton_moe_decode as tmd
    from mxc.kernels import triton_norm, triton_route

    c = chain_inputs()
    w1, w2, nw, route = c.w1, c.w2, c.nw, c.route

    def shipped(i):
        s, h, wts, ids = route(i)
        return triton_norm.rms_norm(tmd.fused_moe(h, wts, ids, w1, w2, residual=s), nw, 1e-6)

    def variant(bn, bk, warps, maxnreg, early):
        desc = down_descriptor(w2, bn, bk)

        def layer(i):
            s, h, wts, ids = route(i)
            return triton_norm.rms_norm(experts(h, wts, ids, w1, w2, s, desc, warps=warps, maxnreg=maxnreg,
                                                           early=early, use_pdl=True), nw, 1e-6)
        return layer

    names = {"router only": route, "shipped": shipped}
    for label, bn, bk, warps, maxnreg, early in VARIANTS:
        names[f"smem down, {label}"] = variant(bn, bk, warps, maxnreg, early)
    chain = jit_functions([sys.modules[__name__], tmd, triton_norm, triton_route])
    experts_only = [down_smem_kernel, tmd._pair_up_kernel, tmd._pair_down_tile_kernel]
    for fn in names.values():  # compiled before the carveout is set on them
        fn(0)
    torch.cuda.synchronize()
    print(f"kernels given the carveout: {set_carveout(chain, -1)}", flush=True)
    results: dict[str, list[float]] = {}
    # carveouts: the driver's; the most shared memory for every kernel of the chain; for the experts' kernels only
    modes = {"default": [], "max": chain, "max for the experts": experts_only}
    for _ in range(rounds):
        for mode, at_max in modes.items():
            for name, fn in names.items():
                label = f"{name}, carveout {mode}"
                try:
                    set_carveout(chain, -1)
                    set_carveout(at_max, 100)
                    t = time_us(fn, calls=32, pdl=True)
                except Exception as e:  # a lab: say what failed and go on
                    print(f"  skip {label}: {type(e).__name__} {str(e)[:200]}", flush=True)
                    continue
                results.setdefault(label, []).append(t)
    set_carveout(chain, -1)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in results.items()}
    base, router = med["shipped, carveout default"], med["router only, carveout default"]
    for name, ts in sorted(results.items(), key=lambda kv: med[kv[0]]):
        print(f"{name:62s} {med[name]:7.2f} us a layer ({'/'.join(f'{t:.2f}' for t in ts)}), "
              f"{med[name] - base:+6.2f} vs shipped, experts + norm {med[name] - router:6.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args()
    if not args.skip_check:
        check()
    bench(args.rounds)


if __name__ == "__main__":
    main()
