"""The SiLU-pair kernels' part of the CUTLASS fp8 library's source (``cutlass_fp8.generate`` asks for it).

The epilogue is hand-written C++ (``csrc/cutlass_silu_pair.cuh``: SiLU-and-mul over the fp8 MLP's gate/up rows
interleaved in blocks of half a CTA tile, h and each row's maximum a tile out); this module instantiates it with
the library's mainloop for each configuration (``kernel``) and writes the ``extern "C"`` entry points
(``WRAPPER``: the interleave, the workspace, the launch, each choosing the kernel by M as the library's other
entry points do). ``supported`` says which configurations get them.
"""

from __future__ import annotations

from pathlib import Path

HEADER = Path(__file__).parent / "csrc" / "cutlass_silu_pair.cuh"
INCLUDES = ("cutlass/gemm/collective/collective_builder.hpp", "cutlass/gemm/kernel/gemm_universal.hpp",
            "cutlass/gemm/dispatch_policy.hpp")

_KERNEL = r"""
namespace @NS@ {
using TileShape = cute::Shape<@TILE@>;
using ClusterShape = cute::Shape<@CLUSTER@>;
using CollectiveEpilogue =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<mxc_silu_pair::SiluPairEpilogue<@TILE_N@>>;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, mxc_cutlass_fp8::ElementAB, cutlass::layout::RowMajor, 16,
    mxc_cutlass_fp8::ElementAB, cutlass::layout::ColumnMajor, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::@SCHEDULE@>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                    CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments make_args(const void* xq, const void* w, const float* sa, const float* sb, void* h,
                                          float* pmax, int M, int N, int K, bool hw) {
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  typename Kernel::MainloopArguments mainloop{static_cast<const mxc_cutlass_fp8::ElementAB*>(xq), stride_a,
                                              static_cast<const mxc_cutlass_fp8::ElementAB*>(w), stride_b};
  typename Kernel::EpilogueArguments epilogue{static_cast<mxc_silu_pair::ElementH*>(h), pmax, sa, sb};
  return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop, epilogue,
                                  mxc_cutlass_fp8::hw_info(hw)};
}
}  // namespace @NS@
"""

WRAPPER = r"""
extern "C" {

// the gate/up interleave the SiLU-pair kernels read: @PAIR_BLOCK@ gate rows, then their up rows, block by block
int mxc_cutlass_fp8_silu_pair_block() { return @PAIR_BLOCK@; }

size_t mxc_cutlass_fp8_silu_pair_workspace(int M, int N, int K) {
  MXC_BY_M(M, silu_pair, return Gemm::get_workspace_size(make_args(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                                   nullptr, M, N, K, false));)
}

// h [M, N/2] = bf16(silu(g) * u) of the interleaved gate/up product (see cutlass_silu_pair.cuh), pmax [M, N/TileN]
// each row's max |h| a tile; status as mxc_cutlass_fp8::run
int mxc_cutlass_fp8_gemm_silu_pair(const void* xq, const void* w, const float* scale_a, const float* scale_b, void* h,
                                   float* pmax, int M, int N, int K, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  MXC_BY_M(M, silu_pair, return mxc_cutlass_fp8::run<Gemm>(make_args(xq, w, scale_a, scale_b, h, pmax, M, N, K, true),
                                                           workspace, workspace_bytes, stream);)
}

}  // extern "C"
"""


def supported(configs) -> bool:
    """SiLU-pair kernels for these configurations: pingpong (the operator-style epilogue is checked on it, one warp
    group a tile), the default scheduler, and one tile width (one interleave serves every M)."""
    return (all(c.get("schedule", "cooperative") == "pingpong" and c.get("scheduler", "default") == "default"
                for c in configs) and len({tuple(c.get("tile", (128, 128, 128)))[1] for c in configs}) == 1)


def kernel(namespace: str, cfg: dict, schedule: str) -> str:
    """The SiLU-pair kernel of one configuration in ``namespace``; ``schedule`` the mainloop's kernel schedule
    (a ``cutlass::gemm`` name, e.g. ``KernelTmaWarpSpecializedPingpongFP8FastAccum``)."""
    tile, cluster = cfg.get("tile", (128, 128, 128)), cfg.get("cluster", (1, 1, 1))
    shape = lambda v: ", ".join(f"cute::_{x}" for x in v)  # noqa: E731
    return (_KERNEL.replace("@NS@", namespace).replace("@TILE@", shape(tile)).replace("@CLUSTER@", shape(cluster))
            .replace("@TILE_N@", str(tile[1])).replace("@SCHEDULE@", schedule))


def header() -> str:
    """The epilogue's C++, to embed (the generated source stands alone)."""
    return HEADER.read_text().replace("#pragma once\n", "")
