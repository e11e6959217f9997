// SiLU-and-mul in the epilogue of the CUTLASS fp8 gate/up GEMM (mxc.kernels.cutlass_fp8 embeds this text in the
// library it generates; the kernels that use it are instantiated there, one per tile configuration).
//
// The merged gate/up weight's rows are interleaved in blocks of half a CTA tile (B = TileN / 2 = 64 for the
// shipped 128-column tiles): rows [2bB, 2bB + B) are gate rows [bB, bB + B) and the next B the matching up rows
// (``interleave`` in the IR, written by the loader). Each CTA tile of the GEMM then holds B gate columns and their
// up columns, and in the sm90 wgmma accumulator a thread's column group g (< NG / 2) and group g + NG / 2 are a gate
// column and its up column: the SiLU needs no data from another thread. The epilogue (operator style, no shared
// memory, as CUTLASS's DefaultEpilogue under NoSmemWarpSpecialized) stores
//   h[m, j] = bf16(silu(g) * u),  g = bf16((acc[m, gate(j)] * sa[m]) * sb[gate(j)]),  u likewise at gate(j) + B
// (the silu rounded to bf16 before the multiply, its exp and division as Triton's: ex2.approx, div.full; the
// values of the plain GEMM's output followed by the SiLU kernel, bit for bit), h [M, N / 2] bf16, and
// pmax[m, tile] = max |h| over the tile's B columns (quad shuffles, no atomics) for the quantize after it
// (triton_fp8_quant.quantize_max). Every tile is whole along N (N % TileN == 0); rows past M are not stored.
// H200, 2026-12-03 (docs/perf.md, thirty-first run; the lab's interleave of single rows): at M = 2048 the GEMM and
// quantize_max took 427.3 us a Llama-3-8B layer against 454.9 for the plain GEMM and the SiLU quantize.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace mxc_silu_pair {

using ElementH = cutlass::bfloat16_t;

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

// h of one gate/up accumulator pair, rounded as the unfused chain rounds
__device__ __forceinline__ float silu_pair(float acc_gate, float acc_up, float sa, float sb_gate, float sb_up) {
  float const gate = round_bf16((acc_gate * sa) * sb_gate);
  float const up = round_bf16((acc_up * sa) * sb_up);
  float const act = round_bf16(div_full(gate, 1.f + exp_approx(-gate)));
  return round_bf16(act * up);
}

template <int TileN>
struct SiluPairEpilogue {
  static constexpr int kBlock = TileN / 2;  // the interleave: gate rows of a block, then as many up rows
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
    ElementH* ptr_h = nullptr;       // [M, N / 2]
    float* ptr_pmax = nullptr;       // [M, N / TileN]
    float const* ptr_sa = nullptr;   // [M]
    float const* ptr_sb = nullptr;   // [N], in the weight's (interleaved) row order
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
    return cute::get<1>(problem_shape) % TileN == 0;  // whole tiles along N: each holds B gates and their ups
  }

  CUTLASS_HOST_DEVICE SiluPairEpilogue(Params const& params_, SharedStorage const& = SharedStorage())
      : params(params_) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(decltype(size<1>(blk_shape_MNK))::value == TileN);
    auto M = get<0>(problem_shape_mnkl);
    auto N = get<1>(problem_shape_mnkl);
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD);  // the (m, n) of each accumulator
    // the GMMA accumulator: ((2 adjacent columns, 2 rows 8 apart, column groups of 8), MMA_M, MMA_N); groups in
    // column order, so group g + NG / 2 lies B columns right of group g
    static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2);
    static_assert(decltype(size<2>(acc))::value == 1);
    constexpr int NG = decltype(size<0, 2>(acc))::value;
    static_assert(NG * 8 == TileN, "one MMA spans the tile's columns");
    constexpr int HG = NG / 2;
    constexpr int MM = decltype(size<1>(acc))::value;
    int const I = N / 2;
    int const tiles_n = N / TileN;
    // the scales first: loaded before any store (the stores could alias them otherwise, and every later load would
    // wait for the stores ahead of it)
    float sb_gate[HG][2], sb_up[HG][2];
    int h_col[HG];  // this thread's first h column of each gate group (two adjacent ones)
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < HG; ++g) {
      int const n = get<1>(tCcD(make_coord(make_coord(0, 0, g), 0, 0)));  // a gate column (even)
      sb_gate[g][0] = params.ptr_sb[n];
      sb_gate[g][1] = params.ptr_sb[n + 1];
      sb_up[g][0] = params.ptr_sb[n + kBlock];
      sb_up[g][1] = params.ptr_sb[n + kBlock + 1];
      h_col[g] = (n / TileN) * kBlock + n % TileN;
    }
    float sa_row[MM][2];
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
        ElementH* row_h = params.ptr_h + int64_t(m) * I;
        float rmax = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < HG; ++g) {
          float const h0 = silu_pair(acc(make_coord(make_coord(0, v1, g), mm, 0)),
                                     acc(make_coord(make_coord(0, v1, g + HG), mm, 0)), sa, sb_gate[g][0],
                                     sb_up[g][0]);
          float const h1 = silu_pair(acc(make_coord(make_coord(1, v1, g), mm, 0)),
                                     acc(make_coord(make_coord(1, v1, g + HG), mm, 0)), sa, sb_gate[g][1],
                                     sb_up[g][1]);
          rmax = fmaxf(rmax, fmaxf(fabsf(h0), fabsf(h1)));
          cutlass::Array<ElementH, 2> pair;
          pair[0] = ElementH(h0);
          pair[1] = ElementH(h1);
          if (row_ok) {
            *reinterpret_cast<cutlass::Array<ElementH, 2>*>(row_h + h_col[g]) = pair;
          }
        }
        // the quad (4 lanes) holds this row's B h columns of the tile
        rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffff, rmax, 1));
        rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffff, rmax, 2));
        if (row_ok && (threadIdx.x % 4) == 0) {
          params.ptr_pmax[int64_t(m) * tiles_n + n_coord] = rmax;
        }
      }
    }
  }

 private:
  Params params;
};

}  // namespace mxc_silu_pair
