// The fp8 MLP pair of batch-1..8 decode in one persistent launch (sm_90a):
//
//   h  = silu(bf16(xq @ w_gate^T * xs * s_gate)) * bf16(xq @ w_up^T * xs * s_up)     (each rounded to bf16)
//   hq, hs = the per-token e4m3 quantization of h (hs = max(amax(|h|) / 448, 1e-12); hq = e4m3(h * (1 / hs)))
//   y  = bf16(residual + bf16(hq @ w_down^T * hs * s_down))
//
// -- what today's chain computes with four launches (gate/up GEMV, SiLU-and-mul, quantize, down GEMV) after the
// gate/up input's quantize. With a norm weight the kernel takes x (bf16) instead of (xq, xs) and computes that
// quantize too: xq, xs = the per-token e4m3 quantization of rms_norm(x, norm_w, eps) (five launches in one).
// mxc.kernels.mlp_pair_fp8 owns the contract and the Python side.
//
// One CTA an SM, every CTA resident (the host checks). Each CTA has one producer warp and four consumer warps:
// - the producer streams weight chunks (32 rows x 1024 bytes, one bulk copy a row) into a shared-memory ring and
//   runs ahead of the consumers, across the gate/up -> down boundary: while the consumers wait for the other
//   CTAs' h, the ring already holds this CTA's first down chunks. It never waits on activations.
// - the consumers multiply each chunk with mma.sync m16n8k32 e4m3 (the weights on the M side, the tokens on
//   N: the "swap AB" of a GEMV), each warp a quarter of the chunk's columns; the four partial products are summed
//   in a fixed order through shared memory and warp 0 runs the epilogue.
// - gate/up unit u = 16 gate rows and the same 16 up rows (one chunk holds both, so the SiLU-and-mul is local);
//   its epilogue writes h's 16 columns and folds their per-token |max| into the token's amax (an atomic max). A CTA
//   that has done its gate/up units counts itself in sync[0]; a CTA with down units waits for all of them, reads
//   the amax, quantizes h into shared memory and runs its down units (32 rows each) with the residual.
// - the last CTA to finish resets the counters and the amax, so the kernel replays in a CUDA graph.
// Work is assigned statically: gate/up units b, b + G, ...; down units G-1-b, 2G-1-b, ... (the CTAs with the
// fewest gate/up units take down units first). ``mxc_mlp_pair_fp8_schedule`` exposes the assignment.
//
// Measured (H200, 2026-12-01): correct, and slower than the chain it replaces (batch 1: 58.8 against 54.3 us a
// layer). The 32 one-row bulk copies a stage are the limit under the consumers' shared-memory reads (the weights
// in stage order, four 8 KB copies a stage, MXC_PAIR_TILED: 50.2), and the mid-layer boundary costs what the
// chain's boundaries cost; the lab knobs below and docs/persistent_decode.md ("Step 1, measured") say how that
// was found.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <cstdio>

namespace mxc_mlp_pair {

// Lab knobs (bench/mlp_pair_lab.py --pair-lib; a shipped build takes the defaults). MXC_PAIR_DIAG bits, timing only (the
// results are wrong): 1 the consumers skip the MMAs, 2 they skip the epilogues, 4 the producer copies each stage
// as four contiguous 8 KB blocks instead of 32 rows of 1 KB, 8 the copies carry no L2 evict-first hint, 16 the
// rows' pitch in the ring is 1152 bytes (128-byte aligned copies) instead of 1040, 32 the
// CTAs do not wait for each other at the gate/up -> down boundary (h and its scale partial).
// MXC_PAIR_PREFETCH=0: warp 0 loads a unit's epilogue operands (scales, residual) in the epilogue instead of a
// unit ahead. MXC_PAIR_RCP=0: the quantizes divide by the scale (IEEE, as the chain's kernels) instead of
// multiplying by its reciprocal. (Fourteenth run, batch 1: the two defaults save 4.5 us of a layer's 68.)
#ifndef MXC_PAIR_DIAG
#define MXC_PAIR_DIAG 0
#endif
#ifndef MXC_PAIR_PREFETCH
#define MXC_PAIR_PREFETCH 1
#endif
#ifndef MXC_PAIR_RCP
#define MXC_PAIR_RCP 1
#endif
// MXC_PAIR_LDSM: the weight fragments by ldmatrix.x4 (one instruction an m16 tile and k-step; 0: four 32-bit
// shared loads, 2.5 us slower a layer at batch 1)
#ifndef MXC_PAIR_LDSM
#define MXC_PAIR_LDSM 1
#endif

#ifndef MXC_PAIR_KT
#define MXC_PAIR_KT 1024
#endif
constexpr int KT = MXC_PAIR_KT;             // bytes of a weight row in one ring stage (one bulk copy)
// MXC_PAIR_TILED (lab): the weights come in ring-stage order (bench/mlp_pair_lab.py stage_order): each stage's
// 32 rows x KT bytes one contiguous block, copied as four bulk copies, rows dense in the ring with each row's
// 16-byte chunks at chunk ^ (row & 7) within their 128 bytes (conflict-free ldmatrix); needs MXC_PAIR_LDSM
#ifndef MXC_PAIR_TILED
#define MXC_PAIR_TILED 0
#endif
static_assert(!MXC_PAIR_TILED || MXC_PAIR_LDSM, "MXC_PAIR_TILED reads its fragments with ldmatrix");
// shared-memory pitch: rows 4 banks apart, conflict-free fragments (lab bit 16: rows 128-byte aligned, 8-way
// bank conflicts in the fragment loads; tiled: dense, the chunks swizzled instead)
constexpr int ROW_PITCH = MXC_PAIR_TILED ? KT : (MXC_PAIR_DIAG & 16) ? KT + 128 : KT + 16;
constexpr int STAGE_ROWS = 32;              // two m16 tiles
constexpr int STAGE_BYTES = STAGE_ROWS * ROW_PITCH;
constexpr unsigned STAGE_TX = STAGE_ROWS * KT;  // bytes the bulk copies of one stage deliver
constexpr int CONSUMER_WARPS = 4;
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;     // + the producer warp
constexpr int KSTEPS = KT / 32 / CONSUMER_WARPS;  // m16n8k32 steps a consumer warp takes of a stage
constexpr int MAX_M = 8;                    // tokens: the mma's N
constexpr int MAX_STAGES = 8;
constexpr int ACT_PAD = 16;                 // activation rows in shared memory: pitch K + 16 (4 banks apart)
constexpr int CONSUMER_BARRIER = 1;         // named barrier of the consumer warps (0 is __syncthreads)

struct Params {
  const uint8_t* xq;            // [M, H] e4m3: the gate/up input, quantized per token (unused with norm_w)
  const float* xs;              // [M]
  const __nv_bfloat16* x;       // [M, H]: the gate/up input before RMSNorm (with norm_w)
  const __nv_bfloat16* norm_w;  // [H] or null: the RMSNorm weight
  float eps;
  const uint8_t* w_gu;          // [2I, H] e4m3: gate rows, then up rows
  const float* s_gu;            // [2I]
  const uint8_t* w_d;           // [H, I] e4m3
  const float* s_d;             // [H]
  const __nv_bfloat16* residual;  // [M, H] or null
  __nv_bfloat16* y;             // [M, H] (may be residual)
  __nv_bfloat16* h;             // workspace [M, I]
  unsigned* sync;               // workspace [2 + MAX_M], zero before the first launch: CTAs past gate/up, CTAs
                                // done, then each token's amax(|h|) (float bits: max as unsigned for x >= 0)
  int M, H, I, stages;
};

// ---- the static schedule (host and device) ----
__host__ __device__ inline int up_units(int I) { return I / 16; }
__host__ __device__ inline int down_units(int H) { return H / STAGE_ROWS; }
__host__ __device__ inline int up_count(int b, int G, int I) {
  return b < up_units(I) ? (up_units(I) - 1 - b) / G + 1 : 0;
}
__host__ __device__ inline int down_first(int b, int G) { return G - 1 - b; }
__host__ __device__ inline int down_count(int b, int G, int H) {
  const int f = down_first(b, G);
  return f < down_units(H) ? (down_units(H) - 1 - f) / G + 1 : 0;
}

// ---- shared-memory layout (host and device) ----
__host__ __device__ inline int align128(int v) { return (v + 127) & ~127; }
constexpr int BAR_BYTES = 2 * MAX_STAGES * 8;                       // full[], empty[]
constexpr int RED_FLOATS = 2 * CONSUMER_WARPS * 32 * 8;             // two unit buffers of partial products
constexpr int SMALL_FLOATS = MAX_M + CONSUMER_WARPS;                // scales, the reductions' slots
__host__ __device__ inline int act_offset() { return align128(BAR_BYTES + 4 * (RED_FLOATS + SMALL_FLOATS)); }
__host__ __device__ inline int act_bytes(int M, int H, int I) { return M * ((H > I ? H : I) + ACT_PAD); }
__host__ __device__ inline int ring_offset(int M, int H, int I) { return align128(act_offset() + act_bytes(M, H, I)); }
__host__ __device__ inline int smem_bytes(int M, int H, int I, int stages) {
  return ring_offset(M, H, I) + stages * STAGE_BYTES;
}

// ---- PTX ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// A wait that has not ended after ~2 s (4e9 cycles) is a bug (a counter or a phase out of step): trap, so the
// launch fails with an error instead of hanging the GPU.
constexpr long long WAIT_LIMIT_CYCLES = 4000000000LL;
__device__ __noinline__ void wait_timed_out(const char* what) {
  printf("mxc_mlp_pair_fp8: block %d thread %d: %s did not complete; trapping\n", blockIdx.x, threadIdx.x, what);
  __trap();
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  uint32_t done = 0;
  const long long start = clock64();
  while (true) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    if (done) return;
    if (clock64() - start > WAIT_LIMIT_CYCLES) wait_timed_out("an mbarrier wait");
  }
}
// bytes from global to shared memory through the TMA unit, completing on ``bar``; the weights are read once a
// step, so they are marked first to evict from L2
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar, uint64_t policy) {
  if (MXC_PAIR_DIAG & 8) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
    return;
  }
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(CONSUMER_BARRIER), "n"(CONSUMERS) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
// four 8x8 b16 matrices (8 rows x 16 bytes each); lanes 8i..8i+7 give matrix i's row addresses
__device__ __forceinline__ void ldsm_x4(uint32_t (&a)[4], const uint8_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_u32(p)) : "memory");
}

// c[0..3] += a (16 x 32 e4m3, row-major fragment) * b (32 x 8 e4m3, column fragment), fp32 accumulation
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x / s for the quantizes (inv = 1 / s): a multiply (MXC_PAIR_RCP), or IEEE division as the chain's kernels
__device__ __forceinline__ float qdiv(float x, float s, float inv) {
#if MXC_PAIR_RCP
  (void)s;
  return x * inv;
#else
  (void)inv;
  return __fdiv_rn(x, s);
#endif
}

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }

// One ring stage: this warp's quarter of the stage's columns against the activation rows ``act`` (pitch
// ``pitch``, the stage's first column at ``col``); c0 for stage rows 0-15, c1 for rows 16-31.
__device__ __forceinline__ void stage_mma(const uint8_t* stage, const uint8_t* act, int pitch, int col, int M,
                                          int warp, int lane, float (&c0)[4], float (&c1)[4]) {
  const int g = lane >> 2, t = lane & 3;
  const int k0 = warp * (KT / CONSUMER_WARPS) + t * 4;
  const bool has_token = g < M;
  const uint8_t* b_ptr = act + (has_token ? g : 0) * pitch + col + k0;
#if MXC_PAIR_TILED
  const int row = (lane & 7) + ((lane >> 3) & 1) * 8, half = (lane >> 4) & 1;  // row & 7 the same at row + 16
  const uint8_t* r_ptr = stage + row * KT + warp * (KT / CONSUMER_WARPS);
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const int o = s * 32, k = o + half * 16;  // this lane's 16 bytes within the warp's quarter of the row
    const uint8_t* m = r_ptr + (k & ~127) + ((((k & 127) >> 4) ^ (row & 7)) << 4);
    uint32_t a_lo[4], a_hi[4];
    ldsm_x4(a_lo, m);
    ldsm_x4(a_hi, m + 16 * KT);
    const uint32_t b0 = has_token ? lds32(b_ptr + o) : 0u;
    const uint32_t b1 = has_token ? lds32(b_ptr + o + 16) : 0u;
    mma_e4m3(c0, a_lo, b0, b1);
    mma_e4m3(c1, a_hi, b0, b1);
  }
#elif MXC_PAIR_LDSM
  // this lane's row address for ldmatrix: matrices (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31),
  // (rows 8-15, k 16-31) of the k-step: the m16n8k32 A fragment's a0..a3
  const uint8_t* m_ptr = stage + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_PITCH + warp * (KT / CONSUMER_WARPS) +
                         ((lane >> 4) & 1) * 16;
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const int o = s * 32;
    uint32_t a_lo[4], a_hi[4];
    ldsm_x4(a_lo, m_ptr + o);
    ldsm_x4(a_hi, m_ptr + 16 * ROW_PITCH + o);
    const uint32_t b0 = has_token ? lds32(b_ptr + o) : 0u;
    const uint32_t b1 = has_token ? lds32(b_ptr + o + 16) : 0u;
    mma_e4m3(c0, a_lo, b0, b1);
    mma_e4m3(c1, a_hi, b0, b1);
  }
#else
  const uint8_t* a_ptr = stage + g * ROW_PITCH + k0;
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const int o = s * 32;
    const uint32_t a_lo[4] = {lds32(a_ptr + o), lds32(a_ptr + 8 * ROW_PITCH + o), lds32(a_ptr + o + 16),
                              lds32(a_ptr + 8 * ROW_PITCH + o + 16)};
    const uint8_t* a2 = a_ptr + 16 * ROW_PITCH;
    const uint32_t a_hi[4] = {lds32(a2 + o), lds32(a2 + 8 * ROW_PITCH + o), lds32(a2 + o + 16),
                              lds32(a2 + 8 * ROW_PITCH + o + 16)};
    const uint32_t b0 = has_token ? lds32(b_ptr + o) : 0u;
    const uint32_t b1 = has_token ? lds32(b_ptr + o + 16) : 0u;
    mma_e4m3(c0, a_lo, b0, b1);
    mma_e4m3(c1, a_hi, b0, b1);
  }
#endif
}

// One unit's chunks as the ring delivers them (``slot``/``parity``: the consumer's place in the ring, advanced):
// this warp's partial products of the unit's two m16 tiles, the chunks' activation columns at 0, KT, 2KT, ...
__device__ __forceinline__ void consume_unit(const uint8_t* ring, uint64_t* full, uint64_t* empty, int stages,
                                             int& slot, unsigned& parity, int chunks, const uint8_t* act, int pitch,
                                             int M, int warp, int lane, float (&c0)[4], float (&c1)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) c0[i] = c1[i] = 0.f;
  for (int c = 0; c < chunks; ++c) {
    mbar_wait(&full[slot], parity);
    if (!(MXC_PAIR_DIAG & 1)) stage_mma(ring + slot * STAGE_BYTES, act, pitch, c * KT, M, warp, lane, c0, c1);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // this warp is done with the stage
    if (++slot == stages) {
      slot = 0;
      parity ^= 1;
    }
  }
}

// The four warps' partial products of a unit -> their sum (fixed order) in warp 0's acc[8]: acc[0..3] the
// fragment of rows 0-15, acc[4..7] rows 16-31. Every consumer warp calls it; only warp 0 gets the sum.
__device__ __forceinline__ bool reduce_unit(float* red, int parity, int warp, int lane, const float (&c0)[4],
                                            const float (&c1)[4], float (&acc)[8]) {
  float* buf = red + parity * (CONSUMER_WARPS * 32 * 8);
  float4* mine = reinterpret_cast<float4*>(buf + (warp * 32 + lane) * 8);
  mine[0] = make_float4(c0[0], c0[1], c0[2], c0[3]);
  mine[1] = make_float4(c1[0], c1[1], c1[2], c1[3]);
  consumer_sync();
  if (warp != 0) return false;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
  for (int w = 0; w < CONSUMER_WARPS; ++w) {
    const float4* p = reinterpret_cast<const float4*>(buf + (w * 32 + lane) * 8);
    const float4 lo = p[0], hi = p[1];
    acc[0] += lo.x; acc[1] += lo.y; acc[2] += lo.z; acc[3] += lo.w;
    acc[4] += hi.x; acc[5] += hi.y; acc[6] += hi.z; acc[7] += hi.w;
  }
  return true;
}

// The global operands of a unit's epilogue in warp 0's lanes (loaded ahead of the epilogue with
// MXC_PAIR_PREFETCH, so their latency hides behind the next unit's chunks)
struct UpOps {
  float s_gate[2], s_up[2];  // rows g, g + 8 of the unit
};
__device__ __forceinline__ UpOps up_ops(const Params& p, int u, int lane) {
  const int r = 16 * u + (lane >> 2);
  return {{__ldg(p.s_gu + r), __ldg(p.s_gu + r + 8)}, {__ldg(p.s_gu + p.I + r), __ldg(p.s_gu + p.I + r + 8)}};
}
struct DownOps {
  float s_d[4];                // rows g, g + 8, g + 16, g + 24 of the unit
  __nv_bfloat16 residual[8];   // acc[i]'s element (zero without a residual or past M)
};
__device__ __forceinline__ DownOps down_ops(const Params& p, int v, int lane) {
  const int g = lane >> 2, t = lane & 3;
  DownOps o;
#pragma unroll
  for (int q = 0; q < 4; ++q) o.s_d[q] = __ldg(p.s_d + STAGE_ROWS * v + g + 8 * q);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = STAGE_ROWS * v + g + 8 * (i >> 1), n = 2 * t + (i & 1);
    o.residual[i] = (p.residual != nullptr && n < p.M) ? p.residual[static_cast<size_t>(n) * p.H + r] : to_bf(0.f);
  }
  return o;
}

// Gate/up epilogue of unit u (warp 0): h's columns 16u..16u+15; their per-token |max| into the amax.
__device__ __forceinline__ void up_epilogue(const Params& p, const float* scale, int u, int lane, const float (&acc)[8],
                                            const UpOps& ops) {
  if (MXC_PAIR_DIAG & 2) return;
  const int g = lane >> 2, t = lane & 3;
  float mx[2] = {0.f, 0.f};  // tokens 2t, 2t + 1
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 16 * u + g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    if (n < p.M) {
      const float xs = scale[n];
      const __nv_bfloat16 gate = to_bf(acc[i] * xs * ops.s_gate[i >> 1]);
      const __nv_bfloat16 up = to_bf(acc[4 + i] * xs * ops.s_up[i >> 1]);
      const float gf = bf(gate);
      const __nv_bfloat16 act = to_bf(__fdiv_rn(gf, 1.f + expf(-gf)));
      const __nv_bfloat16 hv = to_bf(bf(act) * bf(up));
      p.h[static_cast<size_t>(n) * p.I + r] = hv;
      mx[i & 1] = fmaxf(mx[i & 1], fabsf(bf(hv)));
    }
  }
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {  // over the 8 lanes of the same t: the unit's 16 rows
    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
  }
  if (g == 0) {
    if (2 * t < p.M) atomicMax(p.sync + 2 + 2 * t, __float_as_uint(mx[0]));
    if (2 * t + 1 < p.M) atomicMax(p.sync + 2 + 2 * t + 1, __float_as_uint(mx[1]));
  }
}

// Down epilogue of unit v (warp 0): y's rows 32v..32v+31 with the residual.
__device__ __forceinline__ void down_epilogue(const Params& p, const float* scale, int v, int lane, const float (&acc)[8],
                                              const DownOps& ops) {
  if (MXC_PAIR_DIAG & 2) return;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = STAGE_ROWS * v + g + 8 * (i >> 1), n = 2 * t + (i & 1);
    if (n < p.M) {
      const size_t at = static_cast<size_t>(n) * p.H + r;
      __nv_bfloat16 out = to_bf(acc[i] * scale[n] * ops.s_d[i >> 1]);
      if (p.residual != nullptr) out = to_bf(bf(ops.residual[i]) + bf(out));
      p.y[at] = out;
    }
  }
}

// Sum or max of one value per consumer thread, in a fixed order (lanes by a shuffle tree, then the warps in
// order); every consumer thread gets the result. ``slots``: CONSUMER_WARPS floats of shared memory.
template <bool MAX>
__device__ __forceinline__ float consumer_reduce(float v, float* slots, int warp, int lane) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = MAX ? fmaxf(v, o) : v + o;
  }
  if (lane == 0) slots[warp] = v;
  consumer_sync();
  float r = slots[0];
#pragma unroll
  for (int w = 1; w < CONSUMER_WARPS; ++w) r = MAX ? fmaxf(r, slots[w]) : r + slots[w];
  consumer_sync();  // the slots may be reused
  return r;
}

// Eight elements of rms_norm(x, w, eps) as the reference rounds them: bf16(w * bf16(x * rstd)).
__device__ __forceinline__ void norm8(const uint4& xr, const uint4& wr, float rstd, float (&out)[8]) {
  const __nv_bfloat162* xv = reinterpret_cast<const __nv_bfloat162*>(&xr);
  const __nv_bfloat162* wv = reinterpret_cast<const __nv_bfloat162*>(&wr);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = __bfloat1622float2(xv[j]), g = __bfloat1622float2(wv[j]);
    out[2 * j] = bf(to_bf(g.x * bf(to_bf(a.x * rstd))));
    out[2 * j + 1] = bf(to_bf(g.y * bf(to_bf(a.y * rstd))));
  }
}

// The gate/up input from x: RMSNorm, the per-token scale, e4m3 into ``act`` (rows ``pitch`` apart) and the scale
// into scale[m]; three passes over each row (from L1/L2: a row is H bf16), no row held in registers.
__device__ void rms_norm_quantize(const Params& p, uint8_t* act, int pitch, float* scale, float* slots, int tid,
                                  int warp, int lane) {
  const int vecs = p.H / 8;  // uint4 of 8 bf16 a row
  for (int m = 0; m < p.M; ++m) {
    const uint4* xr = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(m) * p.H);
    const uint4* wr = reinterpret_cast<const uint4*>(p.norm_w);
    float ss = 0.f;
#pragma unroll 4
    for (int i = tid; i < vecs; i += CONSUMERS) {
      const uint4 raw = xr[i];
      const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __bfloat1622float2(v[j]);
        ss = fmaf(a.x, a.x, ss);
        ss = fmaf(a.y, a.y, ss);
      }
    }
    const float rstd = rsqrtf(__fdiv_rn(consumer_reduce<false>(ss, slots, warp, lane), static_cast<float>(p.H)) + p.eps);
    float mx = 0.f;
#pragma unroll 4
    for (int i = tid; i < vecs; i += CONSUMERS) {
      float a[8];
      norm8(xr[i], __ldg(wr + i), rstd, a);
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fabsf(a[j]));
    }
    const float xs = fmaxf(__fdiv_rn(consumer_reduce<true>(mx, slots, warp, lane), 448.f), 1e-12f);
    if (tid == 0) scale[m] = xs;
    const float inv = __frcp_rn(xs);
#pragma unroll 4
    for (int i = tid; i < vecs; i += CONSUMERS) {
      float a[8];
      norm8(xr[i], __ldg(wr + i), rstd, a);
      uint32_t q[2];
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const uint32_t q0 = __nv_cvt_float2_to_fp8x2(make_float2(qdiv(a[4 * w], xs, inv), qdiv(a[4 * w + 1], xs, inv)),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t q1 = __nv_cvt_float2_to_fp8x2(make_float2(qdiv(a[4 * w + 2], xs, inv), qdiv(a[4 * w + 3], xs, inv)),
                                                     __NV_SATFINITE, __NV_E4M3);
        q[w] = q0 | (q1 << 16);
      }
      *reinterpret_cast<uint2*>(act + m * pitch + 8 * i) = make_uint2(q[0], q[1]);
    }
  }
}

__global__ void __launch_bounds__(THREADS, 1) mlp_pair_fp8_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + MAX_STAGES;
  float* red = reinterpret_cast<float*>(smem + BAR_BYTES);
  float* scale = red + RED_FLOATS;  // [MAX_M]: this phase's activation scales
  float* slots = scale + MAX_M;     // [CONSUMER_WARPS]: consumer_reduce's
  uint8_t* act = smem + act_offset();
  uint8_t* ring = smem + ring_offset(p.M, p.H, p.I);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = gridDim.x, b = blockIdx.x;
  const int n_up = up_count(b, G, p.I), n_down = down_count(b, G, p.H);
  const int up_chunks = p.H / KT, down_chunks = p.I / KT;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {
    // the producer: weights only, so no wait for the kernels ahead (they cannot write them)
    const uint64_t policy = evict_first_policy();
    int slot = 0;
    unsigned parity = 1;  // a fresh barrier's previous phase counts as complete: the first lap does not wait
    for (int j = 0; j < n_up + n_down; ++j) {
      const bool up = j < n_up;
      const int unit = up ? b + j * G : down_first(b, G) + (j - n_up) * G;
      const int chunks = up ? up_chunks : down_chunks, K = up ? p.H : p.I;
      const uint8_t* row = up ? p.w_gu + static_cast<size_t>(16 * unit + (lane & 15) + (lane >= 16 ? p.I : 0)) * K
                              : p.w_d + static_cast<size_t>(STAGE_ROWS * unit + lane) * K;
      for (int c = 0; c < chunks; ++c) {
        mbar_wait(&empty[slot], parity);
        if (lane == 0) mbar_expect_tx(&full[slot], STAGE_TX);
        __syncwarp();
        if ((MXC_PAIR_DIAG & 4) || MXC_PAIR_TILED) {  // the stage as four contiguous 8 KB blocks (DIAG 4: wrong data)
          const uint8_t* blocks = (up ? p.w_gu : p.w_d) + (static_cast<size_t>(unit) * chunks + c) * STAGE_TX;
          if (lane < 4) bulk_load(ring + slot * STAGE_BYTES + lane * (STAGE_TX / 4), blocks + lane * (STAGE_TX / 4),
                                  STAGE_TX / 4, &full[slot], policy);
        } else {
          bulk_load(ring + slot * STAGE_BYTES + lane * ROW_PITCH, row + c * KT, KT, &full[slot], policy);
        }
        if (++slot == p.stages) { slot = 0; parity ^= 1; }
      }
    }
    return;
  }

  // the consumers: the activations and the residual come from the kernels ahead
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int tid = threadIdx.x;  // 0..CONSUMERS-1
  const int M = p.M;
  int slot = 0;
  unsigned parity = 0;
  int unit_parity = 0;
  float acc[8];

  // gate/up: xq into shared memory, rows H + 16 apart (quantized here from x with a norm weight)
  const int pitch_up = p.H + ACT_PAD;
  if (p.norm_w != nullptr) {
    rms_norm_quantize(p, act, pitch_up, scale, slots, tid, warp, lane);
  } else {
#pragma unroll 4
    for (int i = tid; i < M * (p.H / 16); i += CONSUMERS) {
      const int m = i / (p.H / 16), k = (i % (p.H / 16)) * 16;
      *reinterpret_cast<uint4*>(act + m * pitch_up + k) =
          *reinterpret_cast<const uint4*>(p.xq + static_cast<size_t>(m) * p.H + k);
    }
    if (tid < M) scale[tid] = p.xs[tid];
  }
  consumer_sync();

  int pending = -1;  // the unit whose sum warp 0 holds in acc, its epilogue not yet run
  for (int j = 0; j < n_up; ++j) {
    const int u = b + j * G;
    float c0[4], c1[4];
    UpOps ops;
    if (MXC_PAIR_PREFETCH && pending >= 0) ops = up_ops(p, pending, lane);
    consume_unit(ring, full, empty, p.stages, slot, parity, up_chunks, act, pitch_up, M, warp, lane, c0, c1);
    if (pending >= 0) {  // warp 0 only: the previous unit's
      if (!MXC_PAIR_PREFETCH) ops = up_ops(p, pending, lane);
      up_epilogue(p, scale, pending, lane, acc, ops);
    }
    pending = reduce_unit(red, unit_parity, warp, lane, c0, c1, acc) ? u : -1;
    unit_parity ^= 1;
  }
  if (pending >= 0) up_epilogue(p, scale, pending, lane, acc, up_ops(p, pending, lane));
  consumer_sync();  // every h column and amax of this CTA is written

  if (tid == 0) {
    __threadfence();
    atomicAdd(p.sync, 1u);
  }
  if (n_down > 0) {
    if (tid == 0) {
      const long long start = clock64();
      while (!(MXC_PAIR_DIAG & 32) && load_acquire(p.sync) < static_cast<unsigned>(G)) {
        if (clock64() - start > WAIT_LIMIT_CYCLES) wait_timed_out("the wait for every CTA's gate/up units");
      }
      __threadfence();
    }
    consumer_sync();
    if (tid == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    // the per-token scale of h from the maxima every gate/up unit folded in (read past L1: other CTAs wrote them)
    if (tid < M) scale[tid] = fmaxf(__fdiv_rn(__uint_as_float(__ldcg(p.sync + 2 + tid)), 448.f), 1e-12f);
    consumer_sync();

    // h -> e4m3 in shared memory, rows I + 16 apart: clamp(h / hs) rounded to nearest even (saturating)
    const int pitch_down = p.I + ACT_PAD;
#pragma unroll 8
    for (int i = tid; i < M * (p.I / 8); i += CONSUMERS) {
      const int m = i / (p.I / 8), k = (i % (p.I / 8)) * 8;
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.h + static_cast<size_t>(m) * p.I + k));
      const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
      const float s = scale[m], inv = __frcp_rn(s);
      uint32_t q[2];
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const float2 lo = __bfloat1622float2(v[2 * w]), hi = __bfloat1622float2(v[2 * w + 1]);
        const uint32_t q0 = __nv_cvt_float2_to_fp8x2(make_float2(qdiv(lo.x, s, inv), qdiv(lo.y, s, inv)),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t q1 = __nv_cvt_float2_to_fp8x2(make_float2(qdiv(hi.x, s, inv), qdiv(hi.y, s, inv)),
                                                     __NV_SATFINITE, __NV_E4M3);
        q[w] = q0 | (q1 << 16);
      }
      *reinterpret_cast<uint2*>(act + m * pitch_down + k) = make_uint2(q[0], q[1]);
    }
    consumer_sync();

    pending = -1;
    for (int j = 0; j < n_down; ++j) {
      const int v = down_first(b, G) + j * G;
      float c0[4], c1[4];
      DownOps ops;
      if (MXC_PAIR_PREFETCH && pending >= 0) ops = down_ops(p, pending, lane);
      consume_unit(ring, full, empty, p.stages, slot, parity, down_chunks, act, pitch_down, M, warp, lane, c0, c1);
      if (pending >= 0) {
        if (!MXC_PAIR_PREFETCH) ops = down_ops(p, pending, lane);
        down_epilogue(p, scale, pending, lane, acc, ops);
      }
      pending = reduce_unit(red, unit_parity, warp, lane, c0, c1, acc) ? v : -1;
      unit_parity ^= 1;
    }
    if (pending >= 0) down_epilogue(p, scale, pending, lane, acc, down_ops(p, pending, lane));
  } else if (tid == 0) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }

  // the last CTA out resets the counters for the next launch (every CTA has passed its wait by then)
  consumer_sync();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.sync + 1, 1u) == static_cast<unsigned>(G) - 1) {
      for (int i = 0; i < 2 + MAX_M; ++i) p.sync[i] = 0;
      __threadfence();
    }
  }
}

}  // namespace mxc_mlp_pair

using namespace mxc_mlp_pair;

extern "C" {

// Status codes (mxc.kernels.mlp_pair_fp8.STATUS)
enum { OK = 0, BAD_SHAPE = 1, BAD_ALIGNMENT = 2, NO_FIT = 3, CUDA_ERROR = 4 };

static cudaError_t last_error = cudaSuccess;

const char* mxc_mlp_pair_fp8_error() { return cudaGetErrorString(last_error); }

// 0 where (M, H, I) is a shape the kernel takes, else BAD_SHAPE
int mxc_mlp_pair_fp8_supports(int M, int H, int I) {
  return (M >= 1 && M <= MAX_M && H > 0 && I > 0 && H % KT == 0 && I % KT == 0 && H % STAGE_ROWS == 0) ? OK : BAD_SHAPE;
}

// Fill owner_up[I / 16] and owner_down[H / 32] with the CTA (of G) that runs each unit.
int mxc_mlp_pair_fp8_schedule(int G, int H, int I, int* owner_up, int* owner_down) {
  if (G <= 0 || mxc_mlp_pair_fp8_supports(1, H, I) != OK) return BAD_SHAPE;
  for (int b = 0; b < G; ++b) {
    for (int j = 0; j < up_count(b, G, I); ++j) owner_up[b + j * G] = b;
    for (int j = 0; j < down_count(b, G, H); ++j) owner_down[down_first(b, G) + j * G] = b;
  }
  return OK;
}

// Shared memory a CTA needs with ``stages`` ring stages.
int mxc_mlp_pair_fp8_smem(int M, int H, int I, int stages) { return smem_bytes(M, H, I, stages); }

// The launch plan on the current device: the ring stages that fit beside the activations (at most MAX_STAGES)
// and the grid (one CTA an SM, checked resident); NO_FIT where two stages do not fit or a CTA cannot be resident.
int mxc_mlp_pair_fp8_plan(int M, int H, int I, int* stages, int* ctas) {
  if (mxc_mlp_pair_fp8_supports(M, H, I) != OK) return BAD_SHAPE;
  int device = 0, optin = 0, sms = 0;
  if ((last_error = cudaGetDevice(&device)) != cudaSuccess) return CUDA_ERROR;
  if ((last_error = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess)
    return CUDA_ERROR;
  if ((last_error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return CUDA_ERROR;
  int s = MAX_STAGES;
  while (s >= 2 && smem_bytes(M, H, I, s) > optin) --s;
  if (s < 2) return NO_FIT;
  const int bytes = smem_bytes(M, H, I, s);
  // the limit is the kernel's, not a shape's: set to the device's, so a later plan for a smaller shape does not
  // lower it under a launch planned earlier
  if ((last_error = cudaFuncSetAttribute(mlp_pair_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin)) !=
      cudaSuccess)
    return CUDA_ERROR;
  int per_sm = 0;
  if ((last_error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mlp_pair_fp8_kernel, THREADS, bytes)) !=
      cudaSuccess)
    return CUDA_ERROR;
  if (per_sm < 1) return NO_FIT;
  *stages = s;
  *ctas = sms;
  return OK;
}

// Launch with a plan from mxc_mlp_pair_fp8_plan (called first, outside graph capture: it sets the kernel's
// shared-memory limit). ``sync`` must be zero before the first launch; the kernel leaves it zero.
// The gate/up input is (xq, xs), or with ``norm_w`` non-null x normalised (and quantized) in the kernel.
int mxc_mlp_pair_fp8(const void* xq, const float* xs, const void* x, const void* norm_w, float eps, const void* w_gu,
                     const float* s_gu, const void* w_d, const float* s_d, const void* residual, void* y, void* h,
                     unsigned* sync, int M, int H, int I, int stages, int ctas, int use_pdl,
                     cudaStream_t stream) {
  if (mxc_mlp_pair_fp8_supports(M, H, I) != OK || stages < 2 || stages > MAX_STAGES || ctas < 1) return BAD_SHAPE;
  if (norm_w == nullptr ? (xq == nullptr || xs == nullptr) : x == nullptr) return BAD_SHAPE;
  const void* aligned16[] = {norm_w == nullptr ? xq : x, norm_w == nullptr ? w_gu : norm_w, w_gu, w_d, h};
  for (const void* ptr : aligned16)
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return BAD_ALIGNMENT;
  Params p{static_cast<const uint8_t*>(xq), xs, static_cast<const __nv_bfloat16*>(x),
           static_cast<const __nv_bfloat16*>(norm_w), eps, static_cast<const uint8_t*>(w_gu), s_gu,
           static_cast<const uint8_t*>(w_d), s_d, static_cast<const __nv_bfloat16*>(residual),
           static_cast<__nv_bfloat16*>(y), static_cast<__nv_bfloat16*>(h), sync, M, H, I, stages};
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem_bytes(M, H, I, stages);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = use_pdl ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  if ((last_error = cudaLaunchKernelEx(&config, mlp_pair_fp8_kernel, p)) != cudaSuccess) return CUDA_ERROR;
  return OK;
}

}  // extern "C"
