"""The per-token activation quantization of the fp8 linears, and what their kernels share.

Both kernels compute ``xs = max(amax(|a|) / 448, 1e-12)`` and ``xq = e4m3(a / xs)`` of each row ``a``
of x, of ``silu(gate) * up`` (``PROLOGUE_SILU_MUL``; x's gate and up columns in halves, or with
``PAIR_BLOCK`` B in blocks of B gate then B up columns, ``triton_elementwise.check_interleave``) or of
``rms_norm(x, g, eps)`` (``PROLOGUE_RMS_NORM``), bit for bit alike; ``_prequantize`` launches one of them:

- ``_quant_rows_kernel`` (decode, M <= 32; K > 16K): one program a row, sized for a few rows.
- ``_quant_tile_kernel`` (M >= 33, K <= 16K; the prefill GEMM's input). At large M the rows kernel
  ran ~3x off the bytes' floor: at K = 14336 under SiLU its 16 warps need 96 registers, so one
  program (one row) an SM, loads, the exps and two ``div.rn`` an element (branchy sequences; the
  SiLU's is now ``div.full``, see ``_load_act``)
  serialised; the last 2048 of its 16384 lanes idle. The tiled kernel reads each input byte once
  and writes each output byte once (bytes a row: K*s in, or 2K*s under SiLU, + K + 4 out, s = x's
  element size; the norm weight from L2 once a program) and cuts registers and instructions: K is
  split into at most three power-of-two pieces (14336 = 8192 + 4096 + 2048, only the last one
  masked); each piece is held in registers in x's dtype (exact: every prologue rounds to it; bf16
  pairs in one register) until the amax is known: 63 registers at K = 14336 (83 holding fp32), two
  programs an SM, one loading while the other computes. The quantization uses ``y = div_rn(1, xs)`` once a row and
  ``q = x * y`` plus two Markstein fma corrections, the correctly rounded ``x / xs`` without a
  branch (``_quant_recip``). Small K: BLOCK_M rows a program (4096 elements). RMSNorm keeps the
  rows kernel's per-row layout and warps (one row a program), hence its sum of squares.

Measured and removed (H200, 2026-12-03, ``bench/silu_gemm_lab.py`` at commit 71b6985, M = 2048, K = 14336): the
SiLU-and-mul quantize with a row's column blocks in programs that wait for the row's maximum took 55.8 us against
the tiled kernel's 59.7 (the SiLU's arithmetic, not the held row, is what it spends above its bytes); a Triton
gate/up GEMM with SiLU-and-mul in its epilogue (h and its row maxima out, then a 27 us quantize) lost more in the
GEMM (442 against CUTLASS's 363 us) than it saved here.

``quantize_max`` quantizes rows whose maxima an earlier kernel found (the SiLU-pair GEMM's epilogue stores h
and per-tile maxima of |h|): ``_quant_max_kernel`` runs a row's column blocks in parallel, the same values.

The Triton helpers (activation load with the prologue, row scale, quantization, the reference's
epilogue) and the input checks serve ``triton_fp8_gemv`` and ``triton_fp8_gemm``. Semantics and
numerics: ``mxc.kernels.triton_fp8``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mxc.kernels import triton_elementwise
from mxc.kernels.launch import cdiv, check_operand, launch, next_pow2
from mxc.kernels.pdl import pdl_enter
from mxc.kernels.triton_elementwise import _gate_col, _silu_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("channel", "tensor", "block128")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Triton runs an e4m3 x e4m3 -> fp32 tl.dot on sm_90 as wgmma accumulating in the tensor cores' own accumulator,
# which keeps fewer bits than fp32 (DeepSeek-V3's report, section 3.3.2: about 14), over the whole K unless the
# dot's ``max_num_imprecise_acc`` says otherwise (its default there: 2**30), as CUTLASS's FP8FastAccum and
# torchao's fp8 inference run. FP8_ACC_PROMOTE = N > 0 makes the fp8 GEMV and GEMM add their sums into fp32
# every N elements of K (at least once a dot: their ``PROMOTE_ACC``, ``_dot_e4m3``); measured in
# docs/perf.md (bench/fp8_accum_lab.py): at N = BLOCK_K the GEMVs 2-10% slower, the GEMM 36%, so 0 (never).
# At N = 32 (every wgmma) the float32 mean error is 4.6e-5 at any K: the tensor cores round within one wgmma too.
# The wrappers read it at each launch: an artifact built under N > 0 holds those binaries only, and runs with N set.
FP8_ACC_PROMOTE = 0


@triton.jit
def _load_act(x_ptrs, mask, other, UP: tl.constexpr, PROLOGUE_SILU_MUL: tl.constexpr):
    """A chunk of the (post-prologue) activation rows as fp32 values of x's dtype. With
    PROLOGUE_SILU_MUL, ``x_ptrs`` point at gate columns of x [M, 2K], each one's up column UP further
    (K: the halves layout; B: blocks of B gate then B up columns, ``_act_cols``), and the chunk is
    ``silu(gate) * up`` rounded as ``torch_ref.silu_mul``; masked lanes give 0. For a 16-bit x the
    sigmoid's division is Triton's fp32 division, approximate on the GPU as its exp is (``div.full.f32``,
    within 2 ulp, far below the rounding to x's dtype; exact in the interpreter): the IEEE division cost
    the prefill's down quantize 63.6 against 56.7 us at 2048 x 14336 bf16 and changed none of its 29M
    e4m3 values (H200, 2026-12-01, sixteenth run in docs/perf.md). fp32 x keeps the IEEE division."""
    if PROLOGUE_SILU_MUL:
        ty = x_ptrs.dtype.element_ty
        gate = tl.load(x_ptrs, mask=mask, other=other).to(tl.float32)
        up = tl.load(x_ptrs + UP, mask=mask, other=other).to(tl.float32)
        return _silu_mul(gate, up, ty).to(tl.float32)
    else:
        return tl.load(x_ptrs, mask=mask, other=other).to(tl.float32)


@triton.jit
def _act_cols(c, PAIR_BLOCK: tl.constexpr):
    """The columns of x holding activation columns ``c`` (under SiLU-and-mul, their gate columns): c itself
    (no prologue, or the gate half of [gate | up]), or with PAIR_BLOCK their place among blocks of PAIR_BLOCK
    gate then PAIR_BLOCK up columns."""
    if PAIR_BLOCK:
        return _gate_col(c, PAIR_BLOCK)
    else:
        return c


@triton.jit
def _chunk(x_ptrs, k, PAIR_BLOCK: tl.constexpr):
    """``x_ptrs`` (to activation columns offs_k, ``_act_cols``) moved to the chunk at column k: k further, or
    2k with interleaved gate/up blocks (k a multiple of PAIR_BLOCK: whole blocks of x precede the chunk)."""
    if PAIR_BLOCK:
        return x_ptrs + 2 * k
    else:
        return x_ptrs + k


@triton.jit
def _dot_e4m3(a, b, acc, PROMOTE: tl.constexpr):
    """``acc + a @ b`` of e4m3 tiles (``acc`` None: zeros), ``acc`` riding in the tensor cores' accumulator; with
    ``PROMOTE`` (at most the tiles' K) the products are summed apart ``PROMOTE`` elements of K at a time, each sum
    then added to ``acc`` in fp32 (as cuBLASLt's default fp8 GEMM and DeepGEMM do every 128)."""
    if PROMOTE:
        return tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
    else:
        return tl.dot(a, b, acc)


def promote_acc(block_k: int) -> dict:
    """The ``PROMOTE_ACC`` constexpr of an fp8 GEMV or GEMM launch with K tiles of ``block_k`` under
    ``FP8_ACC_PROMOTE`` (none at 0, leaving the binaries as they were)."""
    return {"PROMOTE_ACC": min(FP8_ACC_PROMOTE, block_k)} if FP8_ACC_PROMOTE else {}


@triton.jit
def _row_scale(amax):
    """Per-token scale from the row's amax: ``max(amax / 448, 1e-12)`` (IEEE division)."""
    return tl.maximum(tl.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _quant(x, xs):
    """fp32 values -> e4m3: ``clamp(x / xs, -448, 448)`` rounded to nearest even."""
    q = tl.div_rn(x, xs)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q.to(tl.float8e4nv)


@triton.jit
def _finish(acc, y_ptr, b_ptr, r_ptr, offs, offs_n, n_ok, mask,
            HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The reference's epilogue on acc [rows, cols] (fp32, scaled): round to y's dtype, then
    ``+ bias`` rounded, then ``residual +`` rounded; store."""
    ty = y_ptr.dtype.element_ty
    y = acc.to(ty)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + b[None, :]).to(ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(ty)
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _quant_rows_kernel(x_ptr, xq_ptr, xs_ptr, g_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       PROLOGUE_SILU_MUL: tl.constexpr, PROLOGUE_RMS_NORM: tl.constexpr = False,
                       USE_PDL: tl.constexpr = False, PAIR_BLOCK: tl.constexpr = 0):
    """One program per row: xs[row] = max(amax(|a|) / 448, 1e-12) and xq[row] = e4m3(a / xs)
    where a is the row of x (or silu(gate) * up of x [M, 2K], its gate and up halves or with PAIR_BLOCK its
    blocks of PAIR_BLOCK gate then PAIR_BLOCK up columns; or with PROLOGUE_RMS_NORM
    ``torch_ref.rms_norm(x, g, eps)``, rounded as it is). One pass (the row held in registers)
    when BLOCK_K >= K, else two passes over the row (no norm then)."""
    pdl_enter(USE_PDL)
    tl.static_assert(not PROLOGUE_RMS_NORM or (BLOCK_K >= K and not PROLOGUE_SILU_MUL))
    if PAIR_BLOCK:  # chunks of whole blocks (``_chunk``)
        tl.static_assert(PROLOGUE_SILU_MUL and BLOCK_K % PAIR_BLOCK == 0)
    X_STRIDE: tl.constexpr = 2 * K if PROLOGUE_SILU_MUL else K
    UP: tl.constexpr = PAIR_BLOCK if PAIR_BLOCK else K
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row * X_STRIDE + _act_cols(offs_k, PAIR_BLOCK)
    if BLOCK_K >= K:
        k_ok = offs_k < K
        a = _load_act(x_ptrs, k_ok, 0.0, UP, PROLOGUE_SILU_MUL)
        if PROLOGUE_RMS_NORM:  # HF's RMSNorm: normalised row rounded to the dtype, times the weight, rounded
            ty = x_ptr.dtype.element_ty
            rstd = tl.rsqrt(tl.sum(a * a, axis=0) / K + eps)
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = (g * (a * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        xs = _row_scale(tl.max(tl.abs(a), axis=0))
        tl.store(xs_ptr + row, xs)
        tl.store(xq_ptr + row * K + offs_k, _quant(a, xs), mask=k_ok)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = _load_act(_chunk(x_ptrs, k, PAIR_BLOCK), None, None, UP, PROLOGUE_SILU_MUL)
            else:
                a = _load_act(_chunk(x_ptrs, k, PAIR_BLOCK), (k + offs_k) < K, 0.0, UP, PROLOGUE_SILU_MUL)
            amax = tl.maximum(amax, tl.abs(a))
        xs = _row_scale(tl.max(amax, axis=0))
        tl.store(xs_ptr + row, xs)
        q_ptrs = xq_ptr + row * K + offs_k
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = _load_act(_chunk(x_ptrs, k, PAIR_BLOCK), None, None, UP, PROLOGUE_SILU_MUL)
                tl.store(q_ptrs + k, _quant(a, xs))
            else:
                k_ok = (k + offs_k) < K
                a = _load_act(_chunk(x_ptrs, k, PAIR_BLOCK), k_ok, 0.0, UP, PROLOGUE_SILU_MUL)
                tl.store(q_ptrs + k, _quant(a, xs), mask=k_ok)


@triton.jit
def _quant_recip(x, nxs, y):
    """``_quant(x, xs)`` bit for bit without a division per element: with the row's ``y = div_rn(1, xs)``
    and ``nxs = -xs`` (0 where xs is inf, y = 0), ``q0 = x * y`` is within 2 ulps of x / xs and two
    Markstein corrections ``q += (x - q * xs) * y`` (fmas; the remainder is exact) round it
    correctly; a zero quotient takes q0's sign (x / xs's; inf rows: x * 0)."""
    q = x * y
    q = tl.fma(tl.fma(q, nxs, x), y, q)
    q = tl.fma(tl.fma(q, nxs, x), y, q)
    bits = (q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | (x.to(tl.uint32, bitcast=True) & 0x80000000)
    # clamp(q, -448, 448) as _quant's: the e4m3 conversion saturates above 448; a NaN (of a NaN x) goes to -448
    q = tl.maximum(bits.to(tl.float32, bitcast=True), -448.0)
    return q.to(tl.float8e4nv)


@triton.jit
def _hold(a, ty: tl.constexpr):
    """A piece of the (post-prologue) rows, exact in x's dtype, as held in registers until the scale is
    known, and its rows' amax. fp16: the amax of the held values (max.f16x2); bf16: of the fp32 ones
    (the interpreter holds bf16 as raw bits)."""
    if ty == tl.float32:
        return a, tl.max(tl.abs(a), axis=1)
    elif ty == tl.float16:
        h = a.to(ty)
        return h, tl.max(tl.abs(h), axis=1).to(tl.float32)
    else:
        return a.to(ty), tl.max(tl.abs(a), axis=1)


@triton.jit
def _unhold(h):
    """``_hold``'s values as fp32; bf16 by shifting the bits, not by an fpext that LLVM would merge with
    the one feeding the amax, keeping the fp32 values live across the reduction."""
    if h.dtype == tl.bfloat16:
        return (h.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return h.to(tl.float32)


@triton.jit
def _tile_offs(rows, k0, K: tl.constexpr, P: tl.constexpr):
    """Offsets of a [BLOCK_M, P] piece (columns k0..k0 + P) of rows ``rows`` of a row-major [M, K]."""
    return rows[:, None] * K + (k0 + tl.arange(0, P))[None, :]


@triton.jit
def _tile_mask(row_ok, k0, K: tl.constexpr, P: tl.constexpr, MASK_K: tl.constexpr):
    """The piece's mask: its rows (and, with MASK_K, its columns < K). Only built when a load or store
    is masked: a function returning None in a tuple does not compile in Triton 3.6."""
    if MASK_K:
        return row_ok[:, None] & ((k0 + tl.arange(0, P)) < K)[None, :]
    else:
        return row_ok[:, None]


@triton.jit
def _load_piece(x_ptr, rows, row_ok, k0, K: tl.constexpr, P: tl.constexpr, MASK_K: tl.constexpr,
                MASK_M: tl.constexpr, PROLOGUE_SILU_MUL: tl.constexpr, PAIR_BLOCK: tl.constexpr):
    if PAIR_BLOCK:  # x is [M, 2K] in blocks of PAIR_BLOCK gate then PAIR_BLOCK up columns
        offs = rows[:, None] * (2 * K) + _act_cols(k0 + tl.arange(0, P), PAIR_BLOCK)[None, :]
    else:
        offs = _tile_offs(rows, k0, K, P)
        if PROLOGUE_SILU_MUL:
            offs += rows[:, None] * K  # x is [M, 2K]: the gate half, the up half K further
    UP: tl.constexpr = PAIR_BLOCK if PAIR_BLOCK else K
    if MASK_K or MASK_M:
        return _load_act(x_ptr + offs, _tile_mask(row_ok, k0, K, P, MASK_K), 0.0, UP, PROLOGUE_SILU_MUL)
    else:
        return _load_act(x_ptr + offs, None, None, UP, PROLOGUE_SILU_MUL)


@triton.jit
def _store_piece(xq_ptr, h, nxs, y, rows, row_ok, k0, K: tl.constexpr, P: tl.constexpr,
                 MASK_K: tl.constexpr, MASK_M: tl.constexpr):
    q = _quant_recip(_unhold(h), nxs[:, None], y[:, None])
    offs = _tile_offs(rows, k0, K, P)
    if MASK_K or MASK_M:
        tl.store(xq_ptr + offs, q, mask=_tile_mask(row_ok, k0, K, P, MASK_K))
    else:
        tl.store(xq_ptr + offs, q)


@triton.jit
def _quant_tile_kernel(x_ptr, xq_ptr, xs_ptr, g_ptr, eps, M, K: tl.constexpr, BLOCK_M: tl.constexpr,
                       P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, PROLOGUE_SILU_MUL: tl.constexpr,
                       PROLOGUE_RMS_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                       PAIR_BLOCK: tl.constexpr = 0):
    """``_quant_rows_kernel``'s xq and xs, bit for bit, for BLOCK_M rows a program (large M), read once:
    the row is split into up to three power-of-two pieces P0 + P1 + P2 >= K (only the last one
    masked, so K = 14336 = 8192 + 4096 + 2048 wastes no lane), each piece loaded (the prologue
    applied), folded into the amax and held in registers in x's dtype (exact: every prologue rounds
    to it) until the scale is known, then quantized by ``_quant_recip`` and stored. With
    PROLOGUE_RMS_NORM, one piece (P0 = next_pow2(K)) and ``_quant_rows_kernel``'s warps: the same
    per-row layout, so the same sum of squares. PAIR_BLOCK: the SiLU's gate and up columns in blocks of
    PAIR_BLOCK gate then PAIR_BLOCK up columns, as ``_quant_rows_kernel``'s."""
    pdl_enter(USE_PDL)
    tl.static_assert(P0 > 0 and P0 + P1 + P2 >= K and (not PROLOGUE_RMS_NORM or (P1 == 0 and not PROLOGUE_SILU_MUL)))
    tl.static_assert(not PAIR_BLOCK or PROLOGUE_SILU_MUL)
    ty: tl.constexpr = x_ptr.dtype.element_ty
    EVEN_K: tl.constexpr = P0 + P1 + P2 == K
    MASK_M: tl.constexpr = BLOCK_M > 1  # one program a row otherwise (grid M)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    a = _load_piece(x_ptr, rows, row_ok, 0, K, P0, not EVEN_K and P1 == 0, MASK_M, PROLOGUE_SILU_MUL, PAIR_BLOCK)
    if PROLOGUE_RMS_NORM:  # as _quant_rows_kernel (the same per-row layout: the same sum of squares)
        rstd = tl.rsqrt(tl.sum(a * a, axis=1) / K + eps)
        offs_k = tl.arange(0, P0)
        g = tl.load(g_ptr + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0).to(tl.float32)
        a = (g * (a * rstd[:, None]).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    h0, amax = _hold(a, ty)
    if P1 > 0:
        a = _load_piece(x_ptr, rows, row_ok, P0, K, P1, not EVEN_K and P2 == 0, MASK_M, PROLOGUE_SILU_MUL,
                        PAIR_BLOCK)
        h1, amax1 = _hold(a, ty)
        amax = tl.maximum(amax, amax1)
    if P2 > 0:
        a = _load_piece(x_ptr, rows, row_ok, P0 + P1, K, P2, not EVEN_K, MASK_M, PROLOGUE_SILU_MUL, PAIR_BLOCK)
        h2, amax2 = _hold(a, ty)
        amax = tl.maximum(amax, amax2)
    xs = _row_scale(amax)
    tl.store(xs_ptr + rows, xs, mask=row_ok)
    y = tl.div_rn(tl.full(xs.shape, 1.0, tl.float32), xs)
    nxs = tl.where(y == 0.0, 0.0, -xs)
    _store_piece(xq_ptr, h0, nxs, y, rows, row_ok, 0, K, P0, not EVEN_K and P1 == 0, MASK_M)
    if P1 > 0:
        _store_piece(xq_ptr, h1, nxs, y, rows, row_ok, P0, K, P1, not EVEN_K and P2 == 0, MASK_M)
    if P2 > 0:
        _store_piece(xq_ptr, h2, nxs, y, rows, row_ok, P0 + P1, K, P2, not EVEN_K, MASK_M)


@functools.lru_cache(maxsize=None)
def _quant_block(k: int) -> int:
    """The quantize kernel's chunk: the whole row up to 16K elements (one pass, no re-read)."""
    return min(16384, next_pow2(k))


def _quant_warps(block_k: int) -> int:
    """Warps of the quantize kernel: 32 elements a thread, 4 to 16 warps."""
    return max(4, min(16, block_k // 1024))


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_inputs(x, w, scale, bias, residual, granularity, prologue, out):
    """Validate; return (M, N, K, silu_mul)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if prologue not in (None, "silu_mul", "rms_norm"):
        raise ValueError(f"prologue must be None, 'silu_mul' or 'rms_norm', got {prologue!r}")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    silu_mul = prologue == "silu_mul"
    M, Kx = x.shape
    N, K = w.shape
    if Kx != (2 * K if silu_mul else K):
        raise ValueError(f"x has K={Kx} but w has K={K}" + (f" (silu_mul needs x [M, {2 * K}])" if silu_mul else ""))
    if M < 1 or N < 1 or K < 1:
        raise ValueError(f"empty linear: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    if w.dtype != FP8:
        raise ValueError(f"w must be {FP8}, got {w.dtype}")
    want = (N,) if granularity in ("channel", "tensor") else (cdiv(N, 128), cdiv(K, 128))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{granularity} scale must be float32 {list(want)}, got {scale.dtype} {list(scale.shape)}")
    for name, t in (("x", x), ("w", w), ("scale", scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} on {t.device} but x on {x.device}")
    for name, t, shape in (("bias", bias, (N,)), ("residual", residual, (M, N)), ("out", out, (M, N))):
        if t is not None:
            check_operand(name, t, shape, x.dtype, x.device)
    return M, N, K, silu_mul


def _check_norm(x, K, norm_weight):
    check_operand("the rms_norm prologue's norm_weight", norm_weight, (K,), x.dtype, x.device)


# _prequantize's rules. The tiled kernel wherever it fits (K <= TILED_MAX_K): from one row it beat one
# program a row, bit for bit alike (H200, Triton 3.6, 2026-11-30, ``bench/linear_lab.py --quant-lab --quant-m
# 1``, the four launches of a Llama-3-8B layer): 17.8 -> 13.6 us at M = 1, 18.5 -> 14.2 at M = 8.
# Up to SILU_KERNEL_MAX_M rows (decode), SiLU-and-mul runs first as its own kernel (a program per 1024
# columns: the exps and divisions spread over the GPU instead of one program a row), then the plain
# quantize: the fused SiLU took 6.3 us of the layer's 13.6 at M = 1.
TILED_MIN_M = 1
SILU_KERNEL_MAX_M = 32
TILED_MAX_K = 16384


def _pieces(k: int) -> tuple[int, int, int]:
    """K as up to three power-of-two pieces, the largest first, only the last one padded:
    14336 = 8192 + 4096 + 2048, 4096 = 4096, 1000 -> 512 + 256 + 256 (232 used)."""
    out, rem = [], k
    while rem and len(out) < 2:
        out.append(1 << (rem.bit_length() - 1))
        rem -= out[-1]
    if rem:
        out.append(next_pow2(rem))
    return tuple(out + [0] * (3 - len(out)))


@functools.lru_cache(maxsize=None)  # every fp8 linear of a forward asks: computed once a shape
def _tile_config(k: int, silu_mul: bool, rms_norm: bool) -> tuple[int, tuple[int, int, int], int]:
    """(BLOCK_M, pieces, warps) of ``_quant_tile_kernel``. RMSNorm: one row, one piece of next_pow2(K)
    and ``_quant_warps`` (``_quant_rows_kernel``'s layout, so its sum of squares). Otherwise rows for
    4096 elements a program, 32 elements a thread (16 under SiLU: its exps and divisions need the
    registers; at K = 14336, 16 warps of 28 elements fit 64 registers, two programs an SM)."""
    padded = next_pow2(k)
    if rms_norm:
        return 1, (padded, 0, 0), _quant_warps(padded)
    block_m = max(1, 4096 // padded)
    warps = max(4, min(16, block_m * padded // (512 if silu_mul else 1024)))
    return block_m, _pieces(k), warps


def _prequantize(x, M, K, silu_mul, block_k, norm_weight=None, eps=1e-6, tiled=None, interleave=0):
    """xq [M, K] e4m3 and xs [M] fp32 of x (or of silu(gate) * up of x [M, 2K]: its gate and up halves, or with
    ``interleave`` B blocks of B gate then B up columns, ``triton_elementwise.check_interleave``; the rows
    kernel's ``block_k`` then a multiple of B); with ``norm_weight``, of
    ``torch_ref.rms_norm(x, norm_weight, eps)``: in the same kernel when the row fits one pass
    (``block_k >= K``, K <= 16K), else after the RMSNorm kernel. ``tiled`` (default: by the rule
    below) picks the kernel, which does not change a bit of the result:
    - ``_quant_rows_kernel`` (one program a row, ``block_k`` its chunk): K > 16K, or an RMSNorm that
      needs two passes;
    - ``_quant_tile_kernel`` otherwise (from TILED_MIN_M rows); its binary depends on K, the prologue
      and the dtype only (M is dynamic), so one serves decode and every prefill bucket.
    By default (``tiled`` None) SiLU-and-mul at M <= SILU_KERNEL_MAX_M runs first as
    ``triton_elementwise.silu_mul`` (the same arithmetic: ``_load_act``'s silu rounded to the dtype, times
    up, rounded), then the plain quantize."""
    rms = norm_weight is not None
    fits = K <= TILED_MAX_K and (not rms or block_k >= K)
    _check_interleave(K, silu_mul, interleave)
    if tiled is None:
        tiled = M >= TILED_MIN_M and fits
        if silu_mul and tiled and M <= SILU_KERNEL_MAX_M:
            x, silu_mul, interleave = triton_elementwise.silu_mul(x, interleave=interleave), False, 0
    elif tiled and not fits:
        raise ValueError(f"the tiled quantize kernel needs K <= {TILED_MAX_K} (RMSNorm: block_k >= K), got "
                         f"K={K}, block_k={block_k}")
    if interleave and not tiled and block_k % interleave:
        raise ValueError(f"the quantize kernel's chunk must span whole gate/up blocks: block_k={block_k} is not a "
                         f"multiple of interleave={interleave}")
    # the halves layout passes no PAIR_BLOCK (0 by default): its binaries stay the kernels they were
    pair = {"PAIR_BLOCK": interleave} if interleave else {}
    if rms and block_k < K:
        from mxc.kernels import triton_norm

        x, norm_weight, rms = triton_norm.rms_norm(x, norm_weight, eps), None, False
    xq = torch.empty((M, K), dtype=FP8, device=x.device)
    xs = torch.empty((M,), dtype=torch.float32, device=x.device)
    if tiled:
        block_m, (p0, p1, p2), warps = _tile_config(K, silu_mul, rms)
        launch(_quant_tile_kernel, (cdiv(M, block_m),), [x, xq, xs, norm_weight, float(eps), M],
               dict(K=K, BLOCK_M=block_m, P0=p0, P1=p1, P2=p2, PROLOGUE_SILU_MUL=silu_mul, PROLOGUE_RMS_NORM=rms,
                    **pair), num_warps=warps, num_stages=1)
        return xq, xs
    launch(_quant_rows_kernel, (M,), [x, xq, xs, norm_weight, float(eps)],
           dict(K=K, BLOCK_K=block_k, PROLOGUE_SILU_MUL=silu_mul, PROLOGUE_RMS_NORM=rms, **pair),
           num_warps=_quant_warps(block_k), num_stages=1)
    return xq, xs


def _check_interleave(K, silu_mul, interleave):
    """``_prequantize``'s interleave: a gate/up layout of x [M, 2K] (``triton_elementwise.check_interleave``),
    only under SiLU-and-mul."""
    if interleave and not silu_mul:
        raise ValueError(f"interleave={interleave} is a layout of the SiLU-and-mul prologue's gate and up columns; "
                         f"there is no prologue")
    triton_elementwise.check_interleave(K, interleave)


@triton.jit
def _quant_max_kernel(h_ptr, pmax_ptr, xq_ptr, xs_ptr, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Columns [pid_k * BLOCK_K, +BLOCK_K) of row ``program_id(0)``: xq = e4m3(h / xs), xs = max(amax / 448, 1e-12)
    from the row's P partial maxima (the first column block stores xs). ``_quant_tile_kernel``'s values bit for bit
    (the same scale and ``_quant_recip``) where the maxima's max is amax(|h|)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    h = tl.load(h_ptr + row * K + offs_k, mask=k_ok, other=0.0)  # first: issued before the maxima's reduction
    offs_p = tl.arange(0, BLOCK_P)
    xs = _row_scale(tl.max(tl.load(pmax_ptr + row * P + offs_p, mask=offs_p < P, other=0.0), axis=0))
    if pid_k == 0:
        tl.store(xs_ptr + row, xs)
    y = tl.div_rn(1.0, xs)
    nxs = tl.where(y == 0.0, 0.0, -xs)
    tl.store(xq_ptr + row * K + offs_k, _quant_recip(h.to(tl.float32), nxs, y), mask=k_ok)


def quantize_max(h: torch.Tensor, pmax: torch.Tensor, block_k: int = 2048,
                 num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """xq [M, K] e4m3 and xs [M] fp32 of h [M, K] (fp32, fp16 or bf16) whose row maxima are already known:
    ``pmax`` [M, P] fp32 holds P partial maxima of |h| a row (column tiles; a GEMM epilogue's), the row's amax
    their max. Bit for bit ``_prequantize(h, M, K, False, _quant_block(K))`` where that max is amax(|h|). Its
    column blocks run in parallel (grid M x cdiv(K, ``block_k``)), none waiting for a row's maximum. Measured
    (H200, 2026-12-03, ``bench/silu_pair_lab.py`` at commit 3a76d78, M = 2048, K = 14336, bf16): 36.5 us, against
    76.8 for the quantize with the SiLU-and-mul prologue that it replaces after the pair GEMM (which stores h and
    pmax)."""
    if h.dim() != 2 or pmax.dim() != 2 or pmax.shape[0] != h.shape[0]:
        raise ValueError(f"quantize_max: expected h [M, K] and pmax [M, P], got {tuple(h.shape)} and "
                         f"{tuple(pmax.shape)}")
    (M, K), P = h.shape, pmax.shape[1]
    if M < 1 or K < 1 or P < 1:
        raise ValueError(f"quantize_max: empty h {tuple(h.shape)} or pmax {tuple(pmax.shape)}")
    if h.dtype not in _DTYPES or pmax.dtype != torch.float32:
        raise ValueError(f"quantize_max: h must be one of {_DTYPES} and pmax float32, got {h.dtype} and {pmax.dtype}")
    if not (h.is_contiguous() and pmax.is_contiguous()):
        raise ValueError("quantize_max: h and pmax must be contiguous")
    if pmax.device != h.device:
        raise ValueError(f"quantize_max: pmax on {pmax.device} but h on {h.device}")
    if not _pow2(block_k):
        raise ValueError(f"quantize_max: block_k must be a power of two, got {block_k}")
    xq = torch.empty((M, K), dtype=FP8, device=h.device)
    xs = torch.empty((M,), dtype=torch.float32, device=h.device)
    launch(_quant_max_kernel, (M, cdiv(K, block_k)), [h, pmax, xq, xs],
           dict(K=K, P=P, BLOCK_P=next_pow2(P), BLOCK_K=block_k), num_warps=num_warps, num_stages=1)
    return xq, xs
