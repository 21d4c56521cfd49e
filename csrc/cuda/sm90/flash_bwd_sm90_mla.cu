// The Hopper backward at MLA's head dims (sm_90a): queries and keys of 192
// with values of 128 (136 to 192 and 72 to 128, zero-padded), one thread block
// per (block of 96 keys, key/value head, batch), BwdMlaTileConfig. The
// producer warp streams Q and dO tiles of 64 queries as in the other Hopper
// backwards (bwd_producer.cuh). Each consumer warpgroup owns 48 of the
// block's keys and, per tile:
//   S = Q K_c^T and dP = dO V_c^T (64 queries x its 48 keys: the queries as
//       rows, wgmma's M, which 48 keys cannot be);
//   P = exp2(S * scale * log2(e) - lse), dS = P (dP - delta), both rounded and
//       stored transposed (a key a row) into shared memory;
//   dV^T += dO^T P and dK^T += Q^T dS over its keys (head dim x 48 keys, both
//       operands from shared memory), once both consumers' dS^T are in;
//   its 64-column slices of dQ = dS K over the block's 96 keys (consumer 0
//       one, consumer 1 two), each added to dq_accum by atomics.
// dK^T and dV^T are turned back by 8 x 8 pieces (movmatrix) as they are
// stored. A last kernel scales and rounds dq_accum into dq (convert_dq_accum,
// layout DqAccumLayout::kWgmmaTiles); delta = rowsum(dO * O) comes first.
// No attn_mask, dropout, softcap, ALiBi or packed batch here
// (values_head_dim_covered); a window is taken.
#include <cmath>

#include "cuda/dq_accum.cuh"
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_bwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {
namespace {

using Cfg = BwdMlaTileConfig;

// A consumer's 64 queries x kKeys keys of a tile's scores S become P =
// exp2(S * score_scale - lse) (lse: the thread's two query rows', in log2
// units, +inf past the end), 0 where the causal diagonal, a window's edges
// (kWindow) or the end of the keys hide the pair: transposed_probabilities
// with the queries as rows. col0: the consumer's first key; row0: the tile's
// first query; query_row: the thread's first query in the tile (the other is
// query_row + 8).
template <bool kWindow, int kKeys, int kRegs>
__device__ __forceinline__ void probabilities(float (&s)[kRegs], const AttentionProblem& p, int64_t col0,
                                              int64_t row0, const Visibility& seen, int query_row, int lane,
                                              const float (&lse)[2], float score_scale) {
  constexpr int kBlockM = Cfg::kBlockM;
  const bool crosses_edge = kWindow ? seen.tile_is_partial(row0, kBlockM, col0, kKeys)
                                    : p.is_causal && col0 + kKeys - 1 > row0 + seen.offset;
  const bool crosses_end = col0 + kKeys > seen.len_k;
  if (crosses_edge || crosses_end) {
    auto in_tile = [](int64_t d) { return static_cast<int>(clamp_index(d, -kBlockM, kKeys)); };
    const int key_end = in_tile(seen.len_k - col0);
    const int right_edge = crosses_edge && seen.right >= 0 ? in_tile(row0 + seen.offset + seen.right - col0) : kKeys;
    const int left_edge = kWindow && seen.left >= 0 ? in_tile(row0 + seen.offset - seen.left - col0) : -kBlockM;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int key = accumulator_column(i, lane), query = query_row + accumulator_row_offset(i);
      const bool hidden = key >= key_end || key - query > right_edge || (kWindow && key - query < left_edge);
      s[i] = hidden ? 0.f : ptx::exp2_approx(s[i] * score_scale - lse[(i / 2) % 2]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) s[i] = ptx::exp2_approx(s[i] * score_scale - lse[(i / 2) % 2]);
  }
}

// Zeroes the dS of the tile's queries that see one key alone (exactly 0
// there, as SDPA gives: zero_lone_key_rows with the queries as rows). Without
// a window that key is key 0, in consumer 0's first column.
template <bool kWindow, int kRegs>
__device__ __forceinline__ void zero_lone_key_rows_by_rows(float (&ds)[kRegs], const BwdParams& params,
                                                           const Visibility& seen, int64_t col0, int64_t row0,
                                                           int consumer, int query_row, int lane) {
  if (params.sinks != nullptr) return;
  if constexpr (kWindow) {
    auto keys_seen = [&](int64_t row) { return seen.key_end(row) - seen.key_begin(row); };
    if (keys_seen(row0) > 1 && keys_seen(min(row0 + Cfg::kBlockM, seen.len_q) - 1) > 1) return;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      ds[i] = keys_seen(row0 + query_row + accumulator_row_offset(i)) == 1 ? 0.f : ds[i];
    }
  } else {
    if (col0 != 0 || consumer != 0) return;
    const RowRange alone = rows_seeing_first_key_alone(params, seen.offset, row0, Cfg::kBlockM);
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const bool first_key = accumulator_column(i, lane) == 0;
      ds[i] = first_key && alone.holds(query_row + accumulator_row_offset(i)) ? 0.f : ds[i];
    }
  }
}

// Stores a consumer's 64 queries x (16 kSteps) keys of A-fragment pairs (P or
// dS as to_fragments rounds them) transposed, into a tile of rows of 64
// queries, a key a row, 128-byte swizzled as the copy engine's tiles
// (swizzled_chunk_offset). Fragment register r of step kk holds keys 16 kk +
// 8 (r / 2) .. + 7 of the warp's queries 16 warp + 8 (r % 2) .. + 7: one 8 x 8
// matrix of one stmatrix.trans, which writes key row (lane % 8) of matrix
// lane / 8 from that lane's address. key0: the consumer's first key row.
template <int kSteps>
__device__ __forceinline__ void store_keys_as_rows(unsigned char* tile, const uint32_t (&frag)[kSteps][4], int key0,
                                                   int warp, int lane) {
  const int matrix = lane / 8, chunk = 2 * warp + matrix % 2;  // chunk: 8 queries
  const uint32_t tile_addr = ptx::smem_addr(tile);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const int row = key0 + 16 * kk + (matrix / 2) * 8 + lane % 8;
    ptx::stmatrix_x4_trans(tile_addr + swizzled_chunk_offset<Cfg::kDsColBlockBytes>(row, chunk), frag[kk]);
  }
}

// grad^T (kDimBlocks x 64 rows of head dim x the consumer's 48 keys) += A^T B
// over the tile's 64 queries: A the stage's dO or Q (rows_desc: its rows,
// read M-major, stage 0's), B the consumer's rows of P^T or dS^T (keys_desc,
// K-major). Issued, not committed.
template <typename Elem, int kDimBlocks, int kRegs>
__device__ __forceinline__ void issue_transposed_key_gradient(float (&grad)[kDimBlocks][kRegs], uint64_t rows_desc,
                                                              uint32_t stage_offset, uint64_t keys_desc) {
#pragma unroll
  for (int mb = 0; mb < kDimBlocks; ++mb) {
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk) {
      ptx::wgmma_ss<Elem, 2 * kRegs, 1, 0>(
          grad[mb], desc_advance(rows_desc, stage_offset + mb * Cfg::kQColBlockBytes + n_major_step_bytes(kk)),
          desc_advance(keys_desc, k_major_step_bytes(Cfg::kDsColBlockBytes, kk)), true);
    }
  }
}

// Stores a consumer's transposed dK or dV (dst, head dim `dim`; grad^T as
// issue_transposed_key_gradient accumulates it), times `scale`, rounded:
// each 8 x 8 piece of (head dim, keys) turned by movmatrix, so that a thread
// holds two adjacent columns of a key's row (8 rows of 16 bytes a store).
// key0: the consumer's first key in the block.
template <typename Elem, int kDimBlocks, int kRegs>
__device__ __forceinline__ void store_transposed_key_gradient(const TensorView4d& dst, int64_t dim,
                                                              const BwdBlock& block, int64_t len_k, int key0, int warp,
                                                              int lane, const float (&grad)[kDimBlocks][kRegs],
                                                              float scale) {
  Elem* head = head_ptr<Elem>(dst, block.b, block.h_kv);
#pragma unroll
  for (int mb = 0; mb < kDimBlocks; ++mb) {
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      const int64_t key = block.col0 + key0 + 8 * j + lane / 4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // (Before the turn: head dim row lane / 4 of the piece, keys 2 (lane % 4) and the next.)
        const uint32_t pair = ptx::movmatrix_trans(
            ptx::pack2<Elem>(grad[mb][4 * j + 2 * half] * scale, grad[mb][4 * j + 2 * half + 1] * scale));
        const int col = mb * 64 + warp * 16 + half * 8 + (lane % 4) * 2;
        if (key >= len_k || col >= dim) continue;
        Elem* at = head + key * dst.stride_row + col;
        if (col + 1 < dim) {
          *reinterpret_cast<uint32_t*>(at) = pair;
        } else {
          *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(pair & 0xffffu);
        }
      }
    }
  }
}

template <typename Elem, bool kWindow>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_mla_kernel(const __grid_constant__ BwdKernelParams kp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kStages = Cfg::kStages, kKeys = Cfg::kConsumerKeys;
  constexpr int kScoreRegs = kKeys / 2;           // a thread's share of 64 queries x 48 keys
  constexpr int kGradRegs = kKeys / 2;            // and of 64 head-dim rows x 48 keys of dK^T or dV^T
  constexpr int kDqRegs = kDqAccumSliceCols / 2;  // and of a 64 x 64 slice of dQ
  constexpr int kSteps = kKeys / 16;              // k16 steps of 48 keys
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
  static_assert(sizeof(BwdBarriers<kStages>) <= Cfg::kBarrierBytes, "the barriers' room (BwdMlaTileConfig)");

  const BwdBlock block = backward_block<Cfg, kWindow>(kp);
  const Visibility seen(p);  // the keys each query sees: the causal diagonal, the window

  // Named barrier (0 is __syncthreads): both consumers' P^T and dS^T of the tile are in.
  constexpr int kDsReady = 1;
  constexpr int kConsumerThreads = Cfg::kConsumers * kWarpgroupThreads;

  // Read from lane 0: the compiler then knows it is the same across the warp
  // and keeps what derives from it (the wgmma descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / kWarpgroupThreads, 0);
  if (threadIdx.x == 0) init_backward_barriers<Cfg>(bars);
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
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int query_row = warp * 16 + lane / 4;  // and query_row + 8, in the tile
  const int key0 = consumer * kKeys;           // this consumer's first key in the block
  const int64_t col0 = block.col0 + key0;
  const int dq_slice0 = Cfg::dq_slice0(consumer), dq_slices = Cfg::dq_slice_count(consumer);

  // wgmma descriptors at stage 0 and the first k16 step. K-major: Q and K
  // (S), dO and V (dP), the consumer's rows of P^T and dS^T (B of dV^T and
  // dK^T); M- or N-major: the rows of Q and dO (A of dK^T and dV^T), dS^T (A
  // of dQ) and K (B of dQ).
  const uint32_t k_addr = ptx::smem_addr(s_k), q_addr = ptx::smem_addr(s_q), dout_addr = ptx::smem_addr(s_dout);
  const uint32_t ds_addr = ptx::smem_addr(s_ds);
  const uint64_t q_desc = k_major_desc(q_addr), dout_desc = k_major_desc(dout_addr);
  const uint64_t k_desc = k_major_desc(k_addr + consumer * Cfg::kConsumerRowBytes);
  const uint64_t v_desc = k_major_desc(ptx::smem_addr(s_v) + consumer * Cfg::kConsumerRowBytes);
  const uint64_t pt_desc = k_major_desc(ptx::smem_addr(s_pt) + consumer * Cfg::kConsumerRowBytes);
  const uint64_t ds_keys_desc = k_major_desc(ds_addr + consumer * Cfg::kConsumerRowBytes);
  const uint64_t q_rows_desc = n_major_desc(q_addr, Cfg::kQColBlockBytes);
  const uint64_t dout_rows_desc = n_major_desc(dout_addr, Cfg::kQColBlockBytes);
  const uint64_t ds_dq_desc = n_major_desc(ds_addr, Cfg::kDsColBlockBytes);
  const uint64_t k_dq_desc = n_major_desc(k_addr, Cfg::kKVColBlockBytes);

  const float scale_log2 = score_scale_log2(p);

  float dk[Cfg::kColBlocks][kGradRegs], dv[Cfg::kColBlocksV][kGradRegs];
#pragma unroll
  for (int mb = 0; mb < Cfg::kColBlocks; ++mb) {
#pragma unroll
    for (int i = 0; i < kGradRegs; ++i) dk[mb][i] = 0.f;
  }
#pragma unroll
  for (int mb = 0; mb < Cfg::kColBlocksV; ++mb) {
#pragma unroll
    for (int i = 0; i < kGradRegs; ++i) dv[mb][i] = 0.f;
  }

  if (block.tiles > 0) ptx::mbarrier_wait(&bars->kv_full, 0);
  const int64_t padded_len_q = ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple;

  // tile % m_count and the tile's query head, head0 + tile / m_count, counted rather than divided.
  int m_index = 0;
  int64_t head_in_group = 0;
  for (int tile = 0; tile < block.tiles; ++tile) {
    const int stage = tile % kStages;
    const uint32_t parity = (tile / kStages) & 1;
    const uint32_t q_stage_offset = stage * Cfg::kQBytes, dout_stage_offset = stage * Cfg::kDoBytes;
    const int64_t row0 = (block.m_begin + m_index) * kBlockM;
    float* dq_tile = block.dq_accum + (head_in_group * padded_len_q + row0) * Cfg::kDqAccumCols;
    if (++m_index == block.m_count) {
      m_index = 0;
      ++head_in_group;
    }

    // S = Q K_c^T over the head dim, dP = dO V_c^T over the values': two groups.
    float s[kScoreRegs], dp[kScoreRegs];
    ptx::mbarrier_wait(&bars->q_full[stage], parity);
    ptx::mbarrier_wait(&bars->dout_full[stage], parity);
    fence_registers(s);
    fence_registers(dp);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
      ptx::wgmma_ss<Elem, kKeys>(s, desc_advance(q_desc, q_stage_offset + k_major_step_bytes(Cfg::kQColBlockBytes, kk)),
                                 desc_advance(k_desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk)), kk > 0);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < Cfg::kHeadDimV / 16; ++kk) {
      const uint32_t dout_step = dout_stage_offset + k_major_step_bytes(Cfg::kQColBlockBytes, kk);
      ptx::wgmma_ss<Elem, kKeys>(dp, desc_advance(dout_desc, dout_step),
                                 desc_advance(v_desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk)), kk > 0);
    }
    ptx::wgmma_commit();
    const float lse[2] = {s_stats[stage][0][query_row], s_stats[stage][0][query_row + 8]};
    const float delta[2] = {s_stats[stage][1][query_row], s_stats[stage][1][query_row + 8]};

    // P, to its shared-memory rows (each consumer its own; read by its dV^T GEMM of the last tile, done).
    wgmma_wait_fenced<1>(s);
    probabilities<kWindow, kKeys>(s, p, col0, row0, seen, query_row, lane, lse, scale_log2);
    uint32_t frag[kSteps][4];
    to_fragments<Elem>(s, frag);
    store_keys_as_rows(s_pt, frag, key0, warp, lane);

    // dS = P (dP - delta), to the tile's dS^T buffer. Its last readers, tile
    // t - 2's GEMMs of both consumers, were done before they reached tile t - 1's kDsReady.
    wgmma_wait_fenced<0>(dp);
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) dp[i] = s[i] * (dp[i] - delta[(i / 2) % 2]);
    zero_lone_key_rows_by_rows<kWindow>(dp, params, seen, block.col0, row0, consumer, query_row, lane);
    to_fragments<Elem>(dp, frag);
    const uint32_t ds_buffer_offset = (tile % Cfg::kDsBuffers) * Cfg::kDsBytes;
    store_keys_as_rows(s_ds + ds_buffer_offset, frag, key0, warp, lane);
    ptx::fence_proxy_async();  // (the wgmma that read them: the async proxy)
    ptx::named_barrier_sync(kDsReady, kConsumerThreads);

    // This consumer's first dQ slice = dS K over the block's keys; then dV^T
    // += dO^T P and dK^T += Q^T dS, one group; the slice is added while they run.
    const uint64_t ds_tile_desc = desc_advance(ds_dq_desc, ds_buffer_offset);
    float dq[kDqRegs];
    issue_dq_slice_gemm<Elem, Cfg>(dq, ds_tile_desc, k_dq_desc, dq_slice0);
    fence_registers(dv);
    fence_registers(dk);
    ptx::wgmma_fence();
    issue_transposed_key_gradient<Elem>(dv, dout_rows_desc, dout_stage_offset, pt_desc);
    issue_transposed_key_gradient<Elem>(dk, q_rows_desc, q_stage_offset, desc_advance(ds_keys_desc, ds_buffer_offset));
    ptx::wgmma_commit();
    wgmma_wait_fenced<1>(dq);
    add_dq_slice(dq_tile + dq_slice0 * kDqAccumRowMultiple * kDqAccumSliceCols, dq, tid);
    if (dq_slices > 1) issue_dq_slice_gemm<Elem, Cfg>(dq, ds_tile_desc, k_dq_desc, dq_slice0 + 1);
    // dV^T and dK^T are done (wgmma groups complete in order): Q's and dO's stages are free.
    wgmma_wait_fenced<0>(dv, dk, dq);
    ptx::mbarrier_arrive(&bars->dout_empty[stage]);
    ptx::mbarrier_arrive(&bars->q_empty[stage]);
    if (dq_slices > 1) add_dq_slice(dq_tile + (dq_slice0 + 1) * kDqAccumRowMultiple * kDqAccumSliceCols, dq, tid);
  }

  const int64_t len_k = p.len_k;
  store_transposed_key_gradient<Elem>(params.dk, p.head_dim, block, len_k, key0, warp, lane, dk,
                                      static_cast<float>(p.scale));
  store_transposed_key_gradient<Elem>(params.dv, p.head_dim_v, block, len_k, key0, warp, lane, dv, 1.f);
#endif
}

}  // namespace

bool launch_mla_backward(const BwdParams& params, ElementType type, cudaStream_t stream) {
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_flag(params.problem.has_window(), [&](auto window) {
      launched = launch_backward_kernel<decltype(elem), Cfg>(
          params, attention_backward_mla_kernel<decltype(elem), decltype(window)::value>, stream);
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
