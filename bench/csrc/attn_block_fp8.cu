// Lab: the attention half of an fp8 Llama-3-8B decoder layer at one token in one persistent launch (sm_90a).
//
//   xq, xs = the per-token e4m3 quantization of rms_norm(x, norm_w, eps)
//   qkv    = bf16(xq @ w_qkv^T * xs * s_qkv)                       [6144]: 32 q heads, 8 k, 8 v of 128
//   q, k   = RoPE(q), RoPE(k) at ``positions[0]`` (rounded to bf16); k, v written into the caches at cache_loc[0]
//   a      = softmax(q k^T * scale) v over the slot's kv_lens[0] rows (GQA: 4 q heads a kv head), bf16
//   aq, as = the per-token e4m3 quantization of a
//   y      = bf16(x + bf16(aq @ w_o^T * as * s_o))
//
// -- the work of six launches of today's chain (RMSNorm-quantize, qkv GEMV, RoPE + KV write, split attention,
// merge, o GEMV). Step 2 of docs/persistent_decode.md, built to be measured (bench/attn_block_lab.py), not wired to
// any build: fixed shapes (H 4096, 32/8 heads of 128), one token, 128 CTAs of 256 threads.
//
// The point of the design: no weight byte waits on an activation.
// - Before its PDL wait each CTA asks the TMA unit for its whole qkv slice (48 rows x 4096 B = 192 KB, contiguous,
//   six bulk copies) into shared memory, and L2 for its attention split's cache rows. The 25 MB of qkv weights
//   stream while the previous kernel ends and while the RMSNorm runs.
// - After the wait every CTA normalises and quantizes x itself (8 KB from L2), multiplies its slice (mma.sync
//   m16n8k32 e4m3, the token on N), and writes its 48 qkv values.
// - As soon as its qkv rows are multiplied, the CTA asks for its o slice (32 rows, 128 KB) into the same shared
//   memory: the o weights stream during the attention.
// - CTA (kv head g, split s) waits only for the CTAs that wrote head group g's q/k/v rows (a counter per group),
//   ropes q and the new k, writes the new k/v row (the split holding the new position), and attends its rows.
// - CTA b merges a quarter of q head b/4 once that head's kv group's 16 splits are in; every CTA waits for all
//   merges, quantizes the attention output per token and multiplies its o rows, adding the residual.
// What one CTA writes for others is tagged (the launch count in the same word); the counters and the launch count
// live in a workspace, and the last CTA out resets the counters, so the launch replays in a CUDA graph.
//
// Weights come pre-swizzled (the lab's ``swizzle``): in each row the 16-byte chunk c of every 128 bytes sits at
// c ^ (row & 7), so the dense rows in shared memory give conflict-free ldmatrix reads, and a CTA's slice is one
// contiguous block (large bulk copies: docs/persistent_decode.md, "Step 1, measured").
//
// Measured (H200, 2026-12-02, bench/attn_block_lab.py, 32 layers in a PDL graph, context 192): correct against the
// chain (2.7-3.8% of the attention output's scale: the o input quantized where the chain's one-token o GEMV is
// weight-only; tests/gpu/test_attn_block_lab_gpu.py), and not faster: 21.8-22.6 us a layer against the chain's
// 21.5-21.7 in its best counter form, 24.6 in this one. The weights are never what it waits for (the qkv slice is in
// shared memory when the RMSNorm ends); the stage-to-stage hops are: a fence while bulk copies or other SMs' traffic
// stream takes 2.5-4.5 us, and polling tagged words without counters took 8-16 us a hop. MXC_AB_CLUSTER (st.async
// into the peers' shared memory, no device-wide wait) ends a cluster's work 12.8 us after the wait against 18.4,
// but the H200 holds only 7 clusters of 16 CTAs at once, so the eighth runs after them: 35.8 us a layer. At one
// tp = 2 rank's shapes (MXC_AB_HQ=16, MXC_AB_HKV=4: 4 clusters, all resident) it takes 21.3 us against the chain's
// 19.4.
// docs/persistent_decode.md, "Step 2, measured".

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <cstdio>

namespace mxc_attn_block {

// Lab knob MXC_AB_TRACE (bench/attn_block_lab.py --libs .../trace.so): each CTA records %globaltimer at the stage boundaries
// below into a device buffer (TRACE_LAUNCHES launches), read back by mxc_attn_block_fp8_trace.
#ifndef MXC_AB_TRACE
#define MXC_AB_TRACE 0
#endif
constexpr int TRACE_POINTS = 16, TRACE_LAUNCHES = 64;
// Lab knob MXC_AB_LATE_O: the o slice's copies issued after the merge instead of after the qkv rows (HBM idle
// while the CTAs exchange the attention's words)
#ifndef MXC_AB_LATE_O
#define MXC_AB_LATE_O 0
#endif
// Lab knob MXC_AB_CLUSTER: each kv group's 16 CTAs form a thread block cluster and exchange through distributed
// shared memory (st.async into a peer's buffer, counted on the peer's mbarrier), with no device-wide wait: the group's 768 qkv rows (the weights in group order: q of its four
// heads, k, v), its splits' partials and its merged heads stay in the cluster; the o product is split by its
// input columns (each cluster multiplies its heads' 512 columns for all 4096 rows, the o input quantized with one
// scale a group) and summed by fp32 atomics, the last CTA out adding the residual.
#ifndef MXC_AB_CLUSTER
#define MXC_AB_CLUSTER 0
#endif
// Lab knob MXC_AB_SYNC: 1 (default) a reader of another CTA's words first waits for a counter (thread 0 polls with
// ld.acquire; writers count with __threadfence + atomicAdd); 0 readers poll the tagged words themselves, no counter
// and no fence (measured slower: docs/persistent_decode.md)
#ifndef MXC_AB_SYNC
#define MXC_AB_SYNC 1
#endif
#if MXC_AB_CLUSTER  // the peers' mbarriers carry the stages: no counter, no tagged word
#undef MXC_AB_SYNC
#define MXC_AB_SYNC 0
#endif
// Lab knob MXC_AB_STORE: how tagged words are written and polled: 0 st/ld.relaxed.gpu, 1 st/ld.volatile (as
// NCCL's LL protocol), 2 atom.exch.relaxed.gpu stores (performed at L2) with ld.relaxed.gpu polls
#ifndef MXC_AB_STORE
#define MXC_AB_STORE 0
#endif

// Lab knobs MXC_AB_HQ / MXC_AB_HKV: the heads (one rank of Llama-3-8B at tp = 2: 16 / 4, MXC_AB_CLUSTER only)
#ifndef MXC_AB_HQ
#define MXC_AB_HQ 32
#endif
#ifndef MXC_AB_HKV
#define MXC_AB_HKV 8
#endif
constexpr int H = 4096, HQ = MXC_AB_HQ, HKV = MXC_AB_HKV, D = 128, GROUP = HQ / HKV;
constexpr int NQKV = (HQ + 2 * HKV) * D;  // 6144 (3072 at tp = 2)
constexpr int G = 16 * HKV;                // CTAs (128)
constexpr int SPLITS = G / HKV;            // attention splits of a kv head
constexpr int QKV_ROWS = NQKV / G;         // 48: three m16 tiles
constexpr int O_ROWS = H / G;              // 32: two m16 tiles
constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int KB = H;                      // bytes of a weight row (K = 4096 e4m3)
constexpr int COPY_THREAD = THREADS - 32;  // issues the bulk copies (warp 7's lane 0)
constexpr int KW = KB / WARPS;             // bytes of K a warp multiplies: 512
constexpr int COPY = 32768;                // bytes of one bulk copy
constexpr int PART = D + 4;                // a head's partial: acc[D], m, l (padded: rows 16-byte aligned)
static_assert(NQKV % G == 0 && QKV_ROWS % 16 == 0 && H % G == 0 && O_ROWS % 16 == 0, "tiles");
static_assert(GROUP == 4, "the attention's thread layout takes four q heads a kv head");
static_assert(MXC_AB_CLUSTER || HQ * D == H, "without clusters the o product takes H inputs");
static_assert(QKV_ROWS * KB % COPY == 0, "copies");
static_assert(THREADS * 16 == H, "stage 1: 16 elements a thread");
static_assert(GROUP * D / 2 == THREADS, "attention combine: two dims a thread");

// shared memory
constexpr int W_BYTES = QKV_ROWS * KB;                           // 192 KB: the qkv slice, then the o slice
constexpr int XQ_OFF = W_BYTES;                                  // the quantized activation row [H]
constexpr int RED_OFF = XQ_OFF + H;                              // (WARPS + 1) x QKV_ROWS floats
constexpr int SCR_OFF = RED_OFF + 4 * (WARPS + 1) * QKV_ROWS;        // WARPS x GROUP x PART floats
constexpr int QS_OFF = SCR_OFF + 4 * WARPS * GROUP * PART;       // GROUP x D floats: the roped q
constexpr int SMALL_OFF = QS_OFF + 4 * GROUP * D;                // 32 floats
constexpr int BAR_OFF = SMALL_OFF + 4 * 32;                      // mbarriers: the qkv and o copies (and below)
// MXC_AB_CLUSTER: the group's qkv values, this CTA's merge inputs (a share of each split), the group's merged heads
constexpr int GROUP_ROWS = (GROUP + 2) * D;                      // 768 = SPLITS x QKV_ROWS
constexpr int O_COLS = GROUP * D;                                // 512: a group's share of the o input
// MXC_AB_CLUSTER: three more mbarriers count the bytes the peers' st.async deliver into the three buffers
constexpr int PART_IN = 32 + 2;                                  // a split's share of a merge: 32 acc dims, m, l
constexpr int GRP_OFF = BAR_OFF + 48;
constexpr int PARTS_OFF = GRP_OFF + 4 * GROUP_ROWS;              // SPLITS x PART_IN floats: this CTA's merge inputs
constexpr int OIN_OFF = PARTS_OFF + 4 * SPLITS * PART_IN;
constexpr int SMEM_BYTES = MXC_AB_CLUSTER ? OIN_OFF + 4 * O_COLS : BAR_OFF + 16;
static_assert(GROUP_ROWS == SPLITS * QKV_ROWS && H == SPLITS * 256, "cluster shapes: 256 o rows a CTA");
// bytes of a CTA's o slice: 32 rows of H inputs, or (MXC_AB_CLUSTER) 256 rows of its group's 512
constexpr int O_BYTES = MXC_AB_CLUSTER ? 256 * O_COLS : O_ROWS * KB;
static_assert(O_BYTES <= W_BYTES && O_BYTES % COPY == 0, "the o slice in the qkv slice's shared memory");

// workspace words (unsigned): CTAs out of this launch, launches done (the tag is that count + 1, 16 bits); with
// MXC_AB_SYNC the counters: CTAs that wrote each kv group's qkv rows, attention splits of each kv group, merges
constexpr int SYNC_EXIT = 0, SYNC_EPOCH = 1, SYNC_QKV = 2, SYNC_ATT = SYNC_QKV + HKV, SYNC_MERGE = SYNC_ATT + HKV,
              SYNC_WORDS = SYNC_MERGE + 1;

struct Params {
  const __nv_bfloat16* x;       // [H]: the residual stream (the layer's input)
  const __nv_bfloat16* norm_w;  // [H]
  float eps;
  const uint8_t* w_qkv;         // [NQKV, H] e4m3, swizzled
  const float* s_qkv;           // [NQKV]
  const uint8_t* w_o;           // [H, H] e4m3, swizzled
  const float* s_o;             // [H]
  const float* cos;             // [P, D / 2]
  const float* sin;
  __nv_bfloat16* k_cache;       // [S, L, HKV, D]
  __nv_bfloat16* v_cache;
  int L;
  const int* slots;             // [1]
  const int* kv_lens;           // [1]: rows after this token's (its position + 1)
  const long long* positions;   // [1]
  const long long* cache_loc;   // [1]: slot * L + position
  float qk_scale;               // softmax scale * log2(e)
  __nv_bfloat16* y;             // [H] (may be x)
  uint32_t* qkv;                // workspace [NQKV] tagged bf16
  uint2* part;                  // workspace [HKV, SPLITS, GROUP, PART] tagged fp32
  uint32_t* attn;               // workspace [H] tagged bf16
  unsigned* sync;               // workspace [SYNC_WORDS]; all the workspace zero before the first launch
  float* acc;                   // workspace [H] (MXC_AB_CLUSTER: the o product's sum), zero; left zero
};

// ---- PTX ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
constexpr long long WAIT_LIMIT_CYCLES = 4000000000LL;  // ~2 s: a wait this long is a bug; trap instead of hanging
__device__ __noinline__ void wait_timed_out(const char* what) {
  printf("mxc_attn_block_fp8: block %d thread %d: %s did not complete; trapping\n", blockIdx.x, threadIdx.x, what);
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
    if (clock64() - start > WAIT_LIMIT_CYCLES) wait_timed_out("a weight copy");
  }
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
// ---- tagged words: what one CTA publishes to others carries this launch's tag in the same single-copy-atomic
// word (as NCCL's LL protocol), so a reader polls the words it needs and no writer fences (a fence waits for the
// SM's bulk copies in flight: measured 4-5 us). Every launch writes every word once, so a word holds the previous
// launch's tag or this one's.
__device__ __forceinline__ void put_tagged(uint32_t* p, __nv_bfloat16 v, unsigned tag) {
  const uint32_t w = static_cast<uint32_t>(__bfloat16_as_ushort(v)) | (tag << 16);
#if MXC_AB_STORE == 1
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
#elif MXC_AB_STORE == 2
  uint32_t old;
  asm volatile("atom.exch.relaxed.gpu.global.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(w) : "memory");
#else
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
#endif
}
__device__ __forceinline__ void put_tagged(uint2* p, float v, unsigned tag) {
  const unsigned long long w = static_cast<unsigned long long>(__float_as_uint(v)) |
                               (static_cast<unsigned long long>(tag) << 32);
#if MXC_AB_STORE == 1
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
#elif MXC_AB_STORE == 2
  unsigned long long old;
  asm volatile("atom.exch.relaxed.gpu.global.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(w) : "memory");
#else
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
#endif
}
__device__ __forceinline__ uint32_t ld_relaxed32(const uint32_t* p) {
  uint32_t v;
#if MXC_AB_STORE == 1
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}
__device__ __forceinline__ unsigned long long ld_relaxed64(const void* p) {
  unsigned long long v;
#if MXC_AB_STORE == 1
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#else
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#endif
  return v;
}
// A reader loads every word it needs at once (``await_words``: all in flight together), then re-loads, again all
// at once, those read before their writer's store, until none is left: one round trip a round. (Settling the words
// one at a time costs a round trip for every word read early: measured 8 us for 16 words.)
template <typename Word, int N, typename Addr>
__device__ __forceinline__ void await_words(Word (&w)[N], Addr addr, unsigned tag) {
  auto stale = [tag](Word v) {
    return static_cast<unsigned>(v >> (8 * sizeof(Word) / 2)) != tag;
  };
  auto load = [](const void* q) -> Word {
    if constexpr (sizeof(Word) == 4) return ld_relaxed32(static_cast<const uint32_t*>(q));
    else return ld_relaxed64(q);
  };
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = load(addr(i));
  const long long start = clock64();
  while (true) {
    bool any = false;
#pragma unroll
    for (int i = 0; i < N; ++i) any |= stale(w[i]);
    if (!any) return;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (stale(w[i])) w[i] = load(addr(i));
    if (clock64() - start > WAIT_LIMIT_CYCLES) wait_timed_out("a tagged word");
  }
}
__device__ __forceinline__ float word_value(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float word_value(unsigned long long w) { return __uint_as_float(static_cast<uint32_t>(w)); }
// ---- clusters (MXC_AB_CLUSTER) ----
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// the address of ``p`` (this CTA's shared memory) in the shared memory of the cluster's CTA ``rank``
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
  return a;
}
// ``v`` into the cluster's shared memory at ``addr``, counting its 4 bytes on the mbarrier at ``bar`` (both
// cluster addresses of the same CTA): the write and its signal in one asynchronous operation, no fence
__device__ __forceinline__ void st_async(uint32_t addr, float v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(addr),
               "r"(__float_as_uint(v)), "r"(bar) : "memory");
}

// ---- counters (MXC_AB_SYNC) ----
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// thread 0 spins until *counter >= target, then the CTA goes on
__device__ __forceinline__ void cta_wait(const unsigned* counter, unsigned target) {
  if (MXC_AB_SYNC && threadIdx.x == 0) {
    const long long start = clock64();
    while (load_acquire(counter) < target)
      if (clock64() - start > WAIT_LIMIT_CYCLES) wait_timed_out("a counter wait");
  }
  if (MXC_AB_SYNC) __syncthreads();
}
// the CTA's writes so far (ordered before thread 0's fence by the barrier), then thread 0 counts the CTA in
// ``counter``. A fence waits while the SM's bulk copies stream (measured 3-4.5 us under the o slice's copies).
__device__ __forceinline__ void cta_signal(unsigned* counter) {
  if (!MXC_AB_SYNC) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}
// the kv groups whose q, k or v rows a CTA's qkv rows [48b, 48b + 48) hold (a bit each); group boundaries are
// multiples of 128 rows, so one row in 16 tells
__host__ __device__ inline unsigned qkv_groups(int b) {
  unsigned mask = 0;
  for (int r = b * QKV_ROWS; r < (b + 1) * QKV_ROWS; r += 16) {
    const int grp = r < HQ * D ? r / (GROUP * D) : r < (HQ + HKV) * D ? (r - HQ * D) / D : (r - (HQ + HKV) * D) / D;
    mask |= 1u << grp;
  }
  return mask;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
#if MXC_AB_TRACE
__device__ unsigned long long g_trace[TRACE_LAUNCHES][128][TRACE_POINTS];
__device__ unsigned g_launch;
#define TRACE(i)                                                                                  \
  do {                                                                                            \
    if (threadIdx.x == 0) {                                                                       \
      unsigned long long t_;                                                                      \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                      \
      g_trace[trace_launch % TRACE_LAUNCHES][blockIdx.x][i] = t_;                                 \
    }                                                                                             \
  } while (0)
#else
#define TRACE(i) \
  do {           \
  } while (0)
#endif
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ void ldsm_x4(uint32_t (&a)[4], const uint8_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ float round_bf(float v) { return bf(to_bf(v)); }

// ---- block reductions (fixed order: deterministic) ----
__device__ __forceinline__ float block_sum(float v, float* small) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // ``small`` may still be read by an earlier reduction
  if ((threadIdx.x & 31) == 0) small[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) s += small[w];
  return s;
}
__device__ __forceinline__ float block_max(float v, float* small) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) small[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = small[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) s = fmaxf(s, small[w]);
  return s;
}

// 16 values of a row (this thread's) -> e4m3 in xq, with the row's scale (the Triton quantize's numerics:
// xs = max(amax / 448, 1e-12), q = e4m3(clamp(v / xs, -448, 448))); returns xs
__device__ __forceinline__ float quantize_row(const float (&v)[16], uint8_t* xq, float* small) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = block_max(amax, small);
  const float xs = fmaxf(__fdiv_rn(amax, 448.f), 1e-12f);
  uint32_t packed[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float q = fminf(fmaxf(__fdiv_rn(v[4 * w + j], xs), -448.f), 448.f);
      const uint32_t byte = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
      word |= byte << (8 * j);
    }
    packed[w] = word;
  }
  *reinterpret_cast<uint4*>(xq + 16 * threadIdx.x) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  return xs;
}

__device__ __forceinline__ void load16(const __nv_bfloat16* src, float (&v)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(src + 16 * threadIdx.x);
  const uint4 a = __ldcg(p), b = __ldcg(p + 1);
  const __nv_bfloat16* ha = reinterpret_cast<const __nv_bfloat16*>(&a);
  const __nv_bfloat16* hb = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = bf(ha[i]);
    v[8 + i] = bf(hb[i]);
  }
}

// The CTA's weight rows (TILES m16 tiles, dense rows of KB swizzled bytes in ``w``) times the quantized row
// ``xq``: warp ``warp`` takes K bytes [warp * KW, +KW); the row sums, in a fixed order, in red[0..16 * TILES)
template <int TILES>
__device__ __forceinline__ void gemv_tiles(const uint8_t* w, const uint8_t* xq, float* red) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row = (lane & 7) + ((lane >> 3) & 1) * 8, half = (lane >> 4) & 1;
  float c[TILES][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
  const uint8_t* b_ptr = xq + warp * KW + t * 4;
#pragma unroll 4
  for (int s = 0; s < KW / 32; ++s) {
    const int k = warp * KW + s * 32 + half * 16;
    const int off = (k & ~127) + ((((k & 127) >> 4) ^ (row & 7)) << 4);
    const uint32_t b0 = g == 0 ? lds32(b_ptr + s * 32) : 0u;
    const uint32_t b1 = g == 0 ? lds32(b_ptr + s * 32 + 16) : 0u;
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      uint32_t a[4];
      ldsm_x4(a, w + (16 * i + row) * KB + off);
      mma_e4m3(c[i], a, b0, b1);
    }
  }
  // the token is the mma's column 0: lanes t == 0 hold rows g (c[0]) and g + 8 (c[2]) of each tile
  float* mine = red + warp * (16 * TILES);
  if (t == 0) {
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      mine[16 * i + g] = c[i][0];
      mine[16 * i + g + 8] = c[i][2];
    }
  }
  __syncthreads();
  if (tid < 16 * TILES) {
    float s = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < WARPS; ++w2) s += red[w2 * (16 * TILES) + tid];
    red[WARPS * 16 * TILES + tid] = s;
  }
  __syncthreads();
}

// MXC_AB_CLUSTER's o product: 256 rows of 512 swizzled bytes (``w``) times the group's quantized 512 inputs; warp
// w takes tiles 2w and 2w + 1 over all of K; lanes t == 0 return rows 32w + 16i + g and + 8 in c[i][0], c[i][2]
__device__ __forceinline__ void gemv_cols(const uint8_t* w, const uint8_t* xq, float (&c)[2][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row = (lane & 7) + ((lane >> 3) & 1) * 8, half = (lane >> 4) & 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll
  for (int s = 0; s < O_COLS / 32; ++s) {
    const int k = s * 32 + half * 16;
    const int off = (k & ~127) + ((((k & 127) >> 4) ^ (row & 7)) << 4);
    const uint32_t b0 = g == 0 ? lds32(xq + s * 32 + t * 4) : 0u;
    const uint32_t b1 = g == 0 ? lds32(xq + s * 32 + 16 + t * 4) : 0u;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t a[4];
      ldsm_x4(a, w + (32 * warp + 16 * i + row) * O_COLS + off);
      mma_e4m3(c[i], a, b0, b1);
    }
  }
}

// CTA b's o slice into ``wsm`` (where its qkv slice was), completing on ``bar``: the fence orders the CTA's
// earlier (generic-proxy) reads of that shared memory before the copies' writes. COPY_THREAD only.
__device__ __forceinline__ void load_o_slice(const Params& p, int b, uint8_t* wsm, uint64_t* bar, uint64_t policy) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, O_BYTES);
  const uint8_t* src = p.w_o + static_cast<size_t>(b) * O_BYTES;
  for (int c = 0; c < O_BYTES; c += COPY) bulk_load(wsm + c, src + c, COPY, bar, policy);
}

__global__ void __launch_bounds__(THREADS, 1) attn_block_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* wsm = smem;
  uint8_t* xq = smem + XQ_OFF;
  float* red = reinterpret_cast<float*>(smem + RED_OFF);
  float* scr = reinterpret_cast<float*>(smem + SCR_OFF);
  float* qs = reinterpret_cast<float*>(smem + QS_OFF);
  float* small = reinterpret_cast<float*>(smem + SMALL_OFF);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + BAR_OFF);
  const int b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#if MXC_AB_TRACE
  const unsigned trace_launch = *(volatile unsigned*)&g_launch;
#endif
  TRACE(0);

  // ---- before the wait: the qkv slice into shared memory, this split's cache rows into L2 ----
  uint64_t policy = 0;
  if (tid == COPY_THREAD) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
#if MXC_AB_CLUSTER
    for (int i = 2; i < 5; ++i) mbar_init(&bars[i], 1);
    mbar_expect_tx(&bars[2], 4 * GROUP_ROWS);       // the group's qkv rows, from every CTA of the cluster
    mbar_expect_tx(&bars[3], 4 * SPLITS * PART_IN);  // this CTA's merge inputs, from every split
    mbar_expect_tx(&bars[4], 4 * O_COLS);            // the group's merged heads, from every merge
#endif
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    policy = evict_first_policy();
    mbar_expect_tx(&bars[0], QKV_ROWS * KB);
    const uint8_t* src = p.w_qkv + static_cast<size_t>(b) * QKV_ROWS * KB;
    for (int c = 0; c < QKV_ROWS * KB; c += COPY) bulk_load(wsm + c, src + c, COPY, &bars[0], policy);
  }
  // the step's inputs are written before the graph's first kernel: readable before the wait
  const int g = b / SPLITS, s = b % SPLITS;
  const int n = __ldg(p.kv_lens), slot = __ldg(p.slots);
  const int pos = n - 1;
  const int chunk = (n + SPLITS - 1) / SPLITS;
  const int lo = s * chunk, hi = min(lo + chunk, n);
  const size_t row0 = static_cast<size_t>(slot) * p.L;
  for (int i = tid; i < 4 * (min(hi, pos) - lo); i += THREADS) {  // 2 lines of K and of V a row (not the new one)
    const size_t e = ((row0 + lo + (i >> 2)) * HKV + g) * D + (i & 1) * 64;
    prefetch_l2((i & 2) ? static_cast<const void*>(p.v_cache + e) : static_cast<const void*>(p.k_cache + e));
  }
  // how many CTAs write head group g's qkv rows (warp 0; every CTA computes the same)
  unsigned qkv_writers = 0;
  if (MXC_AB_SYNC && warp == 0) {
    for (int bb = lane; bb < G; bb += 32) qkv_writers += (qkv_groups(bb) >> g) & 1u;
#pragma unroll
    for (int o = 16; o; o >>= 1) qkv_writers += __shfl_xor_sync(0xffffffffu, qkv_writers, o);
  }
  const float s_qkv_row = tid < QKV_ROWS ? __ldg(p.s_qkv + b * QKV_ROWS + tid) : 0.f;
  const float s_o_row = tid < O_ROWS ? __ldg(p.s_o + b * O_ROWS + tid) : 0.f;
  float nw[16];
  load16(p.norm_w, nw);
  __syncthreads();  // the mbarriers' init before anyone waits on them
#if MXC_AB_CLUSTER
  cluster_sync();  // every CTA of the cluster running before any writes into another's shared memory
#endif

  asm volatile("griddepcontrol.wait;" ::: "memory");
  TRACE(1);
  const unsigned tag = (ld_relaxed32(p.sync + SYNC_EPOCH) + 1u) & 0xffffu;  // the last launch's, plus one

  // ---- stage 1: RMSNorm + quantize x (every CTA, redundantly) ----
  float v[16];
  load16(p.x, v);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) ss += v[i] * v[i];
  ss = block_sum(ss, small);
  const float rstd = rsqrtf(ss / H + p.eps);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = round_bf(nw[i] * round_bf(v[i] * rstd));
  const float xs = quantize_row(v, xq, small);
  __syncthreads();
  TRACE(2);

  // ---- stage 2: this CTA's 48 qkv rows ----
  mbar_wait(&bars[0], 0);
  TRACE(3);
  gemv_tiles<QKV_ROWS / 16>(wsm, xq, red);
  TRACE(4);
#if MXC_AB_CLUSTER
  // the group's rows (this CTA's 48 at 48 s) into every CTA of the cluster
  float* grp = reinterpret_cast<float*>(smem + GRP_OFF);
  if (tid < QKV_ROWS) {
    const float v = round_bf(red[WARPS * QKV_ROWS + tid] * xs * s_qkv_row);
#pragma unroll 4
    for (int q = 0; q < SPLITS; ++q) st_async(peer_addr(grp + s * QKV_ROWS + tid, q), v, peer_addr(&bars[2], q));
  }
#else
  if (tid < QKV_ROWS) put_tagged(p.qkv + b * QKV_ROWS + tid, to_bf(red[WARPS * QKV_ROWS + tid] * xs * s_qkv_row), tag);
#endif
  TRACE(5);
  if (MXC_AB_SYNC) {
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      const unsigned mask = qkv_groups(b);
      for (int grp = 0; grp < HKV; ++grp)
        if ((mask >> grp) & 1u) atomicAdd(p.sync + SYNC_QKV + grp, 1u);
    }
  }
  // the qkv slice is read: its shared memory takes the o slice (the generic-proxy reads ordered before the copies)
  if (tid == COPY_THREAD && !MXC_AB_LATE_O) load_o_slice(p, b, wsm, &bars[1], policy);
  TRACE(6);

  // ---- stage 3: attention of kv head g over rows [lo, hi) ----
  // this warp's first cache row of the split, loaded while the qkv rows are awaited (rows before the new one are
  // the step's input)
  const int j0 = lo + warp;
  const bool first_old = j0 < hi && j0 != pos;
  uint2 k_first = make_uint2(0u, 0u), v_first = make_uint2(0u, 0u);
  if (first_old) {
    const size_t e = ((row0 + j0) * HKV + g) * D + 4 * lane;
    k_first = __ldcg(reinterpret_cast<const uint2*>(p.k_cache + e));
    v_first = __ldcg(reinterpret_cast<const uint2*>(p.v_cache + e));
  }
  cta_wait(p.sync + SYNC_QKV + g, qkv_writers);  // thread 0 (warp 0) holds the count
#if MXC_AB_CLUSTER
  mbar_wait(&bars[2], 0);  // the group's qkv rows are in
#endif
  const long long position = __ldg(p.positions);
  {
    const int i = tid >> 6, d = tid & 63;  // q head g * GROUP + i, dims d and d + 64
    const float c = __ldg(p.cos + position * (D / 2) + d), sn = __ldg(p.sin + position * (D / 2) + d);
    const bool new_row = pos >= lo && pos < hi;  // this split holds the new row: rope k, write k and v
#if MXC_AB_CLUSTER
    const float q1 = grp[i * D + d], q2 = grp[i * D + d + 64];
    const float wk1 = grp[GROUP * D + d], wk2 = grp[GROUP * D + d + 64], wv = grp[(GROUP + 1) * D + (tid & (D - 1))];
#else
    const uint32_t* qh = p.qkv + (g * GROUP + i) * D;
    const uint32_t* kh = p.qkv + HQ * D + g * D;
    const uint32_t* vh = p.qkv + (HQ + HKV) * D + g * D;
    // q's two dims; with the new row, k's two dims (threads < 64) and v's (threads < 128), else q's again
    const uint32_t* src[5] = {qh + d, qh + d + 64, new_row && tid < 64 ? kh + d : qh + d,
                              new_row && tid < 64 ? kh + d + 64 : qh + d, new_row && tid < D ? vh + tid : qh + d};
    uint32_t w[5];
    await_words(w, [&](int j) { return src[j]; }, tag);
    const float q1 = word_value(w[0]), q2 = word_value(w[1]);
    const float wk1 = word_value(w[2]), wk2 = word_value(w[3]), wv = word_value(w[4]);
#endif
    qs[i * D + d] = round_bf(q1 * c - q2 * sn);
    qs[i * D + d + 64] = round_bf(q2 * c + q1 * sn);
    if (new_row && tid < D) {
      const size_t e = static_cast<size_t>(__ldg(p.cache_loc)) * HKV * D + g * D;
      if (tid < 64) {
        const float k1 = wk1, k2 = wk2;
        p.k_cache[e + d] = to_bf(k1 * c - k2 * sn);
        p.k_cache[e + d + 64] = to_bf(k2 * c + k1 * sn);
      }
      p.v_cache[e + tid] = to_bf(wv);
    }
  }
  __syncthreads();  // qs, and the new row visible to the CTA
  TRACE(7);
  {
    float q[GROUP][4], m[GROUP], l[GROUP], acc[GROUP][4];
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      const float4 qq = *reinterpret_cast<const float4*>(qs + i * D + 4 * lane);
      q[i][0] = qq.x; q[i][1] = qq.y; q[i][2] = qq.z; q[i][3] = qq.w;
      m[i] = -INFINITY;
      l[i] = 0.f;
      acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    }
    for (int j = lo + warp; j < hi; j += WARPS) {
      const size_t e = ((row0 + j) * HKV + g) * D + 4 * lane;
      const bool held = j == j0 && first_old;
      const uint2 kr = held ? k_first : __ldcg(reinterpret_cast<const uint2*>(p.k_cache + e));
      const uint2 vr = held ? v_first : __ldcg(reinterpret_cast<const uint2*>(p.v_cache + e));
      const __nv_bfloat16* kk = reinterpret_cast<const __nv_bfloat16*>(&kr);
      const __nv_bfloat16* vv = reinterpret_cast<const __nv_bfloat16*>(&vr);
      float sc[GROUP];
#pragma unroll
      for (int i = 0; i < GROUP; ++i) {
        float dot = q[i][0] * bf(kk[0]);
        dot = fmaf(q[i][1], bf(kk[1]), dot);
        dot = fmaf(q[i][2], bf(kk[2]), dot);
        dot = fmaf(q[i][3], bf(kk[3]), dot);
        sc[i] = dot;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int i = 0; i < GROUP; ++i) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], o);
#pragma unroll
      for (int i = 0; i < GROUP; ++i) {
        const float sv = sc[i] * p.qk_scale;
        const float mn = fmaxf(m[i], sv);
        const float corr = exp2f(m[i] - mn), pe = exp2f(sv - mn);
        l[i] = l[i] * corr + pe;
#pragma unroll
        for (int e2 = 0; e2 < 4; ++e2) acc[i][e2] = acc[i][e2] * corr + pe * bf(vv[e2]);
        m[i] = mn;
      }
    }
    float* mine = scr + warp * GROUP * PART;
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      *reinterpret_cast<float4*>(mine + i * PART + 4 * lane) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      if (lane == 0) {
        mine[i * PART + D] = m[i];
        mine[i * PART + D + 1] = l[i];
      }
    }
  }
  __syncthreads();
  {  // the warps' states combined (fixed order) into this split's partial: two dims a thread
    const int i = tid >> 6, d = 2 * (tid & 63);
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, scr[(w * GROUP + i) * PART + D]);
    float a0 = 0.f, a1 = 0.f, ls = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float* st = scr + (w * GROUP + i) * PART;
        const float f = exp2f(st[D] - mx);
        a0 += f * st[d];
        a1 += f * st[d + 1];
        ls += f * st[D + 1];
      }
    }
#if MXC_AB_CLUSTER
    // dims d, d + 1 of head i to the merge of (head i, dims d / 32 * 32..): CTA 4 i + d / 32, row s of its inputs
    const uint32_t dst = 4 * i + d / 32;
    float* in = reinterpret_cast<float*>(smem + PARTS_OFF) + s * PART_IN;
    const uint32_t bar = peer_addr(&bars[3], dst);
    st_async(peer_addr(in + d % 32, dst), a0, bar);
    st_async(peer_addr(in + d % 32 + 1, dst), a1, bar);
    if (d % 32 == 0) {
      st_async(peer_addr(in + 32, dst), mx, bar);
      st_async(peer_addr(in + 33, dst), ls, bar);
    }
#else
    uint2* out = p.part + ((g * SPLITS + s) * GROUP + i) * PART;
    put_tagged(out + d, a0, tag);
    put_tagged(out + d + 1, a1, tag);
    if (d == 0) {
      put_tagged(out + D, mx, tag);
      put_tagged(out + D + 1, ls, tag);
    }
#endif
  }
  cta_signal(p.sync + SYNC_ATT + g);
  TRACE(8);

  // ---- stage 4: merge a quarter of q head b / 4 over its kv group's splits ----
#if MXC_AB_CLUSTER
  float* oin = reinterpret_cast<float*>(smem + OIN_OFF);
  if (warp == 0) {  // head s / 4 of the group, dims (s % 4) * 32 + lane, into every CTA's o input
    const int i = s / 4, d = (s % 4) * 32 + lane;
    mbar_wait(&bars[3], 0);  // every split's share
    const float* in = reinterpret_cast<const float*>(smem + PARTS_OFF);
    float ms[SPLITS], as_[SPLITS], ls_[SPLITS];
#pragma unroll
    for (int q = 0; q < SPLITS; ++q) {
      ms[q] = in[q * PART_IN + 32];
      ls_[q] = in[q * PART_IN + 33];
      as_[q] = in[q * PART_IN + lane];
    }
    TRACE(9);
    float mx = -INFINITY;
#pragma unroll
    for (int q = 0; q < SPLITS; ++q) mx = fmaxf(mx, ms[q]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int q = 0; q < SPLITS; ++q) {
      const float f = exp2f(ms[q] - mx);
      num += f * as_[q];
      den += f * ls_[q];
    }
    const float v = round_bf(num / den);
#pragma unroll 4
    for (int q = 0; q < SPLITS; ++q) st_async(peer_addr(oin + i * D + d, q), v, peer_addr(&bars[4], q));
  }
  mbar_wait(&bars[4], 0);  // the group's heads are in this CTA's o input
  TRACE(10);
#else
  {
    const int h = b / 4, gh = h / GROUP, i = h % GROUP;
    cta_wait(p.sync + SYNC_ATT + gh, SPLITS);
    if (warp == 0) {
      const int d = (b % 4) * 32 + lane;
      const uint2* base = p.part + (gh * SPLITS * GROUP + i) * PART;
      // each split's m, l and this lane's acc dim
      unsigned long long w[3 * SPLITS];
      await_words(w, [&](int j) { return base + (j / 3) * GROUP * PART + (j % 3 == 0 ? D : j % 3 == 1 ? D + 1 : d); },
                  tag);
      TRACE(9);
      float mx = -INFINITY;
#pragma unroll
      for (int sp = 0; sp < SPLITS; ++sp) mx = fmaxf(mx, word_value(w[3 * sp]));
      float num = 0.f, den = 0.f;
#pragma unroll
      for (int sp = 0; sp < SPLITS; ++sp) {
        const float f = exp2f(word_value(w[3 * sp]) - mx);
        num += f * word_value(w[3 * sp + 2]);
        den += f * word_value(w[3 * sp + 1]);
      }
      put_tagged(p.attn + h * D + d, to_bf(num / den), tag);
    }
    cta_signal(p.sync + SYNC_MERGE);
    TRACE(10);
  }
#endif
  if (tid == COPY_THREAD && MXC_AB_LATE_O) load_o_slice(p, b, wsm, &bars[1], policy);

  // ---- stage 5: o rows [32b, 32b + 32) with the residual ----
  if (tid == 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#if MXC_AB_CLUSTER
  // the group's 512 inputs of o, quantized with one scale; this CTA's 256 rows of their columns, summed into acc
  const float a2[2] = {oin[2 * tid], oin[2 * tid + 1]};
  TRACE(11);
  float amax = fmaxf(fabsf(a2[0]), fabsf(a2[1]));
  amax = block_max(amax, small);
  const float as = fmaxf(__fdiv_rn(amax, 448.f), 1e-12f);
  {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float q = fminf(fmaxf(__fdiv_rn(a2[j], as), -448.f), 448.f);
      word |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) << (8 * j);
    }
    *reinterpret_cast<uint16_t*>(xq + 2 * tid) = static_cast<uint16_t>(word);
  }
  __syncthreads();
  TRACE(12);
  mbar_wait(&bars[1], 0);
  TRACE(13);
  {
    float c[2][4];
    gemv_cols(wsm, xq, c);
    TRACE(14);
    const int g8 = lane >> 2;
    if ((lane & 3) == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = s * 256 + 32 * warp + 16 * i + g8;
        atomicAdd(p.acc + r, c[i][0] * as * __ldg(p.s_o + r));
        atomicAdd(p.acc + r + 8, c[i][2] * as * __ldg(p.s_o + r + 8));
      }
    }
  }
  (void)s_o_row;
  // no CTA leaves while a peer may still write into its shared memory (every wait above has passed)
  cluster_sync();
  // the last CTA out adds the residual to the sum and zeroes it for the next launch
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    TRACE(15);
    const bool last = atomicAdd(p.sync + SYNC_EXIT, 1u) == G - 1;
    if (last) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    small[16] = last ? 1.f : 0.f;
  }
  __syncthreads();
  if (small[16] != 0.f) {
    float xv[16];
    load16(p.x, xv);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = 16 * tid + i;
      p.y[r] = to_bf(xv[i] + round_bf(__ldcg(p.acc + r)));
      __stcg(p.acc + r, 0.f);
    }
    __syncthreads();
    if (tid == 0) {
#if MXC_AB_TRACE
      g_launch = trace_launch + 1;
#endif
      p.sync[SYNC_EXIT] = 0;
      p.sync[SYNC_EPOCH] += 1;
      __threadfence();
    }
  }
#else
  cta_wait(p.sync + SYNC_MERGE, G);
  float a[16];
  {
    uint32_t w[16];
    await_words(w, [&](int i) { return p.attn + 16 * tid + i; }, tag);
#pragma unroll
    for (int i = 0; i < 16; ++i) a[i] = word_value(w[i]);
  }
  TRACE(11);
  const float as = quantize_row(a, xq, small);
  const float resid = tid < O_ROWS ? bf(p.x[b * O_ROWS + tid]) : 0.f;
  __syncthreads();
  TRACE(12);
  mbar_wait(&bars[1], 0);
  TRACE(13);
  gemv_tiles<O_ROWS / 16>(wsm, xq, red);
  TRACE(14);
  if (tid < O_ROWS)
    p.y[b * O_ROWS + tid] = to_bf(resid + round_bf(red[WARPS * O_ROWS + tid] * as * s_o_row));

  // the last CTA out resets the counters for the next launch (every CTA has passed its waits by then)
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    TRACE(15);
    if (atomicAdd(p.sync + SYNC_EXIT, 1u) == G - 1) {
#if MXC_AB_TRACE
      g_launch = trace_launch + 1;
#endif
      for (int i = SYNC_QKV; i < SYNC_WORDS; ++i) p.sync[i] = 0;
      p.sync[SYNC_EXIT] = 0;
      p.sync[SYNC_EPOCH] += 1;
      __threadfence();
    }
  }
#endif
}

}  // namespace mxc_attn_block

using namespace mxc_attn_block;

extern "C" {

static cudaError_t last_error = cudaSuccess;

const char* mxc_attn_block_fp8_error() { return cudaGetErrorString(last_error); }

int mxc_attn_block_fp8_smem() { return SMEM_BYTES; }

// trace builds: the last ``TRACE_LAUNCHES`` launches' stage times [launch % TRACE_LAUNCHES][CTA][point] (ns) into
// ``out`` and the launch count into ``launches``; 1 in a build without the trace
int mxc_attn_block_fp8_traced() { return MXC_AB_TRACE; }

int mxc_attn_block_fp8_trace(unsigned long long* out, unsigned* launches) {
#if MXC_AB_TRACE
  if ((last_error = cudaMemcpyFromSymbol(out, g_trace, sizeof(g_trace))) != cudaSuccess) return 4;
  if ((last_error = cudaMemcpyFromSymbol(launches, g_launch, sizeof(unsigned))) != cudaSuccess) return 4;
  return 0;
#else
  (void)out;
  (void)launches;
  return 1;
#endif
}
int mxc_attn_block_fp8_ctas() { return G; }
int mxc_attn_block_fp8_sync_words() { return SYNC_WORDS; }
int mxc_attn_block_fp8_part_floats() { return HKV * SPLITS * GROUP * PART; }

// Before the first launch (outside graph capture): the kernel's shared-memory limit; 3 where a CTA cannot be
// resident or the device has fewer SMs than CTAs
int mxc_attn_block_fp8_cluster() { return MXC_AB_CLUSTER; }

static void launch_config(cudaLaunchConfig_t& config, cudaLaunchAttribute (&attr)[2], int use_pdl,
                          cudaStream_t stream) {
  config = {};
  config.gridDim = dim3(G);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = SMEM_BYTES;
  config.stream = stream;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = use_pdl ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = MXC_AB_CLUSTER ? SPLITS : 1;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = MXC_AB_CLUSTER ? 2 : 1;
}

static int active_clusters = -1;
int mxc_attn_block_fp8_active_clusters() { return active_clusters; }

// Before the first launch (outside graph capture): the kernel's shared-memory limit; 3 where a CTA cannot be
// resident, the device has fewer SMs than CTAs, or (MXC_AB_CLUSTER) no cluster of 16 fits
int mxc_attn_block_fp8_prepare() {
  int device = 0, sms = 0;
  if ((last_error = cudaGetDevice(&device)) != cudaSuccess) return 4;
  if ((last_error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return 4;
  if ((last_error = cudaFuncSetAttribute(attn_block_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         SMEM_BYTES)) != cudaSuccess)
    return 4;
  int per_sm = 0;
  if ((last_error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attn_block_kernel, THREADS, SMEM_BYTES)) !=
      cudaSuccess)
    return 4;
  if (per_sm < 1 || sms < G) return 3;
  if (MXC_AB_CLUSTER) {
    if ((last_error = cudaFuncSetAttribute(attn_block_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1)) !=
        cudaSuccess)
      return 4;
    cudaLaunchConfig_t config;
    cudaLaunchAttribute attr[2];
    launch_config(config, attr, 0, nullptr);
    config.attrs = attr + 1;  // the cluster dimension only
    config.numAttrs = 1;
    if ((last_error = cudaOccupancyMaxActiveClusters(&active_clusters, attn_block_kernel, &config)) != cudaSuccess)
      return 4;
    // no CTA waits for another cluster, so the clusters need not all be resident at once (the H200 holds 7 of 16
    // CTAs beside each other: the eighth runs after one of them)
    if (active_clusters < 1) return 3;
  }
  return 0;
}

int mxc_attn_block_fp8(const void* x, const void* norm_w, float eps, const void* w_qkv, const float* s_qkv,
                       const void* w_o, const float* s_o, const float* cos, const float* sin, void* k_cache,
                       void* v_cache, int L, const int* slots, const int* kv_lens, const long long* positions,
                       const long long* cache_loc, float qk_scale, void* y, void* qkv, void* part, void* attn,
                       unsigned* sync, float* acc, int use_pdl, cudaStream_t stream) {
  Params p{static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(norm_w), eps,
           static_cast<const uint8_t*>(w_qkv), s_qkv, static_cast<const uint8_t*>(w_o), s_o, cos, sin,
           static_cast<__nv_bfloat16*>(k_cache), static_cast<__nv_bfloat16*>(v_cache), L, slots, kv_lens, positions,
           cache_loc, qk_scale, static_cast<__nv_bfloat16*>(y), static_cast<uint32_t*>(qkv), static_cast<uint2*>(part),
           static_cast<uint32_t*>(attn), sync, acc};
  cudaLaunchConfig_t config;
  cudaLaunchAttribute attr[2];
  launch_config(config, attr, use_pdl, stream);
  if ((last_error = cudaLaunchKernelEx(&config, attn_block_kernel, p)) != cudaSuccess) return 4;
  return 0;
}

}  // extern "C"
