// Lab (bench/silu_pair_lab.py): the fp8 gate/up GEMM of the prefill with SiLU-and-mul in a CUTLASS epilogue.
//
// The merged weight's rows are interleaved (gate_0, up_0, gate_1, up_1, ...), so in the sm90 wgmma accumulator
// layout each thread holds a gate and its up in one register pair (the two adjacent columns of an 8-column group).
// The mainloop is the shipped one (cutlass_fp8.BUILD_CONFIG: pingpong, 128x128x128 a CTA, clusters of 2x1x1, fp8
// fast accumulation); the epilogue is an operator-style collective of our own (no shared memory, as CUTLASS's
// DefaultEpilogue under NoSmemWarpSpecialized) that stores
//   h[m, j] = bf16(silu(g) * u),  g = bf16((acc[m, 2j] * sa[m]) * sb[2j]),  u = bf16((acc[m, 2j+1] * sa[m]) * sb[2j+1])
// (silu rounded to bf16 before the multiply, its exp and division as Triton's: ex2.approx, div.full), h [M, N/2],
// and pmax[m, tile] = max |h| over the tile's 64 h columns (quad shuffles; no atomics), for the quantize after it.
// H200, 2026-12-03 (docs/perf.md, thirty-first run), M = 2048, Llama-3-8B's gate/up: 381.8 us against the shipped
// GEMM's 371.9, and the quantize after it 35.1 against 74.2 with the SiLU: 28.6 us a layer saved, bit for bit.
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace silu_pair {

using ElementAB = cutlass::float_e4m3_t;
using ElementH = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_2, _1, _1>;

__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float exp_approx(float x) {  // Triton's tl.exp on NVIDIA: ex2.approx(x * log2(e))
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}

__device__ __forceinline__ float round_bf16(float x) { return float(ElementH(x)); }

struct SiluPairEpilogue {
  using ElementC = cutlass::bfloat16_t;  // (no C operand; the kernel's type aliases want one)
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ElementAccumulator = float;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;  // (aliases only)
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  struct Arguments {
    ElementH* ptr_h = nullptr;
    float* ptr_pmax = nullptr;
    float const* ptr_sa = nullptr;
    float const* ptr_sb = nullptr;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const&) {
    return get<1>(problem_shape) % 128 == 0;  // whole tiles along N: pmax has N / 128 columns
  }

  CUTLASS_HOST_DEVICE SiluPairEpilogue(Params const& params_, SharedStorage const& = SharedStorage())
      : params(params_) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    auto M = get<0>(problem_shape_mnkl);
    auto N = get<1>(problem_shape_mnkl);
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD);  // the (m, n) of each accumulator
    // the GMMA accumulator: ((2 columns, 2 rows 8 apart, column groups of 8), MMA_M, MMA_N)
    static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2);
    static_assert(decltype(size<2>(acc))::value == 1);
    constexpr int NG = decltype(size<0, 2>(acc))::value;
    constexpr int MM = decltype(size<1>(acc))::value;
    int const I = N / 2;
    int const tiles_n = N / 128;
    int const lane = threadIdx.x % 32;
    // this thread's columns' weight scales, loaded before any store (the stores could alias them otherwise, and every
    // later load would wait for the stores ahead of it)
    float sb_gate[NG], sb_up[NG];
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < NG; ++g) {
      int const n = get<1>(tCcD(make_coord(make_coord(0, 0, g), 0, 0)));  // even: a gate column
      sb_gate[g] = n < N ? params.ptr_sb[n] : 0.f;
      sb_up[g] = n < N ? params.ptr_sb[n + 1] : 0.f;
    }
    int const n0 = get<1>(tCcD(make_coord(make_coord(0, 0, 0), 0, 0)));  // (the quad's first gate column + 2 * lane%4)
    float sa_row[MM][2];  // and its rows' activation scales
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        int const m = get<0>(tCcD(make_coord(make_coord(0, v1, 0), mm, 0)));
        sa_row[mm][v1] = m < M ? params.ptr_sa[m] : 0.f;
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        int const m = get<0>(tCcD(make_coord(make_coord(0, v1, 0), mm, 0)));
        bool const row_ok = m < M;
        float const sa = sa_row[mm][v1];
        float h[NG];
        float rmax = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < NG; ++g) {
          float const gate = round_bf16((acc(make_coord(make_coord(0, v1, g), mm, 0)) * sa) * sb_gate[g]);
          float const up = round_bf16((acc(make_coord(make_coord(1, v1, g), mm, 0)) * sa) * sb_up[g]);
          float const act = round_bf16(div_full(gate, 1.f + exp_approx(-gate)));
          h[g] = round_bf16(act * up);
          rmax = fmaxf(rmax, fabsf(h[g]));
        }
        ElementH* row_h = params.ptr_h + int64_t(m) * I;
#ifdef SILU_PAIR_STORE8
        // a 4x4 exchange within the quad over each 4 column groups: lane q ends with h columns 4 (4 k + q) + 0..3 of
        // the tile (its partners' h[4 k + q]) and stores them as 8 bytes
        int const q = lane & 3;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < NG / 4; ++k) {
          float w0 = 0.f, w1 = 0.f, w2 = 0.f, w3 = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 4; ++r) {
            int const si = (q - r) & 3;  // what lane (q + r) & 3 wants from this one
            float const send = si == 0 ? h[4 * k] : si == 1 ? h[4 * k + 1] : si == 2 ? h[4 * k + 2] : h[4 * k + 3];
            int const di = (q + r) & 3;
            float const got = __shfl_sync(0xffffffff, send, (lane & ~3) | di);
            w0 = di == 0 ? got : w0;
            w1 = di == 1 ? got : w1;
            w2 = di == 2 ? got : w2;
            w3 = di == 3 ? got : w3;
          }
          cutlass::Array<ElementH, 4> out;
          out[0] = ElementH(w0);
          out[1] = ElementH(w1);
          out[2] = ElementH(w2);
          out[3] = ElementH(w3);
          if (row_ok) {
            *reinterpret_cast<cutlass::Array<ElementH, 4>*>(row_h + n0 / 2 - q + 4 * (4 * k + q)) = out;
          }
        }
#else
        // h column of (g, lane % 4) is 4 g + lane % 4 (n0 / 2 + 4 g); pairs of lanes swap so that each stores two
        // adjacent columns: the even lane of a pair (h[g], its partner's h[g]) at 4 g + q, the odd one (the
        // partner's h[g + 1], h[g + 1]) at 4 (g + 1) + q - 1
        bool const odd = lane & 1;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < NG; g += 2) {
          float const send = odd ? h[g] : h[g + 1];
          float const got = __shfl_xor_sync(0xffffffff, send, 1);
          int const col = n0 / 2 + 4 * (odd ? g + 1 : g) - (odd ? 1 : 0);
          cutlass::Array<ElementH, 2> pair;
          pair[0] = ElementH(odd ? got : h[g]);
          pair[1] = ElementH(odd ? h[g + 1] : got);
          if (row_ok) {
            *reinterpret_cast<cutlass::Array<ElementH, 2>*>(row_h + col) = pair;
          }
        }
#endif
        // the quad (4 lanes) holds this row's 64 h columns of the tile
        rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffff, rmax, 1));
        rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffff, rmax, 2));
        if (row_ok && (lane % 4) == 0) {
          params.ptr_pmax[int64_t(m) * tiles_n + n_coord] = rmax;
        }
      }
    }
  }

 private:
  Params params;
};

using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SiluPairEpilogue>;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cutlass::layout::RowMajor, 16, ElementAB,
    cutlass::layout::ColumnMajor, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments make_args(const void* xq, const void* w, const float* sa, const float* sb, void* h,
                                          float* pmax, int M, int N, int K) {
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1));
  typename Kernel::MainloopArguments mainloop{static_cast<const ElementAB*>(xq), stride_a,
                                              static_cast<const ElementAB*>(w), stride_b};
  typename Kernel::EpilogueArguments epilogue{static_cast<ElementH*>(h), pmax, sa, sb};
  cutlass::KernelHardwareInfo hw;
  int device = 0;
  cudaGetDevice(&device);
  hw.device_id = device;
  cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, device);
  return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop, epilogue, hw};
}

}  // namespace silu_pair

extern "C" {

size_t silu_pair_gemm_workspace(int M, int N, int K) {
  return silu_pair::Gemm::get_workspace_size(
      silu_pair::make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K));
}

// 0 launched; 1 can_implement failed; 2 workspace too small; 3 initialize failed; 4 launch failed
int silu_pair_gemm(const void* xq, const void* w, const float* sa, const float* sb, void* h, float* pmax, int M,
                   int N, int K, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  auto args = silu_pair::make_args(xq, w, sa, sb, h, pmax, M, N, K);
  if (silu_pair::Gemm::can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (silu_pair::Gemm::get_workspace_size(args) > workspace_bytes) return 2;
  silu_pair::Gemm gemm;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 4;
  return cudaPeekAtLastError() == cudaSuccess ? 0 : 4;
}

}  // extern "C"
