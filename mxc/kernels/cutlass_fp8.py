"""CUTLASS fp8 GEMM with row-wise scales: generated with the CUTLASS Python interface, built AOT, run via ctypes.

Owns one kernel family, ``y[M, N] = bf16((xq[M, K] @ wq[N, K]^T) * scale_a[M, None] * scale_b[None, N])``,
and its variant with a residual, ``y = bf16(float(that y) + float(c[M, N]))`` (c bf16, read by the epilogue's
TMA: the prefill's residual add without a kernel of its own, rounded in the reference's order):
e4m3 operands (xq row-major, wq row-major [N, K], i.e. CUTLASS's "TN" layout), fp32 accumulation, fp32
scales (per token, per output channel) and bf16 row-major output -- what ``torch._scaled_mm(xq, wq.t(),
scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)`` computes, and what vLLM's
``scaled_mm_c3x`` sm90 kernel does.

- ``generate`` builds the two kernels with ``cutlass_cppgen`` (package ``nvidia-cutlass``): ``Gemm`` plans
  for sm90 with e4m3 x e4m3 -> bf16, an epilogue visitor tree traced from ``_scaled_epilogue``
  (``accum * scale_a`` as a column broadcast, ``* scale_b`` as a row broadcast, the last multiply
  converting to bf16; no C operand) or from ``_scaled_residual_epilogue`` (``+ C`` last, C bf16; the product
  rounded to bf16 before the add, ``_round_product_first``), and a
  TMA warp-specialized tile description; it emits each kernel's C++ (``op.rt_module.emit()``) in a
  namespace of its own and appends a hand-written ``extern "C"`` wrapper (``_WRAPPER``) that fills
  CUTLASS's argument structs and runs ``GemmUniversalAdapter``. No GPU is needed: the option
  registry is built for a fixed compute capability (90) instead of the device's. ``tile`` is one CTA's
  tile (vLLM's ``TileShape``); cutlass_cppgen 4.2 takes the whole cluster's tile and divides it by the
  cluster for the mainloop, but its sm90 EVT emitter declares the broadcasts with the undivided shape,
  so for clusters other than 1x1x1 that one declaration is corrected here (``_fix_evt_tile``).
- ``compile_so`` runs nvcc on that source into a shared library (``mxc.kernels.nvcc``: cudart linked
  statically, so the library needs only the driver, ``libcuda.so.1``, and no CUDA runtime or torch of a
  particular version).
- The library also holds the SiLU-pair kernels (``cutlass_silu_pair``, its C++ embedded in the source): the same
  mainloop over the fp8 MLP's gate/up weight with its rows interleaved in blocks of ``PAIR_BLOCK`` (half a CTA
  tile's columns), an epilogue that stores ``h = silu(gate) * up`` [M, N/2] bf16 and each row's maximum |h| per
  tile [M, N/128] instead of gate/up (``silu_pair``; the down projection's quantize then reads half the bytes and
  no SiLU: ``triton_fp8_quant.quantize_max``). Pingpong configurations only (the shipped ones).
- ``load`` opens the library with ctypes; ``CutlassFp8Gemm.__call__`` takes raw device pointers (a
  tensor's ``data_ptr()``), sizes and a stream handle, so the call path imports nothing from torch.
- ``build_library`` is what ``mxc build`` calls when ``select_kernels`` chose the CUTLASS GEMM: the
  ``BUILD_CONFIG`` kernels (a second pair for problems of at most ``small_m["max_m"]`` rows, which the entry
  points choose by M), compiled once and cached by the source's hash (or a prebuilt library named by
  ``$MXC_CUTLASS_LIBRARY``, for a build machine without the generator; ``none`` turns CUTLASS off), copied
  into the artifact;
  ``use`` opens an artifact's library at load and ``active`` is the one the runtime calls.

Importing ``cutlass_cppgen`` opens a sqlite cache (``compiled_cache.db``) in the working directory; the
import here happens inside a temporary directory so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
import threading
from pathlib import Path

from mxc.errors import typed_line
from mxc.kernels import cutlass_silu_pair, nvcc as nvcc_tool

ARCH_CC = 90
STATUS = {0: "ok", 1: "CUTLASS can_implement rejected the problem (M, N, K, alignment)",
          2: "workspace too small", 3: "CUTLASS initialize failed", 4: "kernel launch failed"}
# schedule name -> (kernel schedule, epilogue schedule) names of cutlass_library's enums; fast_accum adds FP8FastAccum
SCHEDULES = {"pingpong": ("TmaWarpSpecializedPingpong", "TmaWarpSpecialized"),
             "cooperative": ("TmaWarpSpecializedCooperative", "TmaWarpSpecializedCooperative")}
SCHEDULERS = {"default": "Default", "persistent": "Persistent", "streamk": "StreamK"}  # cutlass_cppgen's names

# The configuration builds use: vLLM's sm90 fp8 kernel (pingpong, 128x128x128 a CTA, clusters of 2x1x1, fast
# accumulation). On one H200 (2026-11-30, tests/gpu/test_cutlass_fp8_gpu.py, M = 2048): 1435 TFLOP/s at
# N, K = 6144, 4096 and 1462 at 4096, 14336, against torch._scaled_mm's 1316 and 1395; the cooperative
# 128x128x128 kernel without fast accumulation ran 1187 and 1284. Fast accumulation's error: 0.5-1% of the
# largest output against 0.2-0.3% (fp8 rounding of the inputs is several times more).
# Problems of at most 256 rows (prefills of 33-256 tokens, decode batches of 64-256) run a second pair of kernels,
# pingpong 64x128x128 a CTA, cluster 1x1x1, fast accumulation: the 128x128 tiles left most SMs idle there (an o
# projection at M = 64: 32 CTAs on 132 SMs). bench/cutlass_small_m_lab.py, one H200, 2026-12-01, the four GEMMs of a
# Llama-3-8B layer (us, L2 cleared): M = 64 105.7 against 159.9, M = 128 107.5 against 150.3, M = 256 125.4
# against 138.2, M = 512 203.9 against 194.5 (so not above 256); 64x64 tiles won at 64 and 128 rows (95.8-102.6)
# and lost at 256 (145.9); stream-K (cooperative 128x128 and 128x64) lost to 64x128 at every M (121.7-161.8).
# Larger tiles at M = 2048 (one H200, 2026-12-02; bench/cutlass_small_m_lab.py in bursts, then bench/decode_ab.py
# --prefill 2048 --prefill-only through LAB_LIBRARY, twelve interleaved rounds under sustained load): in bursts the
# down GEMM (K = 14336) ran 171.8-176.2 us with cooperative 128x256 or 256x128 tiles against 185.5, the other
# shapes within 3%; the sustained prefill did not move: 30.91 ms (shipped), 30.84 (256x128 for down only), 30.85
# (256x128 for all), 30.63 (128x256 for down), 30.39 (that and pingpong 128x128 cluster 1x2 for K = 4096), the
# rounds drifting over 30.0-31.3 as the GPU warmed. Under the power limit the tile shape does not set the rate.
BUILD_CONFIG = dict(tile=(128, 128, 128), cluster=(2, 1, 1), schedule="pingpong", fast_accum=True,
                    small_m=dict(tile=(64, 128, 128), cluster=(1, 1, 1), schedule="pingpong", fast_accum=True,
                                 max_m=256))
PAIR_BLOCK = BUILD_CONFIG["tile"][1] // 2  # the SiLU-pair kernels' gate/up interleave (compiler: interleave_gate_up)
LIBRARY = "code/cutlass/fp8_gemm.so"  # where an artifact keeps its library
PREBUILT_ENV = "MXC_CUTLASS_LIBRARY"

_import_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cppgen():
    """``cutlass_cppgen``, imported in a scratch directory and set up to generate sm90 kernels without a GPU."""
    nvcc = nvcc_tool.find()
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    with _import_lock, tempfile.TemporaryDirectory(prefix="mxc_cutlass_") as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)  # cutlass_cppgen.backend creates compiled_cache.db in the working directory at import
        try:
            import cutlass_cppgen
            from cutlass_cppgen.library_defaults import OptionRegistry
        finally:
            os.chdir(cwd)
        # the kernel generator filters kernels by toolkit version; cutlass_cppgen reads it from nvcc on PATH
        # only when it initialises a CUDA context, which this machine may not have
        if cutlass_cppgen._nvcc_version is None:
            cutlass_cppgen._nvcc_version = nvcc_tool.version(nvcc)
        if cutlass_cppgen._option_registry is None:  # normally built for the current device's compute capability
            cutlass_cppgen._option_registry = OptionRegistry(ARCH_CC)
    return cutlass_cppgen


def available() -> str | None:
    """None when a build here can have the CUTLASS library (``$MXC_CUTLASS_LIBRARY`` names a prebuilt one, or
    the generator, ``cutlass_cppgen``, and nvcc are usable), else a one-line reason."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt == "none":
        return f"turned off (${PREBUILT_ENV}=none)"
    if prebuilt:
        return None if Path(prebuilt).is_file() else f"${PREBUILT_ENV}={prebuilt} is not a file"
    return generator_available()


def generator_available() -> str | None:
    """None when this machine can generate and compile the library (``cutlass_cppgen`` and nvcc usable), whatever
    ``$MXC_CUTLASS_LIBRARY`` says, else a one-line reason."""
    if nvcc_tool.find() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    try:
        import cutlass_library  # noqa: F401  (ships with nvidia-cutlass, holds the CUTLASS headers)
    except ImportError:
        return "the CUTLASS Python interface is not installed (pip install nvidia-cutlass==4.2.0.0)"
    try:
        _cppgen()
    except Exception as e:  # noqa: BLE001  (any failure to set the generator up is a reason)
        return f"cutlass_cppgen cannot be set up: {typed_line(e)}"
    return None


def include_dirs() -> list[Path]:
    """CUTLASS's header directories inside the installed ``nvidia-cutlass`` package."""
    import cutlass_library
    root = Path(cutlass_library.source_path)
    return [root / "include", root / "tools" / "util" / "include"]


def _scaled_epilogue(accum, scale_a, scale_b):
    D = (accum * scale_a) * scale_b
    return D


def _scaled_residual_epilogue(accum, C, scale_a, scale_b):
    D = (accum * scale_a) * scale_b + C
    return D


def _epilogue_visitor(cg, residual: bool = False):
    """The EVT traced from ``_scaled_epilogue``: scale_a [M, 1] (column broadcast), scale_b [1, N] (row
    broadcast); ``residual``: from ``_scaled_residual_epilogue``, C [M, N] bf16 (the GEMM's source operand)."""
    DT, LT = cg.DataType, cg.LayoutType
    m, n = 256, 512  # example sizes: only the broadcast pattern and the element types reach the emitted code
    examples = {
        "accum": cg.Tensor(element=DT.f32, shape=(m, n), layout_tag=LT.RowMajor),
        "scale_a": cg.Tensor(element=DT.f32, shape=(m, 1), layout_tag=LT.RowMajor),
        "scale_b": cg.Tensor(element=DT.f32, shape=(1, n), layout_tag=LT.RowMajor),
        "D": cg.Tensor(element=DT.bf16, shape=(m, n), layout_tag=LT.RowMajor),
    }
    if residual:
        examples["C"] = cg.Tensor(element=DT.bf16, shape=(m, n), layout_tag=LT.RowMajor)
    fn = _scaled_residual_epilogue if residual else _scaled_epilogue
    return cg.epilogue.trace(fn, examples, cc=ARCH_CC)


def _schedule_name(cfg: dict) -> str:
    """The mainloop's kernel schedule (cutlass_library's enum name, ``cutlass::gemm::Kernel<name>`` in C++)."""
    return SCHEDULES[cfg.get("schedule", "cooperative")][0] + ("FP8FastAccum" if cfg.get("fast_accum") else "")


def kernel_source(tile=(128, 128, 128), cluster=(1, 1, 1), schedule="cooperative", fast_accum=False,
                  stages=None, residual: bool = False, scheduler: str = "default") -> tuple[str, str, list[str]]:
    """The CUTLASS kernel as cutlass_cppgen emits it: (kernel type name, C++ definitions, headers it needs);
    ``residual``: the variant adding a bf16 C [M, N] last."""
    cg = _cppgen()
    DT, LT = cg.DataType, cg.LayoutType
    if schedule not in SCHEDULES or scheduler not in SCHEDULERS:
        raise ValueError(f"schedule {schedule!r} / scheduler {scheduler!r}: one of {sorted(SCHEDULES)} / "
                         f"{sorted(SCHEDULERS)}")
    kernel_schedule = getattr(cg.KernelScheduleType, _schedule_name(dict(schedule=schedule, fast_accum=fast_accum)))
    epilogue_name = SCHEDULES[schedule][1]
    plan = cg.op.Gemm(element_A=DT.e4m3, element_B=DT.e4m3, element_C=DT.bf16 if residual else DT.void,
                      element_D=DT.bf16, element_accumulator=DT.f32, layout_A=LT.RowMajor,
                      layout_B=LT.ColumnMajor, layout_C=LT.RowMajor, cc=ARCH_CC)
    plan.epilogue_visitor = _epilogue_visitor(cg, residual)
    plan.tile_description = {  # cutlass_cppgen's threadblock_shape is the cluster's tile
        "threadblock_shape": [t * c for t, c in zip(tile, cluster)], "cluster_shape": list(cluster),
        "stages": stages or 0,
        "kernel_schedule": kernel_schedule,
        "epilogue_schedule": getattr(cg.EpilogueScheduleType, epilogue_name),
        "tile_scheduler": getattr(cg.TileSchedulerType, SCHEDULERS[scheduler]),
    }
    op = plan.construct(alignment_A=16, alignment_B=16, alignment_C=8)  # 16-byte TMA rows: K % 16, N % 8
    rt = op.rt_module
    body = _fix_evt_tile(rt.emit(), tile, cluster)
    if residual:
        body = _round_product_first(body)
    aliases = ("ScaleA", "ScaleB", "EVTCompute0", "EVTCompute1", "Sm90ColBroadcast", "Sm90RowBroadcast")
    for alias in aliases + (("TensorC", "EVTCompute2", "Sm90SrcFetch") if residual else ()):
        if alias not in body:  # the wrapper's argument tree below names these
            raise RuntimeError(f"cutlass_cppgen emitted an epilogue tree without {alias}; _WRAPPER needs updating")
    return op.procedural_name() + rt.emitter.operation_suffix, body, list(rt.emitter.includes)


def _round_product_first(body: str) -> str:
    """Make the residual kernel round as the reference does: ``bf16(float(bf16(product)) + float(C))``.

    The traced tree keeps the scaled product in fp32 up to the final add (one rounding); declaring the
    second multiply's output bf16 rounds the product first, and the add converts it back to fp32, so the
    residual kernel's output equals the plain kernel's output plus the residual added in fp32, bit for bit.
    """
    fp32 = "using Compute1 = cutlass::epilogue::fusion::Sm90Compute<\n    cutlass::multiplies, float, float,"
    if body.count(fp32) != 1:
        raise RuntimeError("cutlass_cppgen's residual epilogue tree no longer looks as expected; "
                           "check _round_product_first")
    return body.replace(fp32, fp32.replace("multiplies, float, float", "multiplies, cutlass::bfloat16_t, float"))


def _fix_evt_tile(body: str, tile, cluster) -> str:
    """Declare the EVT's broadcasts with the CTA tile the mainloop and collective epilogue use.

    cutlass_cppgen 4.2's sm90 EVT emitter writes ``EpilogueDescriptor<Shape<cluster tile>, ...>`` (its
    ``tile_description.threadblock_shape``) while the collectives get ``threadblock_shape / cluster``;
    the row/column broadcasts would then index scale vectors with the wrong tile.
    """
    if tuple(cluster) == (1, 1, 1):
        return body
    wrong = "EpilogueDescriptor<\n  cute::Shape<{}>".format(", ".join(f"_{t * c}" for t, c in zip(tile, cluster)))
    right = "EpilogueDescriptor<\n  cute::Shape<{}>".format(", ".join(f"_{t}" for t in tile))
    if body.count(wrong) != 1:
        raise RuntimeError("cutlass_cppgen's EVT EpilogueDescriptor no longer looks as expected; check _fix_evt_tile")
    return body.replace(wrong, right)


_KERNEL_TAIL = r"""
using Kernel = @KERNEL@;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::StrideA;
using StrideB = typename Kernel::StrideB;
using StrideD = typename Kernel::StrideD;

// the epilogue tree's arguments follow its emitted shape: EVTCompute1(EVTCompute0(Accum, ScaleA, Compute0),
// ScaleB, Compute1), and with a residual EVTCompute2(EVTCompute1, TensorC, Compute2)
static typename Gemm::Arguments make_args(const void* xq, const void* wq, const float* scale_a,
                                          const float* scale_b, const void* c, void* y, int M, int N, int K,
                                          bool hw) {
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));
  typename ScaleA::Arguments a_args{scale_a, 0.0f, {}};
  typename ScaleB::Arguments b_args{scale_b, 0.0f, {}};
  typename EVTCompute0::Arguments evt0_args{{}, a_args, {}};
  typename EVTCompute1::Arguments evt1_args{evt0_args, b_args, {}};
  typename Kernel::MainloopArguments mainloop{static_cast<const mxc_cutlass_fp8::ElementAB*>(xq), stride_a,
                                              static_cast<const mxc_cutlass_fp8::ElementAB*>(wq), stride_b};
@EPILOGUE@
  return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop, epilogue,
                                  mxc_cutlass_fp8::hw_info(hw)};
}
"""

_PLAIN_EPILOGUE = """\
  (void)c;
  typename Kernel::EpilogueArguments epilogue{evt1_args, nullptr, stride_d, static_cast<ElementD*>(y), stride_d};"""

_RESIDUAL_EPILOGUE = """\
  typename EVTCompute2::Arguments evt2_args{evt1_args, {}, {}};
  typename Kernel::EpilogueArguments epilogue{evt2_args, static_cast<const ElementC*>(c), stride_d,
                                              static_cast<ElementD*>(y), stride_d};"""

_COMMON = r"""
// ---- hand-written entry points (mxc.kernels.cutlass_fp8) ----
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

namespace mxc_cutlass_fp8 {

using ElementAB = cutlass::float_e4m3_t;

// SM count of each device, queried once (CUTLASS would query it on every call)
static int sm_count_of(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) counts[device] = n;
  }
  return counts[device];
}

static cutlass::KernelHardwareInfo hw_info(bool hw) {
  cutlass::KernelHardwareInfo info;
  if (hw) {
    int device = 0;
    cudaGetDevice(&device);
    info.device_id = device;
    info.sm_count = sm_count_of(device);
  }
  return info;
}

// 0: launched; 1: can_implement failed; 2: workspace too small; 3: initialize failed; 4: launch failed
template <class Gemm>
static int run(typename Gemm::Arguments const& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return 2;
  Gemm gemm;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 4;
  return cudaPeekAtLastError() == cudaSuccess ? 0 : 4;
}

}  // namespace mxc_cutlass_fp8
"""

_WRAPPER = r"""
// a problem of at most MXC_SMALL_M_MAX rows runs the small-M kernels (namespaces ..._small_*), others the main ones
#define MXC_SMALL_M_MAX @SMALL_M_MAX@
#define MXC_BY_M(M, KIND, ...)                                                                 \
  if ((M) <= MXC_SMALL_M_MAX) { using namespace mxc_cutlass_fp8_small_##KIND; __VA_ARGS__ } \
  { using namespace mxc_cutlass_fp8_##KIND; __VA_ARGS__ }

extern "C" {

const char* mxc_cutlass_fp8_name() { return "@KERNEL@"; }

// bytes of device workspace the kernel needs for this problem (host only, no CUDA call)
size_t mxc_cutlass_fp8_workspace(int M, int N, int K) {
  MXC_BY_M(M, plain, return Gemm::get_workspace_size(make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                               M, N, K, false));)
}

size_t mxc_cutlass_fp8_residual_workspace(int M, int N, int K) {
  MXC_BY_M(M, residual, return Gemm::get_workspace_size(make_args(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                                  nullptr, M, N, K, false));)
}

// 1 when CUTLASS can run this problem size (alignment: K % 16 == 0, N % 8 == 0), else 0 (host only)
int mxc_cutlass_fp8_can_implement(int M, int N, int K) {
  MXC_BY_M(M, plain, auto args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K, false);
           return Gemm::can_implement(args) == cutlass::Status::kSuccess ? 1 : 0;)
}

// y = bf16(((xq @ wq^T) * scale_a[:, None]) * scale_b[None, :]); status as mxc_cutlass_fp8::run
int mxc_cutlass_fp8_gemm(const void* xq, const void* wq, const float* scale_a, const float* scale_b, void* y,
                         int M, int N, int K, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  MXC_BY_M(M, plain, return mxc_cutlass_fp8::run<Gemm>(make_args(xq, wq, scale_a, scale_b, nullptr, y, M, N, K, true),
                                                       workspace, workspace_bytes, stream);)
}

// y = bf16(float(that y) + float(c)), c bf16 [M, N] row-major (y may not alias c)
int mxc_cutlass_fp8_gemm_residual(const void* xq, const void* wq, const float* scale_a, const float* scale_b,
                                  const void* c, void* y, int M, int N, int K, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  MXC_BY_M(M, residual, return mxc_cutlass_fp8::run<Gemm>(make_args(xq, wq, scale_a, scale_b, c, y, M, N, K, true),
                                                          workspace, workspace_bytes, stream);)
}

}  // extern "C"
"""


def generate(tile=(128, 128, 128), cluster=(1, 1, 1), schedule="cooperative", fast_accum=False, stages=None,
             scheduler: str = "default", small_m: dict | None = None) -> str:
    """Full .cu source of one kernel configuration: cutlass_cppgen's two kernels (without and with the residual
    C operand, each in a namespace of its own) plus the ``extern "C"`` entry points.

    ``tile``: one CTA's (M, N, K) tile; ``cluster``: CTAs per cluster along (M, N, K) (TMA multicast).
    ``schedule``: "cooperative" (two consumer warp groups share one tile; tile M >= 128) or "pingpong"
    (each warp group its own tile, alternating mainloop and epilogue). ``fast_accum`` selects CUTLASS's
    FP8FastAccum mainloop: no periodic promotion of the tensor cores' accumulator into fp32 registers,
    faster and less accurate at large K; ``torch._scaled_mm`` does not use it by default, vLLM's sm90
    kernel does (pingpong, 128x128x128, cluster 2x1x1, fast accumulation). Pingpong at 128x128 *without*
    fast accumulation spills registers (two 128x128 fp32 accumulators per warp group; ptxas's warning
    comes back from ``compile_so``), so the default is cooperative. ``stages`` None lets CUTLASS fit
    as many stages as shared memory holds. ``scheduler``: how tiles map to CTAs, "default" (a CTA a tile),
    "persistent" or "streamk" (the K loops of all tiles spread over every SM: for problems with fewer tiles
    than SMs, as the short prefills' GEMMs; partial sums meet in the workspace; cooperative only).
    ``small_m``: a second configuration (the same keys, plus ``max_m``) whose two kernels serve problems of
    at most ``max_m`` rows; the entry points choose by M, so callers see one function. The SiLU-pair kernels
    (one a configuration) and their entry points come too where ``cutlass_silu_pair.supported``.
    """
    config = dict(tile=tile, cluster=cluster, schedule=schedule, fast_accum=fast_accum, stages=stages,
                  scheduler=scheduler)
    small = dict(small_m or {})
    max_m = small.pop("max_m", 0)
    parts, includes, names = [], [], []
    for prefix, cfg in (("mxc_cutlass_fp8", config), ("mxc_cutlass_fp8_small", small if max_m else None)):
        if cfg is None:  # no small-M kernels: their names stand for the main ones (the M test is never true)
            parts.append("namespace mxc_cutlass_fp8_small_plain = mxc_cutlass_fp8_plain;\n"
                         "namespace mxc_cutlass_fp8_small_residual = mxc_cutlass_fp8_residual;\n")
            continue
        for residual, kind, epilogue in ((False, "plain", _PLAIN_EPILOGUE), (True, "residual", _RESIDUAL_EPILOGUE)):
            kernel, body, incs = kernel_source(residual=residual, **cfg)
            tail = _KERNEL_TAIL.replace("@KERNEL@", kernel).replace("@EPILOGUE@", epilogue)
            parts.append(f"namespace {prefix}_{kind} {{\n{body}\n{tail}\n}}  // namespace {prefix}_{kind}\n")
            includes += [h for h in incs if h not in includes]
            names.append(kernel)
    configs = [config] + ([small] if max_m else [])
    pair = cutlass_silu_pair.supported(configs)
    if pair:
        includes += [h for h in cutlass_silu_pair.INCLUDES if h not in includes]
        parts.append(cutlass_silu_pair.header())
        for prefix, cfg in zip(("mxc_cutlass_fp8", "mxc_cutlass_fp8_small"), configs):
            parts.append(cutlass_silu_pair.kernel(f"{prefix}_silu_pair", cfg, "Kernel" + _schedule_name(cfg)))
        if not max_m:
            parts.append("namespace mxc_cutlass_fp8_small_silu_pair = mxc_cutlass_fp8_silu_pair;\n")
    head = "\n".join(f'#include "{h}"' for h in ["cuda_runtime.h", *includes])
    name = names[0] + (f"; M <= {max_m}: {names[2]}" if max_m else "")
    wrapper = _WRAPPER.replace('@KERNEL@', name).replace('@SMALL_M_MAX@', str(max_m))
    if pair:
        wrapper += cutlass_silu_pair.WRAPPER.replace("@PAIR_BLOCK@", str(config["tile"][1] // 2))
    return (f"// Generated by mxc.kernels.cutlass_fp8 with cutlass_cppgen {_cppgen().__version__}: {_describe(config)}"
            + (f"; M <= {max_m}: {_describe(small)}" if max_m else "") + ("; SiLU-pair kernels" if pair else "")
            + "\n" f"{head}\n{_COMMON}\n{''.join(parts)}\n{wrapper}")


def _describe(cfg: dict) -> str:
    text = " ".join(f"{k}={tuple(v) if isinstance(v, (list, tuple)) else v}" for k, v in cfg.items()
                    if k != "scheduler")
    return text + (f" scheduler={cfg['scheduler']}" if cfg.get("scheduler", "default") != "default" else "")


def compile_so(source: str, out_path, arch: str = "90a", timeout: float = 1800, nvcc: str | None = None,
               extra_flags=()) -> Path:
    """Compile ``source`` into a shared library at ``out_path`` with CUTLASS's headers (``mxc.kernels.nvcc``)."""
    return nvcc_tool.compile_so(source, out_path, what="CUTLASS fp8 kernel", arch=arch, include_dirs=include_dirs(),
                                timeout=timeout, nvcc=nvcc, extra_flags=extra_flags)


class CutlassFp8Gemm:
    """A compiled kernel library opened with ctypes; calls take raw device pointers and plain ints."""

    def __init__(self, so_path):
        self.path = Path(so_path)
        lib = ctypes.CDLL(str(self.path))
        p, i, z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.mxc_cutlass_fp8_gemm.argtypes = [p, p, p, p, p, i, i, i, p, z, p]
        lib.mxc_cutlass_fp8_gemm.restype = i
        lib.mxc_cutlass_fp8_workspace.argtypes = [i, i, i]
        lib.mxc_cutlass_fp8_workspace.restype = z
        lib.mxc_cutlass_fp8_can_implement.argtypes = [i, i, i]
        lib.mxc_cutlass_fp8_can_implement.restype = i
        lib.mxc_cutlass_fp8_name.argtypes = []
        lib.mxc_cutlass_fp8_name.restype = ctypes.c_char_p
        # libraries built before the residual kernel existed lack it: their callers add the residual themselves
        self.has_residual = hasattr(lib, "mxc_cutlass_fp8_gemm_residual")
        if self.has_residual:
            lib.mxc_cutlass_fp8_gemm_residual.argtypes = [p, p, p, p, p, p, i, i, i, p, z, p]
            lib.mxc_cutlass_fp8_gemm_residual.restype = i
            lib.mxc_cutlass_fp8_residual_workspace.argtypes = [i, i, i]
            lib.mxc_cutlass_fp8_residual_workspace.restype = z
        # and libraries built before the SiLU-pair kernels (or for a configuration without them) lack those
        self.has_silu_pair = hasattr(lib, "mxc_cutlass_fp8_gemm_silu_pair")
        self.pair_block = 0
        if self.has_silu_pair:
            lib.mxc_cutlass_fp8_gemm_silu_pair.argtypes = [p, p, p, p, p, p, i, i, i, p, z, p]
            lib.mxc_cutlass_fp8_gemm_silu_pair.restype = i
            lib.mxc_cutlass_fp8_silu_pair_workspace.argtypes = [i, i, i]
            lib.mxc_cutlass_fp8_silu_pair_workspace.restype = z
            lib.mxc_cutlass_fp8_silu_pair_block.argtypes = []
            lib.mxc_cutlass_fp8_silu_pair_block.restype = i
            self.pair_block = int(lib.mxc_cutlass_fp8_silu_pair_block())
        self._lib = lib
        self.name = lib.mxc_cutlass_fp8_name().decode()
        self._workspace: dict[tuple, int] = {}

    def workspace_bytes(self, M: int, N: int, K: int, residual: bool = False, kind: str | None = None) -> int:
        """The launch's workspace, asked of the library once a shape (a prefill asks for each of its linears);
        ``kind``: "plain", "residual" (or ``residual=True``) or "silu_pair"."""
        kind = kind or ("residual" if residual else "plain")
        key = (M, N, K, kind)
        nbytes = self._workspace.get(key)
        if nbytes is None:
            if len(self._workspace) >= 4096:  # one entry a prompt length and linear: bounded for a long-lived server
                self._workspace.clear()
            fn = {"plain": "mxc_cutlass_fp8_workspace", "residual": "mxc_cutlass_fp8_residual_workspace",
                  "silu_pair": "mxc_cutlass_fp8_silu_pair_workspace"}[kind]
            nbytes = self._workspace[key] = int(getattr(self._lib, fn)(M, N, K))
        return nbytes

    def can_implement(self, M: int, N: int, K: int) -> bool:
        return bool(self._lib.mxc_cutlass_fp8_can_implement(M, N, K))

    def __call__(self, xq: int, wq: int, scale_a: int, scale_b: int, y: int, M: int, N: int, K: int,
                 stream: int = 0, workspace: int = 0, workspace_bytes: int = 0, residual: int = 0) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` as an int, e.g. ``torch.cuda.current_stream().cuda_stream``);
        ``residual``: a bf16 [M, N] row-major device pointer added to the rounded product (not y's memory; needs
        ``has_residual`` and ``workspace_bytes(..., residual=True)``)."""
        if residual:
            if not self.has_residual:
                raise RuntimeError(f"{self.path} has no residual kernel (built before it existed): rebuild it")
            status = self._lib.mxc_cutlass_fp8_gemm_residual(xq, wq, scale_a, scale_b, residual, y, M, N, K,
                                                             workspace or None, workspace_bytes, stream or None)
        else:
            status = self._lib.mxc_cutlass_fp8_gemm(xq, wq, scale_a, scale_b, y, M, N, K, workspace or None,
                                                    workspace_bytes, stream or None)
        _check(status, "GEMM", M, N, K)

    def silu_pair(self, xq: int, w: int, scale_a: int, scale_b: int, h: int, pmax: int, M: int, N: int, K: int,
                  stream: int = 0, workspace: int = 0, workspace_bytes: int = 0) -> None:
        """The SiLU-pair GEMM (``has_silu_pair``): w [N, K] the gate/up weight interleaved in blocks of
        ``pair_block`` rows, scale_b [N] its scales in the same order; h [M, N/2] bf16 and pmax [M, N/(2 *
        pair_block)] fp32 out (device pointers, as ``__call__``)."""
        if not self.has_silu_pair:
            raise RuntimeError(f"{self.path} has no SiLU-pair kernels (built before them, or a configuration "
                               f"without them): rebuild it")
        status = self._lib.mxc_cutlass_fp8_gemm_silu_pair(xq, w, scale_a, scale_b, h, pmax, M, N, K, workspace or None,
                                                      workspace_bytes, stream or None)
        _check(status, "SiLU-pair GEMM", M, N, K)


def _check(status: int, what: str, M: int, N: int, K: int) -> None:
    if status:
        raise RuntimeError(f"CUTLASS fp8 {what} (M={M}, N={N}, K={K}): status {status}, "
                           f"{STATUS.get(status, 'unknown')}")


def load(so_path) -> CutlassFp8Gemm:
    return CutlassFp8Gemm(so_path)


def build_library(out_path, log=print) -> Path:
    """The library a build ships at ``out_path``: ``$MXC_CUTLASS_LIBRARY`` if set, else ``BUILD_CONFIG``
    generated and compiled here (1.5-2 minutes of nvcc, one core; cached by the source's sha256)."""
    return nvcc_tool.cached_library("CUTLASS fp8 GEMM", "cutlass", lambda: generate(**BUILD_CONFIG), compile_so,
                                    PREBUILT_ENV, out_path, log, note=" (1.5-2 minutes)")


def library_config() -> dict | str:
    """What ``build_library`` ships, for the manifest: ``BUILD_CONFIG`` (JSON-ready), or "prebuilt"."""
    if os.environ.get(PREBUILT_ENV):
        return "prebuilt"
    def plain(v):
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v

    return plain(BUILD_CONFIG)


_ACTIVE: list[CutlassFp8Gemm] = []
# A bench hook: a library path the runtime calls instead of the artifact's, so that one artifact can time several
# CUTLASS configurations (bench/decode_ab.py --variant lib=mxc.kernels.cutlass_fp8.LAB_LIBRARY='x.so'), or a dict
# {K: path} (key 0: every other K) to try a configuration per shape. None in use.
LAB_LIBRARY: str | dict | None = None


def use(so_path) -> CutlassFp8Gemm:
    """Open an artifact's library for the runtime (``active``). Every artifact's library computes the same
    function, so the process keeps the last one opened."""
    gemm = load(so_path)
    _ACTIVE[:] = [gemm]
    return gemm


@functools.lru_cache(maxsize=None)
def _lab_library(path: str) -> CutlassFp8Gemm:
    return load(path)


def active(K: int = 0) -> CutlassFp8Gemm:
    if LAB_LIBRARY:
        lab = LAB_LIBRARY.get(K, LAB_LIBRARY.get(0)) if isinstance(LAB_LIBRARY, dict) else LAB_LIBRARY
        return _lab_library(lab)
    if not _ACTIVE:
        raise RuntimeError("no CUTLASS fp8 library is loaded: the artifact's forward calls fp8_gemm.cutlass but "
                           f"mxc.load found no {LIBRARY} in it")
    return _ACTIVE[0]
