// The Hopper backward at head dim 256 (head dims 129 to 256, zero-padded;
// sm_90a; MLA's 192 / 128: flash_bwd_sm90_mla.cu), with dQ accumulated in
// float32: one thread block per (block of 64 keys, key/value head, batch). The
// producer warp streams Q and dO tiles as in the backward of smaller head dims
// (flash_bwd_sm90.cuh). A consumer cannot keep both dK and dV of 64 keys in
// registers here (256 a thread), so both consumer
// warpgroups work on the block's 64 keys, each keeping part of the columns of
// dK and dV, and split a tile's work (BwdSplitTileConfig):
//   consumer 0: S^T = K Q^T, P^T = exp(S^T * scale - lse); P^T to shared memory
//   consumer 1: dP^T = V dO^T; reads P^T; dS^T = P^T * (dP^T - delta), to
//               shared memory; consumer 0 reads it
//   both:       dV += P^T dO and dK += dS^T Q over their columns (the A
//               operand from registers), then dQ = dS K over their 64-column
//               slices, each added to dq_accum by atomics
// With dropout both consumers draw the tile's Philox numbers (the same ones,
// for the same scores: their score tiles share one register layout): consumer
// 1 drops dP^T where the forward dropped P, and both drop P^T for dV.
// A last kernel scales and rounds dq_accum into dq (convert_dq_accum, layout
// DqAccumLayout::kWgmmaTiles); delta = rowsum(dO * O) comes first.
#include <cmath>

#include "cuda/dq_accum.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_bwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {
namespace {

// The consumers' steps on a tile that are this kernel's own (the others:
// bwd_mainloop.cuh). The mainloop itself stays in the kernel's body, with the
// shared-memory pointers in its locals, and so does the score GEMM: moved into
// a function of its own (the loop, its body or the GEMM), or those pointers
// into a struct, it compiled to other PTX (the barriers' address arithmetic,
// the place of some instructions).

// P^T and dS^T lie in shared memory as store_transposed_tile writes them:
// rows of kBlockM queries (128 bytes) a key, 128-byte swizzled, so that dQ's
// wgmma reads dS^T as it lies. Reads one back as A fragments (ldmatrix: lane
// group m = lane / 8 addresses matrix m, rows +8 (m % 2), chunk + m / 2).
template <int kColBlockBytes, int kSteps>
__device__ __forceinline__ void load_transposed_tile(const unsigned char* tile, uint32_t (&frag)[kSteps][4], int tid,
                                                     int lane) {
  const int m = lane / 8, row = (tid / kWarpSize) * 16 + (m % 2) * 8 + lane % 8;
  const uint32_t tile_addr = ptx::smem_addr(tile);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    ptx::ldmatrix_x4(frag[kk], tile_addr + swizzled_chunk_offset<kColBlockBytes>(row, 2 * kk + m / 2));
  }
}

// Consumer 1's dS^T = P^T * (dP^T - delta), from dP^T in s (which becomes
// dS^T) and P^T as rounded for the GEMMs (and times the cap's derivative).
// With dropout (Z: 0 where dropped, 1 / (1 - p) where kept), dS^T = P^T * (Z
// dP^T - delta).
template <typename Elem, bool kDropout, bool kSoftcap, int kBlockM, int kRegs, int kSteps>
__device__ __forceinline__ void ds_from_rounded_probabilities(float (&s)[kRegs], const uint32_t (&p_frag)[kSteps][4],
                                                              const TileDropout<kBlockM>& dropout, float keep_scale,
                                                              const BackwardSoftcap& softcap,
                                                              const float (&lse_q)[kBlockM],
                                                              const float (&delta_q)[kBlockM], int lane) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const float pt = from_fragments<Elem>(p_frag, i);
    const float dpt = kDropout ? (dropout.keeps(i) ? s[i] * keep_scale : 0.f) : s[i];
    s[i] = pt * (dpt - delta_q[accumulator_column(i, lane)]);
    if constexpr (kSoftcap) s[i] *= softcap.cap_derivative(pt, lse_q[accumulator_column(i, lane)]);
  }
}

// A consumer's wgmma descriptors at their first k16 step; a stage, a buffer
// and a step move them by constant offsets. The score GEMM (K-major): consumer
// 0's K and Q, consumer 1's V and dO. N-major: this consumer's columns of
// stage 0's Q and dO as the B of dK += dS^T Q and dV += P^T dO (a step: 16
// rows of queries), and K as the B of dQ = dS K (a step: 16 keys).
template <typename Cfg>
struct SplitBwdDescriptors {
  uint64_t keys, queries, q_rows, dout_rows, k_dq;
  // dS as dQ's A operand: the dS^T buffer read transposed (M-major).
  uint64_t ds_dq;

  __device__ __forceinline__ SplitBwdDescriptors(unsigned char* s_k, unsigned char* s_v, unsigned char* s_q,
                                                 unsigned char* s_dout, unsigned char* s_ds, int consumer) {
    const uint32_t k_addr = ptx::smem_addr(s_k), q_addr = ptx::smem_addr(s_q), dout_addr = ptx::smem_addr(s_dout);
    keys = k_major_desc(consumer == 0 ? k_addr : ptx::smem_addr(s_v));
    queries = k_major_desc(consumer == 0 ? q_addr : dout_addr);
    auto col_block_bytes = [](int col) { return col / kSwizzleCols * Cfg::kQColBlockBytes; };
    q_rows = n_major_desc(q_addr + col_block_bytes(Cfg::dk_col0(consumer)), Cfg::kQColBlockBytes);
    dout_rows = n_major_desc(dout_addr + col_block_bytes(consumer * Cfg::kDvCols), Cfg::kQColBlockBytes);
    k_dq = n_major_desc(k_addr, Cfg::kKVColBlockBytes);
    ds_dq = n_major_desc(ptx::smem_addr(s_ds), Cfg::kDsColBlockBytes);
  }
};

// kDropout: dropout. kWindow: a sliding window (backward_block). kSoftcap:
// logit softcapping (BackwardSoftcap; consumer 1 takes the cap's derivative
// from the rounded P^T it reads back). kAlibi: ALiBi's bias on the recomputed scores.
// Softcap, ALiBi and dropout: one at most.
template <typename Elem, typename Cfg, bool kDropout, bool kWindow, bool kSoftcap, bool kAlibi>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_split_kernel(const __grid_constant__ BwdKernelParams kp) {
  static_assert(int{kDropout} + kSoftcap + kAlibi <= 1, "softcap, ALiBi or dropout");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kScoreRegs = kBlockM / 2;         // a thread's share of 64 keys x kBlockM queries
  constexpr int kDkRegs = Cfg::kDkCols / 2;       // and of its 64 x kDkCols dK
  constexpr int kDvRegs = Cfg::kDvCols / 2;       // and of its 64 x kDvCols dV
  constexpr int kDqRegs = kDqAccumSliceCols / 2;  // and of a 64 x 64 slice of dQ
  constexpr int kSteps = kBlockM / 16;            // k16 steps of P^T and dS^T as A operands
  const BwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = swizzle_aligned(smem_raw);
  unsigned char* s_k = smem;
  unsigned char* s_v = s_k + Cfg::kKBytes;
  unsigned char* s_q = s_v + Cfg::kVBytes;
  unsigned char* s_dout = s_q + kStages * Cfg::kQBytes;
  unsigned char* s_pt = s_dout + kStages * Cfg::kDoBytes;
  unsigned char* s_ds = s_pt + Cfg::kDsBytes;
  // Per stage: lse (in log2 units) and delta of the tile's queries.
  auto* s_stats = reinterpret_cast<float(*)[2][kBlockM]>(s_ds + Cfg::kDsBuffers * Cfg::kDsBytes);
  auto* bars = reinterpret_cast<BwdBarriers<kStages>*>(s_stats + kStages);
  static_assert(sizeof(BwdBarriers<kStages>) <= Cfg::kBarrierBytes, "the barriers' room (BwdTileConfig)");

  const BwdBlock block = backward_block<Cfg, kWindow>(kp);
  const int64_t col0 = block.col0;
  const Visibility seen(p);  // the keys each query sees: the causal diagonal, the window

  // Named barriers (0 is __syncthreads), both consumers: kPtReady, consumer 0
  // has stored the tile's P^T (and consumer 1 computed its dP^T); kDsReady,
  // consumer 1 its dS^T.
  constexpr int kPtReady = 1, kDsReady = 2;
  constexpr int kConsumerThreads = Cfg::kConsumers * kWarpgroupThreads;

  // Read from lane 0: the compiler then knows it is the same across the warp
  // and keeps what derives from it (the wgmma descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / kWarpgroupThreads, 0);
  if (threadIdx.x == 0) {
    init_backward_barriers<Cfg>(bars);
    if constexpr (kDropout) bars->dropout = dropout_state(params.dropout);
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    if (warp == 0 && block.tiles > 0) {
      load_backward_tiles<Cfg>(kp, block, s_k, s_v, s_q, s_dout, nullptr, s_stats, bars, lane);
    }
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % kWarpSize;
  const int key_row = (tid / kWarpSize) * 16 + lane / 4;  // and key_row + 8, in the block
  // This consumer's dQ slices: dq_slices from dq_slice0 on (consumer 1 has
  // the larger share: with equal shares, a constant count).
  const int dq_slice0 = Cfg::dq_slice0(consumer);
  constexpr int kMostDqSlices = Cfg::kDqSlices - Cfg::dq_slice0(1);
  const int dq_slices = consumer == 0 ? Cfg::dq_slice0(1) : kMostDqSlices;
  // Whether this thread holds key 0's dS (visibility.cuh: exactly 0 for rows that see key 0 alone).
  const bool holds_first_key = col0 + key_row == 0;

  const SplitBwdDescriptors<Cfg> desc(s_k, s_v, s_q, s_dout, s_ds, consumer);

  const float scale_log2 = score_scale_log2(p);
  const BackwardSoftcap softcap = kSoftcap ? BackwardSoftcap(p) : BackwardSoftcap();

  float dk[kDkRegs], dv[kDvRegs];
#pragma unroll
  for (int i = 0; i < kDkRegs; ++i) dk[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kDvRegs; ++i) dv[i] = 0.f;

  if (block.tiles > 0) ptx::mbarrier_wait(&bars->kv_full, 0);
  const int64_t padded_len_q = ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple;

  // tile % m_count and the tile's query head, head0 + tile / m_count, counted rather than divided.
  int m_index = 0;
  int64_t head = block.head0;
  for (int tile = 0; tile < block.tiles; ++tile) {
    const int stage = tile % kStages;
    const uint32_t parity = (tile / kStages) & 1;
    const uint32_t q_stage_offset = stage * Cfg::kQBytes, dout_stage_offset = stage * Cfg::kDoBytes;
    const int64_t row0 = (block.m_begin + m_index) * kBlockM, head_in_group = head - block.head0;
    const float alibi_log2 = kAlibi ? alibi_slope_log2(p, block.b, head) : 0.f;
    // Dropout's decisions for the tile (the same in both consumers).
    TileDropout<kBlockM> dropout;
    if constexpr (kDropout) dropout.draw(bars->dropout, p, block.b * p.heads_q + head, row0, col0 + key_row, lane);
    if (++m_index == block.m_count) {
      m_index = 0;
      ++head;
    }
    // This thread's 16 queries are columns 8j + 2 * (lane % 4) + e of the score tiles.
    const float(&lse_q)[kBlockM] = s_stats[stage][0];
    const float(&delta_q)[kBlockM] = s_stats[stage][1];

    // Consumer 0: S^T = K Q^T; consumer 1: dP^T = V dO^T (64 keys x kBlockM
    // queries, over the head dim).
    float s[kScoreRegs];
    ptx::mbarrier_wait(&bars->q_full[stage], parity);
    ptx::mbarrier_wait(&bars->dout_full[stage], parity);
    fence_registers(s);
    const uint64_t queries_stage_desc =
        desc_advance(desc.queries, consumer == 0 ? q_stage_offset : dout_stage_offset);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
      ptx::wgmma_ss<Elem, kBlockM>(s, desc_advance(desc.keys, k_major_step_bytes(Cfg::kKVColBlockBytes, kk)),
                                   desc_advance(queries_stage_desc, k_major_step_bytes(Cfg::kQColBlockBytes, kk)),
                                   kk > 0);
    }
    ptx::wgmma_commit();
    wgmma_wait_fenced<0>(s);

    uint32_t p_frag[kSteps][4], ds_frag[kSteps][4];
    unsigned char* ds_tile = s_ds + (tile % Cfg::kDsBuffers) * Cfg::kDsBytes;
    if (consumer == 0) {
      // P^T = exp2(S^T * scale * log2(e) - lse * log2(e)).
      transposed_probabilities<kBlockN, kWindow, kSoftcap, kAlibi>(s, p, col0, row0, seen, key_row, lane, lse_q,
                                                                   scale_log2, softcap, alibi_log2);
      // P^T to consumer 1. Its last reader, consumer 1's load of tile t - 1's,
      // came before that consumer's arrival at tile t - 1's kDsReady.
      to_fragments<Elem>(s, p_frag);
      store_transposed_tile<Cfg::kDsColBlockBytes>(s_pt, p_frag, key_row, lane);
      if constexpr (kDropout) dropout.drop(p_frag);
    }
    // (Each barrier is one bar.sync instruction for both consumers: bar.sync
    // is .aligned, which asks that every thread waiting at a barrier run the
    // same instruction.)
    ptx::named_barrier_sync(kPtReady, kConsumerThreads);
    if (consumer == 1) {
      // dS^T = P^T * (dP^T - delta), from P^T as rounded for the GEMMs.
      load_transposed_tile<Cfg::kDsColBlockBytes>(s_pt, p_frag, tid, lane);
      const float keep_scale = kDropout ? bars->dropout.keep_scale : 1.f;
      ds_from_rounded_probabilities<Elem, kDropout, kSoftcap>(s, p_frag, dropout, keep_scale, softcap, lse_q, delta_q,
                                                              lane);
      if constexpr (kDropout) dropout.drop(p_frag);
      zero_lone_key_rows<kBlockM, kWindow>(s, params, seen, col0, row0, holds_first_key, lane);
      // dS^T to its buffer (read by both consumers' dQ wgmma: the async
      // proxy). Its last readers, tile t - 2's dQ of both consumers and
      // consumer 0's load, were done before consumer 0 reached tile t - 1's kDsReady.
      to_fragments<Elem>(s, ds_frag);
      store_transposed_tile<Cfg::kDsColBlockBytes>(ds_tile, ds_frag, key_row, lane);
      ptx::fence_proxy_async();
    }
    // dV += P^T dO over this consumer's columns; consumer 0 then takes dS^T.
    accumulate_key_gradient<Elem>(dv, p_frag, desc.dout_rows, dout_stage_offset);
    ptx::named_barrier_sync(kDsReady, kConsumerThreads);
    if (consumer == 0) load_transposed_tile<Cfg::kDsColBlockBytes>(ds_tile, ds_frag, tid, lane);

    // dK += dS^T Q, then this consumer's slices of dQ's columns = dS K over
    // the block's keys, each added to the tile's dq_accum slice (one float4 a
    // thread and register quad: dq_accum's layout).
    accumulate_key_gradient<Elem>(dk, ds_frag, desc.q_rows, q_stage_offset);
    const uint64_t ds_tile_desc = desc_advance(desc.ds_dq, (tile % Cfg::kDsBuffers) * Cfg::kDsBytes);
    float* dq_tile = block.dq_accum + (head_in_group * padded_len_q + row0) * Cfg::kDqAccumCols;
#pragma unroll
    for (int i = 0; i < kMostDqSlices; ++i) {
      if (i == dq_slices) break;
      const int slice = dq_slice0 + i;
      float dq[kDqRegs];
      issue_dq_slice_gemm<Elem, Cfg>(dq, ds_tile_desc, desc.k_dq, slice);
      wgmma_wait_fenced<0>(dq);
      if (i == 0) {  // dV and dK are done (wgmma groups complete in order): Q's and dO's stages are free
        fence_registers(dv);
        fence_registers(dk);
        fence_registers(p_frag);
        fence_registers(ds_frag);
        ptx::mbarrier_arrive(&bars->dout_empty[stage]);
        ptx::mbarrier_arrive(&bars->q_empty[stage]);
      }
      add_dq_slice(dq_tile + slice * kDqAccumRowMultiple * kDqAccumSliceCols, dq, tid);
    }
  }

  // dK and dV, each consumer its half of the columns.
  const int dk_col0 = Cfg::dk_col0(consumer);
  store_key_gradient<Elem>(params.dk, p.head_dim, params, block, key_row, dk_col0, consumer * Cfg::kDkCols, lane, dk,
                           static_cast<float>(p.scale));
  const float dv_scale = kDropout ? static_cast<float>(dropout_keep_scale(params.dropout.p)) : 1.f;
  store_key_gradient<Elem>(params.dv, p.head_dim_v, params, block, key_row, consumer * Cfg::kDvCols,
                           consumer * Cfg::kDvCols, lane, dv, dv_scale);
#endif
}

}  // namespace

bool launch_hdim256_backward(const BwdParams& params, ElementType type, cudaStream_t stream) {
  bool launched = false;
  using Cfg = BwdSplitTileConfig<256>;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_flag(params.problem.has_window(), [&](auto window) {
      using Elem = decltype(elem);
      constexpr bool kWindow = decltype(window)::value;
      if (params.problem.softcap > 0.0) {
        launched = launch_backward_kernel<Elem, Cfg>(
            params, attention_backward_split_kernel<Elem, Cfg, false, kWindow, true, false>, stream);
      } else if (params.problem.alibi_slopes != nullptr) {
        launched = launch_backward_kernel<Elem, Cfg>(
            params, attention_backward_split_kernel<Elem, Cfg, false, kWindow, false, true>, stream);
      } else {
        dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
          launched = launch_backward_kernel<Elem, Cfg>(
              params, attention_backward_split_kernel<Elem, Cfg, decltype(dropout)::value, kWindow, false, false>,
              stream);
        });
      }
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
