"""The persistent fp8 MLP pair of batch-1..8 decode: the contract, its CUDA library, the call.

One launch of ``csrc/mlp_pair_fp8.cu`` replaces four (the gate/up GEMV, SiLU-and-mul, the down input's
quantize, the down GEMV with the residual). Given the gate/up input quantized per token (xq [M, H] e4m3 and
xs [M] fp32, as the RMSNorm-quantize kernel writes them), w_gu [2I, H] e4m3 (gate rows, then up rows) with
one fp32 scale a row s_gu [2I], w_d [H, I] e4m3 with s_d [H], and a bf16 residual [M, H], it computes

    y = residual + qlinear(silu_mul(qlinear(x, w_gu, s_gu)), w_d, s_d)        (``reference``)

(``rms_norm_pair``: from x [M, H] bf16 and an RMSNorm weight, the RMSNorm and the quantize in the kernel too,
one launch for five; ``reference_rms_norm``) in today's numerics: each product scaled as ``acc * xs * s`` and
rounded to bf16, SiLU with an IEEE division rounded to bf16, the product rounded, h quantized per token with
the Triton quantize's scale (``max(amax / 448, 1e-12)``, saturating e4m3), the residual added and rounded.
Two things differ from the kernel chain, so a launch is deterministic but not bitwise equal to it: the fp32
summation orders (32-column mma steps, four column quarters summed in a fixed order; the RMSNorm's sum of
squares), and the quantizes multiply by the scale's correctly rounded reciprocal instead of dividing (an e4m3
value can land one step apart where x / s sits on a rounding boundary).

Why one launch: at batch 1 the step's time above its weight bytes sits at kernel boundaries
(``docs/persistent_decode.md``, ``bench/ablate.py``). Here a producer warp in each CTA streams weight chunks
into a shared-memory ring and runs ahead across the gate/up -> down boundary while the consumers wait for the
other CTAs' h; the SiLU and the quantize move into the epilogue and the down stage's prologue. It is step 1 of
that plan.

Limits (``supports``): 1 <= M <= 8, H and I multiples of 1024, bf16 activations and residual, one weight scale
a row (channel or tensor granularity); sm_90a (mma.sync e4m3, bulk copies, mbarriers) with every CTA resident
(``plan``). A workspace (``Workspace``: h, two counters and the per-token amax, which the kernel leaves at zero)
is shared by every layer of a step.

Builds use it only when asked: ``mxc build --mlp-pair`` (``fuse_mlp`` makes each layer's MLP one
``rms_norm_mlp`` op; ``cuda_ops.rms_norm_mlp_pair`` runs it at <= 8 tokens through ``use``/``active`` and the
process's ``workspace``). Status (H200, 2026-12-01): correct (``tests/gpu/test_mlp_pair_fp8_gpu.py``, against
``reference`` and the Triton chain) and slower than the chain (``bench/mlp_pair_lab.py``, 32 layers' weights in
a CUDA graph: 58.8 against 54.3 us a layer at batch 1, 102 against 56 at batch 8; why, and what a design that
pays needs: ``docs/persistent_decode.md``, "Step 1, measured"), so builds leave it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mxc.kernels import fp8_ref, nvcc, torch_ref

SOURCE = Path(__file__).parent / "csrc" / "mlp_pair_fp8.cu"
PREBUILT_ENV = "MXC_MLP_PAIR_LIBRARY"
MAX_M = 8
KT = 1024  # weight bytes of a row in one ring stage: H and I are multiples of it
UP_ROWS, DOWN_ROWS = 16, 32  # rows of a gate/up unit (of gate, and as many of up) and of a down unit
STATUS = {0: "ok", 1: "unsupported shape (1 <= M <= 8, H and I multiples of 1024)",
          2: "a pointer is not 16-byte aligned", 3: "the ring does not fit shared memory or a CTA cannot be resident",
          4: "CUDA error"}
FP8 = torch.float8_e4m3fn


LIBRARY = "code/mlp_pair/mlp_pair_fp8.so"  # where an artifact keeps its library


def available() -> str | None:
    """None when a build here can have the library (``$MXC_MLP_PAIR_LIBRARY`` names one, or nvcc is found),
    else a one-line reason."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        return None if Path(prebuilt).is_file() else f"${PREBUILT_ENV}={prebuilt} is not a file"
    return None if nvcc.find() else "nvcc not found (set CUDA_HOME or put nvcc on PATH)"


def source() -> str:
    return SOURCE.read_text()


def library(out_path=None, log=print) -> Path:
    """The compiled library (nvcc, about 5 s), cached by the source's hash, or the prebuilt one
    ``$MXC_MLP_PAIR_LIBRARY`` names (for a machine without nvcc); copied to ``out_path`` if given."""
    return nvcc.cached_library("fp8 MLP pair", "mlp_pair", source,
                               lambda text, path: nvcc.compile_so(text, path, what="fp8 MLP pair kernel"),
                               PREBUILT_ENV, out_path, log)


def library_source() -> str:
    """What ``library`` ships, for the manifest: the source's sha256, or "prebuilt" (``$MXC_MLP_PAIR_LIBRARY``)."""
    return "prebuilt" if os.environ.get(PREBUILT_ENV) else hashlib.sha256(source().encode()).hexdigest()


def supports(M: int, H: int, I: int) -> str | None:  # noqa: E741  (I: the intermediate size, as in the configs)
    """None when the kernel takes the shape, else why not (the library's own check, mirrored without it)."""
    if not 1 <= M <= MAX_M:
        return f"{M} tokens (the kernel takes 1 to {MAX_M})"
    if H % KT or I % KT:
        return f"hidden {H} and intermediate {I} must be multiples of {KT}"
    return None


@dataclass
class Workspace:
    """What the kernel writes between its stages; one serves every layer of a step (launches are ordered)."""

    h: torch.Tensor     # [MAX_M, I] bf16: silu(gate) * up
    sync: torch.Tensor  # [2 + MAX_M] int32, zero: CTAs past gate/up, CTAs done, each token's amax(|h|) (float
    # bits, folded in by atomic max); the kernel leaves it zero

    @classmethod
    def new(cls, I: int, device) -> "Workspace":  # noqa: E741
        return cls(torch.empty((MAX_M, I), dtype=torch.bfloat16, device=device),
                   torch.zeros(2 + MAX_M, dtype=torch.int32, device=device))


class MlpPairFp8:
    """The compiled library opened with ctypes."""

    def __init__(self, so_path):
        self.path = Path(so_path)
        lib = ctypes.CDLL(str(self.path))
        p, i, ip = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
        lib.mxc_mlp_pair_fp8.argtypes = [p] * 4 + [ctypes.c_float] + [p] * 8 + [i] * 6 + [p]
        lib.mxc_mlp_pair_fp8.restype = i
        lib.mxc_mlp_pair_fp8_plan.argtypes = [i, i, i, ip, ip]
        lib.mxc_mlp_pair_fp8_plan.restype = i
        lib.mxc_mlp_pair_fp8_schedule.argtypes = [i, i, i, ip, ip]
        lib.mxc_mlp_pair_fp8_schedule.restype = i
        lib.mxc_mlp_pair_fp8_smem.argtypes = [i, i, i, i]
        lib.mxc_mlp_pair_fp8_smem.restype = i
        lib.mxc_mlp_pair_fp8_supports.argtypes = [i, i, i]
        lib.mxc_mlp_pair_fp8_supports.restype = i
        lib.mxc_mlp_pair_fp8_error.argtypes = []
        lib.mxc_mlp_pair_fp8_error.restype = ctypes.c_char_p
        self._lib = lib
        self._plans: dict[tuple[int, int, int], tuple[int, int]] = {}

    def _check(self, status: int, what: str) -> None:
        if status:
            detail = f": {self._lib.mxc_mlp_pair_fp8_error().decode()}" if status == 4 else ""
            raise RuntimeError(f"fp8 MLP pair {what}: status {status}, {STATUS.get(status, 'unknown')}{detail}")

    def supports(self, M: int, H: int, I: int) -> bool:  # noqa: E741
        return self._lib.mxc_mlp_pair_fp8_supports(M, H, I) == 0

    def smem(self, M: int, H: int, I: int, stages: int) -> int:  # noqa: E741
        return int(self._lib.mxc_mlp_pair_fp8_smem(M, H, I, stages))

    def schedule(self, G: int, H: int, I: int) -> tuple[list[int], list[int]]:  # noqa: E741
        """The CTA (of G) that runs each gate/up unit (I / 16) and each down unit (H / 32)."""
        up = (ctypes.c_int * (I // UP_ROWS))(*([-1] * (I // UP_ROWS)))
        down = (ctypes.c_int * (H // DOWN_ROWS))(*([-1] * (H // DOWN_ROWS)))
        self._check(self._lib.mxc_mlp_pair_fp8_schedule(G, H, I, up, down), f"schedule (G={G}, H={H}, I={I})")
        return list(up), list(down)

    def plan(self, M: int, H: int, I: int) -> tuple[int, int]:  # noqa: E741
        """(ring stages, CTAs) on the current device; call it before capturing a graph (it sets the kernel's
        shared-memory limit). Cached per shape."""
        key = (M, H, I)
        if key not in self._plans:
            stages, ctas = ctypes.c_int(0), ctypes.c_int(0)
            self._check(self._lib.mxc_mlp_pair_fp8_plan(M, H, I, ctypes.byref(stages), ctypes.byref(ctas)),
                        f"plan (M={M}, H={H}, I={I})")
            self._plans[key] = (stages.value, ctas.value)
        return self._plans[key]

    def __call__(self, xq, xs, w_gu, s_gu, w_d, s_d, residual, out, ws: Workspace, **launch) -> torch.Tensor:
        """``out`` = the pair from the quantized gate/up input (see the module); ``out`` may be ``residual``.
        ``launch``: ``pdl``, ``stream`` and the tests' ``ctas``/``stages`` (``_launch``)."""
        _check_operands(xq, xs, None, None, w_gu, s_gu, w_d, s_d, residual, out, ws)
        return self._launch(xq, xs, None, None, 0.0, w_gu, s_gu, w_d, s_d, residual, out, ws, **launch)

    def rms_norm_pair(self, x, norm_weight, eps: float, w_gu, s_gu, w_d, s_d, residual, out, ws: Workspace,
                      **launch) -> torch.Tensor:
        """``out`` = the pair from x [M, H] bf16: its RMSNorm (``norm_weight`` [H] bf16, ``eps``) and per-token
        quantize run in the kernel too (``reference_rms_norm``); ``out`` may be ``residual`` (usually x)."""
        _check_operands(None, None, x, norm_weight, w_gu, s_gu, w_d, s_d, residual, out, ws)
        return self._launch(None, None, x, norm_weight, eps, w_gu, s_gu, w_d, s_d, residual, out, ws, **launch)

    def _launch(self, xq, xs, x, norm_weight, eps, w_gu, s_gu, w_d, s_d, residual, out, ws, *, pdl: bool = False,
                stream: int | None = None, ctas: int | None = None, stages: int | None = None):
        """``ctas``/``stages``: fewer CTAs or ring stages than the plan's (tests: one CTA has no other CTA to wait
        for, two stages wrap the ring most often), else the plan."""
        H, I = w_d.shape  # noqa: E741
        M = out.shape[0]
        plan_stages, plan_ctas = self.plan(M, H, I)
        if not (ctas is None or 1 <= ctas <= plan_ctas) or not (stages is None or 2 <= stages <= plan_stages):
            raise ValueError(f"fp8 MLP pair: ctas {ctas} / stages {stages} outside the plan's 1..{plan_ctas} / "
                             f"2..{plan_stages}")
        stages, ctas = stages or plan_stages, ctas or plan_ctas
        if stream is None:
            stream = torch.cuda.current_stream(out.device).cuda_stream

        def ptr(t):
            return None if t is None else t.data_ptr()

        status = self._lib.mxc_mlp_pair_fp8(
            ptr(xq), ptr(xs), ptr(x), ptr(norm_weight), float(eps), w_gu.data_ptr(), s_gu.data_ptr(), w_d.data_ptr(),
            s_d.data_ptr(), ptr(residual), out.data_ptr(), ws.h.data_ptr(), ws.sync.data_ptr(), M, H, I, stages,
            ctas, int(pdl), stream or None)
        self._check(status, f"launch (M={M}, H={H}, I={I})")
        return out


def _check_operands(xq, xs, x, norm_weight, w_gu, s_gu, w_d, s_d, residual, out, ws: Workspace) -> None:
    M, H = (xq if norm_weight is None else x).shape
    I = w_d.shape[1]  # noqa: E741
    why = supports(M, H, I)
    if why:
        raise ValueError(f"fp8 MLP pair: {why}")
    if norm_weight is None:
        expect = [("xq", xq, (M, H), FP8), ("xs", xs, (M,), torch.float32)]
    else:
        expect = [("x", x, (M, H), torch.bfloat16), ("norm_weight", norm_weight, (H,), torch.bfloat16)]
    device = out.device
    expect += [("w_gu", w_gu, (2 * I, H), FP8),
              ("s_gu", s_gu, (2 * I,), torch.float32), ("w_d", w_d, (H, I), FP8), ("s_d", s_d, (H,), torch.float32),
              ("out", out, (M, H), torch.bfloat16), ("workspace h", ws.h, (MAX_M, I), torch.bfloat16),
              ("workspace sync", ws.sync, (2 + MAX_M,), torch.int32)]
    if residual is not None:
        expect.append(("residual", residual, (M, H), torch.bfloat16))
    for name, t, shape, dtype in expect:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
            raise ValueError(f"fp8 MLP pair: {name} must be contiguous {list(shape)} {dtype} on {device}, got "
                             f"{list(t.shape)} {t.dtype} on {t.device}")


@functools.lru_cache(maxsize=None)
def load(so_path) -> MlpPairFp8:
    return MlpPairFp8(so_path)


_ACTIVE: list[MlpPairFp8] = []
_WORKSPACES: dict[tuple[int, str], Workspace] = {}


def use(so_path) -> MlpPairFp8:
    """Open an artifact's library for the runtime (``active``); every build's library computes the same function."""
    pair = load(str(so_path))
    _ACTIVE[:] = [pair]
    return pair


def active() -> MlpPairFp8:
    if not _ACTIVE:
        raise RuntimeError(f"no fp8 MLP pair library is loaded: the artifact's forward calls cuda_ops.rms_norm_mlp_pair "
                           f"but mxc.load found no {LIBRARY} in it")
    return _ACTIVE[0]


def workspace(I: int, device) -> Workspace:  # noqa: E741
    """The process's workspace for intermediate size I on ``device``, shared by every layer and step (launches on
    one stream are ordered); made by the first, eager, call, before any graph is captured."""
    key = (I, str(device))
    if key not in _WORKSPACES:
        _WORKSPACES[key] = Workspace.new(I, device)
    return _WORKSPACES[key]


def reference(xq, xs, w_gu, s_gu, w_d, s_d, residual=None) -> torch.Tensor:
    """The pair in torch (``fp8_ref``'s numerics): bf16 [M, H]."""
    x = xq.float() * xs[:, None]
    gate_up = (x @ fp8_ref.dequantize_weight(w_gu, s_gu, "channel").t()).to(torch.bfloat16)
    h = torch_ref.silu_mul(gate_up)
    return fp8_ref.qlinear(h, w_d, s_d, residual=residual)


def reference_rms_norm(x, norm_weight, eps, w_gu, s_gu, w_d, s_d, residual=None) -> torch.Tensor:
    """``rms_norm_pair`` in torch: the RMSNorm (``torch_ref.rms_norm``) and per-token quantize, then ``reference``."""
    xq, xs = fp8_ref.quantize_rows(torch_ref.rms_norm(x, norm_weight, eps))
    return reference(xq, xs, w_gu, s_gu, w_d, s_d, residual)
