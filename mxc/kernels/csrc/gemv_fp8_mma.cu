// The fp8 decode GEMV on mma.sync with the weights loaded straight into the MMA's registers
// (mxc.kernels.cuda_fp8_gemv; a lab kernel, not selected by builds).
//
//   y[m, n] = epilogue(sum_k xq[m, k] * w[n, k] * xs[m] * s[n])      1 <= M <= 8, K % 64 == 0
//
// xq [M, K] e4m3 and xs [M] fp32 as the RMSNorm-quantize kernel writes them; w [N, K] e4m3 with one fp32 scale
// a row s [N]. Epilogues: 0 y = bf16(v); 1 y = bf16(residual + bf16(v)); 2 (SiLU) w is [gate; up] (N = 2I) and
// y [M, I] = bf16(bf16(silu(bf16(gate))) * bf16(up)), the Triton GEMV's epilogue numerics.
//
// Why: the Triton tensor-core GEMV stages its weights through shared memory (cp.async/TMA, a pipeline to fill
// per program, ~80 KB a program, two an SM); at one token its ~2 us a GEMV of ramp and tail are what the fp8
// decode step loses above its bytes (docs/perf.md, twenty-third run). Here nothing goes through shared memory:
//
// - mma.sync m16n8k32 e4m3 with the weights as A (16 rows) and the tokens as B (N = 8; rows past M are zero).
// - A GEMV's reduction order over K is free as long as both operands use the same one, so each thread takes
//   16 contiguous bytes of a row (one 128-bit load, fully used 32-byte sectors across the quad) as the A
//   fragments of two MMAs: bytes [16t, 16t + 8) of a 64-byte chunk are logical k {4t..4t+3, 16+4t..16+4t+3}
//   of the first (registers a0/a2 of row g, a1/a3 of row g + 8), bytes [16t + 8, 16t + 16) the second's; x's
//   bytes go to the B fragments by the same map.
// - Weights stream with U chunks in flight a thread and the next U issued before the current ones are
//   multiplied (x's chunks likewise); the first U are issued before griddepcontrol.wait (no kernel of the step
//   writes weights), so under programmatic dependent launch they load while the kernel ahead finishes.
// - KS warps of a CTA split K; their fp32 fragments are summed in warp order in shared memory (deterministic).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// Lab knobs (bench/gemv_mma_lab.py --compile-variants): MXC_GEMV_L2HINT asks L2 for 256-byte lines on the weight
// loads; MXC_GEMV_INTERLEAVE gives a CTA's warps every KS-th chunk (the CTA's warps read neighbouring bytes at
// once) instead of a contiguous K range each; MXC_GEMV_TILED reads the weights in the lab's tile-major layout.
#ifndef MXC_GEMV_L2HINT
#define MXC_GEMV_L2HINT 0
#endif
#ifndef MXC_GEMV_INTERLEAVE
#define MXC_GEMV_INTERLEAVE 0
#endif
#ifndef MXC_GEMV_TILED
#define MXC_GEMV_TILED 0
#endif

namespace mxc_gemv_mma {

constexpr int MAX_M = 8;
constexpr int CHUNK = 64;  // K bytes of a row one thread quad loads a step (4 x 16 B)
enum { EPI_STORE = 0, EPI_RESIDUAL = 1, EPI_SILU = 2 };

struct Params {
  const uint8_t* x;                // [M, K] e4m3
  const float* xs;                 // [M]
  const uint8_t* w;                // [N, K] e4m3
  const float* s;                  // [N]
  const __nv_bfloat16* residual;   // [M, N] (EPI_RESIDUAL)
  __nv_bfloat16* y;                // [M, N], or [M, N / 2] (EPI_SILU)
  int M, N, K;
};

__device__ __forceinline__ uint4 ldg_weights(const uint8_t* p) {
  uint4 v;
#if MXC_GEMV_L2HINT
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
#endif
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ldg_act(const uint8_t* p) {  // written by the kernel ahead: read after the wait
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}

// c += a (16 x 32 e4m3, row fragment) * b (32 x 8 e4m3, column fragment), fp32
__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <int KS, int U, int EPI>
__global__ void __launch_bounds__(KS * 32) gemv_fp8_mma_kernel(const __grid_constant__ Params p) {
  __shared__ float red[KS > 1 ? KS - 1 : 1][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rows = EPI == EPI_SILU ? p.N / 2 : p.N;  // output columns
  // the tile's A rows g and g + 8: 16 rows, or (SiLU) 8 gate rows and their 8 up rows; past the end, the last row
  int row_a, row_b;
  if (EPI == EPI_SILU) {
    const int c = min(static_cast<int>(blockIdx.x) * 8 + g, rows - 1);
    row_a = c;
    row_b = rows + c;
  } else {
    row_a = min(static_cast<int>(blockIdx.x) * 16 + g, rows - 1);
    row_b = min(static_cast<int>(blockIdx.x) * 16 + 8 + g, rows - 1);
  }
  const int nchunks = p.K / CHUNK;
  // this warp's chunks: i = 0 .. count - 1 at chunk first + i * step of the row
#if MXC_GEMV_INTERLEAVE
  const int first = warp, step = KS;
  const int count = warp < nchunks ? (nchunks - warp + KS - 1) / KS : 0;
#else
  const int per_warp = (nchunks + KS - 1) / KS;
  const int first = warp * per_warp, step = 1;
  const int count = max(0, min(per_warp, nchunks - first));
#endif
#if MXC_GEMV_TILED  // lab layout: tile-major 1 KB blocks, [row g | row g + 8] 16 B a lane (timing only: see the lab)
  const uint8_t* wa = p.w + (static_cast<size_t>(blockIdx.x) * nchunks) * 1024 + lane * 16;
  const uint8_t* wb = wa + 512;
  constexpr size_t STRIDE = 1024;
#else
  const uint8_t* wa = p.w + static_cast<size_t>(row_a) * p.K + t * 16;
  const uint8_t* wb = p.w + static_cast<size_t>(row_b) * p.K + t * 16;
  constexpr size_t STRIDE = CHUNK;
#endif
  const uint4 zero = make_uint4(0, 0, 0, 0);

  uint4 ca[U], cb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const size_t c = static_cast<size_t>(first + u * step);
    ca[u] = u < count ? ldg_weights(wa + c * STRIDE) : zero;
    cb[u] = u < count ? ldg_weights(wb + c * STRIDE) : zero;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // x's chunks are loaded an iteration ahead too (after the wait: the kernel ahead writes them)
  const bool has_x = g < p.M;
  const uint8_t* xp = p.x + static_cast<size_t>(has_x ? g : 0) * p.K + t * 16;
  uint4 cx[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const size_t c = static_cast<size_t>(first + u * step);
    cx[u] = has_x && u < count ? ldg_act(xp + c * CHUNK) : zero;
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i0 = 0; i0 < count; i0 += U) {
    uint4 na[U], nb[U], nx[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + U + u;
      const size_t c = static_cast<size_t>(first + i * step);
      na[u] = i < count ? ldg_weights(wa + c * STRIDE) : zero;
      nb[u] = i < count ? ldg_weights(wb + c * STRIDE) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + U + u;
      nx[u] = has_x && i < count ? ldg_act(xp + static_cast<size_t>(first + i * step) * CHUNK) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u < count) {
        mma_e4m3(acc, ca[u].x, cb[u].x, ca[u].y, cb[u].y, cx[u].x, cx[u].y);
        mma_e4m3(acc, ca[u].z, cb[u].z, ca[u].w, cb[u].w, cx[u].z, cx[u].w);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ca[u] = na[u];
      cb[u] = nb[u];
      cx[u] = nx[u];
    }
  }

  if (KS > 1) {  // the warps' partial sums, added in warp order
    if (warp > 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp - 1][i][lane] = acc[i];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < KS - 1; ++w)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += red[w][i][lane];
  }

  // acc: [0] (row g, token 2t), [1] (row g, 2t + 1), [2] (row g + 8, 2t), [3] (row g + 8, 2t + 1)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int tok = 2 * t + j;
    if (tok >= p.M) continue;
    const float xs = p.xs[tok];
    if (EPI == EPI_SILU) {
      const int col = blockIdx.x * 8 + g;
      if (col >= rows) continue;
      const float gate = bf_round(acc[j] * xs * p.s[row_a]);
      const float up = bf_round(acc[2 + j] * xs * p.s[row_b]);
      const float act = bf_round(gate / (1.0f + __expf(-gate)));
      p.y[static_cast<size_t>(tok) * rows + col] = __float2bfloat16_rn(act * up);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = blockIdx.x * 16 + 8 * h + g;
        if (row >= rows) continue;
        float v = bf_round(acc[2 * h + j] * xs * p.s[row]);
        const size_t at = static_cast<size_t>(tok) * rows + row;
        if (EPI == EPI_RESIDUAL) v = __bfloat162float(p.residual[at]) + v;
        p.y[at] = __float2bfloat16_rn(v);
      }
    }
  }
}

template <int KS, int U, int EPI>
cudaError_t launch_one(const Params& p, int use_pdl, cudaStream_t stream) {
  const int tiles = EPI == EPI_SILU ? (p.N / 2 + 7) / 8 : (p.N + 15) / 16;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(tiles);
  config.blockDim = dim3(KS * 32);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = use_pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, gemv_fp8_mma_kernel<KS, U, EPI>, p);
}

template <int KS, int U>
cudaError_t launch_epi(const Params& p, int epi, int use_pdl, cudaStream_t stream) {
  switch (epi) {
    case EPI_STORE: return launch_one<KS, U, EPI_STORE>(p, use_pdl, stream);
    case EPI_RESIDUAL: return launch_one<KS, U, EPI_RESIDUAL>(p, use_pdl, stream);
    default: return launch_one<KS, U, EPI_SILU>(p, use_pdl, stream);
  }
}

template <int KS>
cudaError_t launch_u(const Params& p, int u, int epi, int use_pdl, cudaStream_t stream) {
  switch (u) {
    case 2: return launch_epi<KS, 2>(p, epi, use_pdl, stream);
    case 4: return launch_epi<KS, 4>(p, epi, use_pdl, stream);
    default: return launch_epi<KS, 8>(p, epi, use_pdl, stream);
  }
}

}  // namespace mxc_gemv_mma

using namespace mxc_gemv_mma;

extern "C" {

// Status codes (mxc.kernels.cuda_fp8_gemv.STATUS)
enum { OK = 0, BAD_SHAPE = 1, BAD_ALIGNMENT = 2, BAD_CONFIG = 3, CUDA_ERROR = 4 };

static cudaError_t last_error = cudaSuccess;

const char* mxc_gemv_fp8_mma_error() { return cudaGetErrorString(last_error); }

int mxc_gemv_fp8_mma_supports(int M, int N, int K, int epi) {
  if (M < 1 || M > MAX_M || N < 1 || K < CHUNK || K % CHUNK != 0) return BAD_SHAPE;
  if (epi < EPI_STORE || epi > EPI_SILU || (epi == EPI_SILU && N % 2 != 0)) return BAD_SHAPE;
  return OK;
}

// ks: warps a CTA (K split), 1, 2, 4 or 8; u: 64-byte chunks of a row in flight a thread, 2, 4 or 8
int mxc_gemv_fp8_mma(const void* x, const float* xs, const void* w, const float* s, const void* residual, void* y,
                     int M, int N, int K, int epi, int ks, int u, int use_pdl, cudaStream_t stream) {
  if (mxc_gemv_fp8_mma_supports(M, N, K, epi) != OK) return BAD_SHAPE;
  if ((epi == EPI_RESIDUAL) != (residual != nullptr)) return BAD_SHAPE;
  if (reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(w) % 16) return BAD_ALIGNMENT;
  if (u != 2 && u != 4 && u != 8) return BAD_CONFIG;
  Params p{static_cast<const uint8_t*>(x), xs, static_cast<const uint8_t*>(w), s,
           static_cast<const __nv_bfloat16*>(residual), static_cast<__nv_bfloat16*>(y), M, N, K};
  switch (ks) {
    case 1: last_error = launch_u<1>(p, u, epi, use_pdl, stream); break;
    case 2: last_error = launch_u<2>(p, u, epi, use_pdl, stream); break;
    case 4: last_error = launch_u<4>(p, u, epi, use_pdl, stream); break;
    case 8: last_error = launch_u<8>(p, u, epi, use_pdl, stream); break;
    default: return BAD_CONFIG;
  }
  return last_error == cudaSuccess ? OK : CUDA_ERROR;
}

}  // extern "C"
