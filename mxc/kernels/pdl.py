"""Programmatic dependent launch (Hopper and later): a kernel may start before the one ahead of it ends.

With the build option ``pdl``, every Triton kernel is compiled with ``USE_PDL`` and
the runtime launches it with the programmatic-stream-serialization attribute, which
CUDA graphs keep as programmatic edges. Each kernel begins with ``pdl_enter``: it
waits until the previous kernel has finished and its writes are visible
(``griddepcontrol.wait``), then lets the next kernel be scheduled
(``griddepcontrol.launch_dependents``), so the next kernel's launch and block
scheduling overlap this kernel's tail instead of following it. Before the wait a
kernel reads only what no kernel of the step writes, so the order of reads and
writes is the stream's: weights (a GEMV asks L2 for the start of its weight
rows first, ``prefetch_rows_l2``, so the bytes stream in while the
latency-bound kernels ahead of it -- norm, RoPE, attention -- run) and the
step's inputs, written before it starts (positions, cache locations: the RoPE
kernel loads them early).
Every kernel waits before it finishes, so when a kernel passes its wait, every kernel before it in
the stream has finished, not only the one right ahead: the push all-reduce relies on that (its GEMV
reads the slot the all-reduce two kernels back advanced). A kernel that finished before its wait
would break it. A kernel without ``USE_PDL`` is launched the ordinary way.

Measured and removed: letting the next kernel launch before this one waits (so two kernels ahead
could prefetch while one runs) made Llama-3-8B decode slower on one H200 (Triton 3.6, 2026-11-30):
batch 1 4.74 against 4.26 ms, batch 8 5.83 against 5.00, fp8 batch 1 3.20 against 3.02. Kept in one place
(``pdl_enter_early``): the decode attention's last kernel (the merge, or the split kernel alone with one
split), when the GEMV after it loads its whole weight tiles before its wait (the compiler's
``early_launch_o_proj``); there the kernels ahead are latency-bound and HBM is otherwise idle. The RMSNorm-quantize kernels doing the same (so the qkv and gate/up GEMVs
launched during the GEMV ahead of them) took 2.691 against 2.521 ms (fp8 batch 1, 2026-12-01).

What a kernel may read before its wait is declared on the kernel (``reads_before_wait``) and checked in its
PTX when the build compiles it (``mxc.codegen.pdl_check``): a load, store or atomic on any other pointer
argument before ``griddepcontrol.wait``, or an exit ahead of it, fails the build. The check came with a race it found: the decode
split kernel loaded q, which the RoPE kernel right ahead writes, before its wait (2026-12-01 to 2026-12-02).
"""

import triton
import triton.language as tl

from mxc.kernels.launch import next_pow2


def reads_before_wait(*names: str):
    """Declare the pointer arguments a PDL kernel reads before ``griddepcontrol.wait``: memory no kernel of the
    step writes (weights, the step's inputs copied in before it starts). Put it above ``@triton.jit``; the
    build's PTX check (``mxc.codegen.pdl_check``) refuses any other argument touched before the wait."""

    def mark(fn):
        unknown = sorted(set(names) - set(fn.arg_names))
        if unknown:
            raise ValueError(f"reads_before_wait: {fn.__name__} has no argument {', '.join(unknown)}")
        fn.reads_before_wait = frozenset(names)
        return fn

    return mark


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter_early(USE_PDL: tl.constexpr):
    """``pdl_enter`` with the next kernel let launch first, before this one waits: for a latency-bound
    kernel whose successor has bytes to stream that no kernel of the step writes (weights), so they
    stream while the kernels ahead run. Safe for the stream order: the successor still passes its own
    wait only once this kernel has finished, which is after this kernel's wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(w_ptr, rows, k_start, K: tl.constexpr, BYTES: tl.constexpr):
    """Ask L2 for the first ``BYTES`` bytes (from column ``k_start``) of weight rows ``rows`` [R] of a
    row-major [N, K] matrix: one prefetch per 128-byte line (2048: 16 lines, 1024 bf16 or 2048 e4m3
    columns). A GEMV calls it before ``pdl_enter``: weights are never written by the kernel ahead, so
    they may stream in while it finishes, instead of after. How much pays was measured end to end
    (``triton_gemv.PREFETCH_BYTES``, ``triton_fp8_gemv.PREFETCH_BYTES``): a little; more is slower. A
    separate kernel prefetching the next GEMV's weights (``bench/prefetch_lab.py``) was slower at every
    size: the prefetches occupy HBM as loads do, and the small kernels between two GEMVs are too short
    to hide them. Nor did a larger share for the matrices that fit L2 pay (as many bytes a row as fit a
    16 or 32 MB budget for the whole matrix: o and down rows 4 KB or whole; 2026-12-01): fp8 batch 1
    2.825 / 2.900 ms against 2.736, bf16 4.166 / 4.292 against 4.115. Nor a prefetch every 32 bytes (a sector)
    instead of every 128 (2026-12-03, fp8 / bf16 batch 1): at the same bytes 2.491 / 4.057 ms against 2.498 /
    4.048; at a quarter and half of them 2.503 / 4.015 and 2.500 / 4.025 (``bench/prefetch_lab.py --resident``: a
    GEMV gains the same from either, and about half of what the same bytes read by plain loads give it)."""
    ELEM: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    cols = tl.minimum(k_start + tl.arange(0, BYTES // 128) * (128 // ELEM), K - 1)  # never past the row
    prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line of each address in ``ptrs`` (a hint: nothing is read into registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(want: int, row_bytes: int) -> int:
    """A GEMV's PREFETCH constexpr: ``want`` bytes a row (0: none) capped at the row, a power of two >= 128."""
    return 0 if want <= 0 else max(128, min(want, next_pow2(row_bytes)))
