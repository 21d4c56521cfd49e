// The Hopper backward kernel (sm_90a) at head dims up to 128, with dQ
// accumulated in float32 (flash_bwd_sm90.cu instantiates it without an
// attn_mask, flash_bwd_sm90_masked.cu with one): one
// thread block per (block of 128 keys, key/value head, batch), split by role
// into warpgroups as in the forward.
//  - In the producer warpgroup, one warp loads K and V once, then streams the
//    Q and dO tiles (kBlockM queries) of every query head of the group, with their
//    lse and delta, through a ring of stages (full / empty mbarriers); another
//    warp (the dQ writer) has the copy engine add each tile's dQ to dq_accum
//    (a bulk reduce from shared memory).
//  - Two consumer warpgroups own 64 keys each and keep their dK and dV in
//    registers. Per tile, with wgmma:
//      S^T = K Q^T and dP^T = V dO^T            (both operands in shared memory)
//      P^T = exp(S^T * scale - lse)              (registers)
//      dV += P^T dO                              (P^T from registers)
//      dS^T = P^T * (dP^T - delta)               (registers, and to shared memory)
//      dQ block = dS K, to shared memory         (both operands in shared memory)
//      dK += dS^T Q                              (dS^T from registers)
//    Each consumer computes one 64 x 64 block of dQ over all 128 keys (a
//    column half of the tile's at head dim 128, a row half at 64): the two
//    dS^T halves meet in shared memory. dQ is issued before dK so that its
//    shared-memory stores run under dK's wgmma.
// With dropout, P^T and dP^T are dropped where the forward dropped P (the same
// Philox numbers), before dV and dS^T. An attn_mask's tile of each query tile
// comes with Q (as in the forward, one row of it where the mask repeats over
// queries) and is applied to S^T before P^T is made. Its block map lets a
// block skip the query tiles it hides (streaming nothing where it hides them
// all: dK and dV are 0) and run unmasked the tiles it hides none of. With a
// sliding window a block streams the query tiles its keys'
// window reaches only, and the window's edges are masked as the causal
// diagonal is.
// A last kernel scales and rounds dq_accum into dq (convert_dq_accum; its
// layout is DqAccumLayout::kWgmmaTiles); delta = rowsum(dO * O) comes first
// (compute_delta).
#pragma once

#include <cmath>

#include "cuda/dq_accum.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_bwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// kWindow: a sliding window (backward_block). kSoftcap: logit softcapping
// (Softcap), without a mask or dropout; the cap's derivative from P^T in float
// (64-query tiles) or from its rounded fragments (128-query tiles, head dim 64:
// log2 P off by up to 2^-8 moves tanh by that over softcap * log2(e)).
// kAlibi: ALiBi's bias on the recomputed scores (it has no gradient), without a
// mask, dropout or softcap. kVarlen: a packed batch (backward_block), with
// none of these but a window.
template <typename Elem, typename Cfg, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap, bool kAlibi,
          bool kVarlen>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_kernel(const __grid_constant__ BwdKernelParams kp) {
  static_assert(Cfg::Mask::kPresent == (kMask != MaskKind::kNone), "a mask tile exactly where there is a mask");
  static_assert(!kSoftcap || (!kDropout && !Cfg::Mask::kPresent), "softcap without a mask or dropout");
  static_assert(!kAlibi || (!kDropout && !Cfg::Mask::kPresent && !kSoftcap), "ALiBi alone");
  static_assert(!kVarlen || (!kDropout && !Cfg::Mask::kPresent && !kSoftcap && !kAlibi), "a packed batch alone");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = Cfg::kHeadDim, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kScoreRegs = kBlockM / 2;  // a thread's share of its warpgroup's 64 keys x kBlockM queries
  constexpr int kGradRegs = kHeadDim / 2;  // and of its 64 x kHeadDim dK or dV
  constexpr int kDqRegs = kDqAccumSliceCols / 2;  // a thread's share of its 64 x 64 dQ block
  const BwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;

  // (1024-byte aligned, as the swizzled tiles need: BwdTileConfig budgets no slack.)
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* s_k = smem;
  unsigned char* s_v = s_k + Cfg::kKVBytes;
  unsigned char* s_q = s_v + Cfg::kKVBytes;
  unsigned char* s_dout = s_q + kStages * Cfg::kQBytes;
  unsigned char* s_mask = s_dout + kStages * Cfg::kQBytes;
  unsigned char* s_ds = s_mask + kStages * Cfg::Mask::kBytes;
  // Each consumer's dQ block buffers, in dq_accum's layout, for the copy engine to add.
  float* s_dq = reinterpret_cast<float*>(s_ds + Cfg::kDsBuffers * Cfg::kDsBytes);
  auto dq_buffer_of = [&](int consumer, int buffer) {
    return s_dq + (consumer * Cfg::kDqBuffers + buffer) * Cfg::kDqBlockFloats;
  };
  // Per stage: lse (in log2 units) and delta of the tile's queries.
  auto* s_stats = reinterpret_cast<float(*)[2][kBlockM]>(dq_buffer_of(Cfg::kConsumers, 0));
  auto* bars = reinterpret_cast<BwdBarriers<kStages>*>(s_stats + kStages);
  static_assert(sizeof(BwdBarriers<kStages>) <= Cfg::kBarrierBytes, "the barriers' room (BwdTileConfig)");

  const BwdBlock block = backward_block<Cfg, kWindow, kVarlen>(kp);
  const int64_t h_kv = block.h_kv, b = block.b, col0 = block.col0, group = block.group, m_begin = block.m_begin;
  const int tiles = block.tiles;
  // The keys each query sees (the causal diagonal, the window), in the block's sequence.
  const Visibility seen = kVarlen ? Visibility(p, block.len_q, block.len_k) : Visibility(p);

  // Named barriers (0 is __syncthreads). kDsReady: both consumers' dS^T of a
  // tile are in shared memory. Consumer c hands its dQ block buffer i to the dQ
  // writer warp at dq_full(c, i), and gets it back empty at dq_empty(c, i).
  // kDsFree (one dS^T buffer): both consumers are done with the last tile's.
  constexpr int kDsReady = 1;
  auto dq_full = [](int consumer, int buffer) { return 2 + consumer * Cfg::kDqBuffers + buffer; };
  auto dq_empty = [](int consumer, int buffer) {
    return 2 + (Cfg::kConsumers + consumer) * Cfg::kDqBuffers + buffer;
  };
  constexpr int kDsFree = 2 + 2 * Cfg::kConsumers * Cfg::kDqBuffers;
  constexpr int kDqHandoffThreads = kWarpgroupThreads + kWarpSize;
  // Consumer c's dQ block of tile t in dq_accum (query head h_kv * group +
  // t.head, queries from (m_begin + t.m) * kBlockM + 64 * its row block): a
  // whole dq_accum tile's slice, its rows past len_q in the padding; nullptr
  // where all of them are past len_q.
  auto dq_accum_block = [&](const QueryTile& t, int consumer) -> float* {
    const int64_t row0 = (m_begin + t.m) * kBlockM + 64 * (consumer % Cfg::kDqRowBlocks);
    if (row0 >= (kVarlen ? block.len_q : p.len_q)) return nullptr;
    return block.dq_accum + (t.head * block.dq_accum_head_rows + row0) * kHeadDim +
           (consumer / Cfg::kDqRowBlocks) * kDqAccumRowMultiple * kDqAccumSliceCols;
  };

  // Read from lane 0: the compiler then knows it is the same across the warp
  // and keeps what derives from it (the wgmma descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / kWarpgroupThreads, 0);
  if (threadIdx.x == 0) {
    init_backward_barriers<Cfg>(bars);
    if constexpr (kDropout) bars->dropout = dropout_state(params.dropout);
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: two warps. The loader's first lane drives the copy engine, and
    // every lane stages lse and delta of the queries (plain loads: their rows
    // are not 16-byte aligned for the copy engine); the dQ writer adds dQ.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    if (warp > 1 || tiles == 0) return;
    if (warp == 1) {
      // The dQ writer: the copy engine adds each dQ block to dq_accum, so the
      // consumers only store them to shared memory. A tile's buffers go back
      // to the consumers once the copy engine has read them, checked
      // kDqBuffers - 1 tiles later, so that its reads overlap the next tiles.
      constexpr int kLag = Cfg::kDqBuffers - 1;
      for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
        for (int buffer = 0; buffer < Cfg::kDqBuffers && buffer < tiles; ++buffer) {
          ptx::named_barrier_arrive(dq_empty(consumer, buffer), kDqHandoffThreads);
        }
      }
      QueryTile t;
      for (int tile = 0; next_query_tile<Cfg>(params, block, t); ++tile) {
        const int buffer = tile % Cfg::kDqBuffers;
        for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
          ptx::named_barrier_sync(dq_full(consumer, buffer), kDqHandoffThreads);
          float* dst = dq_accum_block(t, consumer);
          if (lane == 0) {
            if (dst != nullptr) {
              ptx::bulk_reduce_add_f32(dst, dq_buffer_of(consumer, buffer), Cfg::kDqBlockFloats * sizeof(float));
            }
            ptx::bulk_commit_group();  // (empty if nothing to add: the group count stays in step)
          }
        }
        const int read = tile - kLag;  // the tile whose buffers are read out now
        if (lane == 0) ptx::bulk_wait_group_read<Cfg::kConsumers * kLag>();
        __syncwarp();
        if (read >= 0 && read + Cfg::kDqBuffers < tiles) {
          for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
            ptx::named_barrier_arrive(dq_empty(consumer, read % Cfg::kDqBuffers), kDqHandoffThreads);
          }
        }
      }
      if (lane == 0) ptx::bulk_wait_group();
      return;
    }
    load_backward_tiles<Cfg, kVarlen>(kp, block, s_k, s_v, s_q, s_dout, s_mask, s_stats, bars, lane);
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % kWarpSize;
  const int key_row = consumer * 64 + (tid / kWarpSize) * 16 + lane / 4;  // and key_row + 8, in the block
  // Whether this thread holds key 0's dS (four lanes of the first key block's
  // CTAs), which is exactly 0 for rows that see key 0 alone (visibility.cuh).
  const bool holds_first_key = col0 + key_row == 0;

  const uint32_t k_addr = ptx::smem_addr(s_k), v_addr = ptx::smem_addr(s_v), q_addr = ptx::smem_addr(s_q),
                 dout_addr = ptx::smem_addr(s_dout), ds_addr = ptx::smem_addr(s_ds);
  // wgmma descriptors at their first k16 step, built once; a stage, a buffer
  // and a step move them by constant offsets. K-major: this consumer's 64 rows
  // of K and V, stage 0's Q and dO. N-major: stage 0's Q and dO as the B of
  // dK += dS^T Q and dV += P^T dO (a step: 16 rows of queries).
  const uint64_t k_desc = k_major_desc(k_addr + consumer * 64 * kSwizzleRowBytes);
  const uint64_t v_desc = k_major_desc(v_addr + consumer * 64 * kSwizzleRowBytes);
  const uint64_t q_desc = k_major_desc(q_addr), dout_desc = k_major_desc(dout_addr);
  const uint64_t q_rows_desc = n_major_desc(q_addr, Cfg::kQColBlockBytes);
  const uint64_t dout_rows_desc = n_major_desc(dout_addr, Cfg::kQColBlockBytes);
  auto kv_step = [](uint64_t desc, int kk) {
    return desc_advance(desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk));
  };
  auto q_step = [](uint64_t desc, int kk) { return desc_advance(desc, k_major_step_bytes(Cfg::kQColBlockBytes, kk)); };

  const float scale = static_cast<float>(p.scale), scale_log2 = static_cast<float>(p.scale * M_LOG2E);
  const Softcap softcap = kSoftcap ? Softcap(p) : Softcap();

  // attn_mask: S^T register 4 j + 2 h + e (key key_row + 8 h, query 8 j + 2
  // (lane % 4) + e of the tile) reads the mask tile's row of that query (row 0
  // of a one-row tile) at that key: 128-byte rows whose 16-byte chunk c lies at
  // chunk c ^ (row % 8). mask_value[h][e] is where register (j = 0, h, e) of
  // stage 0 reads; j steps it by mask_j_bytes (8 rows).
  const unsigned char* mask_value[2][2];
  const int mask_j_bytes = kp.mask.rows_full ? 8 * kSwizzleRowBytes : 0;
  if constexpr (Cfg::Mask::kPresent) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key_byte = (key_row + 8 * h) * Cfg::Mask::kElemBytes;
        const int row = kp.mask.rows_full ? (lane % 4) * 2 + e : 0;  // below 8: its own swizzle row
        const int chunk = key_byte % kSwizzleRowBytes / 16;
        mask_value[h][e] = s_mask + key_byte / kSwizzleRowBytes * kp.mask.block_bytes + row * kSwizzleRowBytes +
                           (chunk ^ row) * 16 + key_byte % 16;
      }
    }
  }
  // Applies the stage's mask tile to s (S^T), in log2 units: a bool mask sets
  // the hidden scores to -inf; an additive one's scaled scores plus its values.
  auto apply_attn_mask = [&](float (&s)[kScoreRegs], int stage) {
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) {
      const int j = i / 4, h = (i / 2) % 2, e = i % 2;
      const unsigned char* value = mask_value[h][e] + stage * Cfg::Mask::kBytes + j * mask_j_bytes;
      if constexpr (kMask == MaskKind::kBool) {
        mask_score(s[i], *value != 0);
      } else {
        mask_score(s[i], ptx::to_float(*reinterpret_cast<const Elem*>(value)), scale);
      }
    }
  };

  float dk[kGradRegs], dv[kGradRegs];
#pragma unroll
  for (int i = 0; i < kGradRegs; ++i) dk[i] = dv[i] = 0.f;

  if (tiles > 0) ptx::mbarrier_wait(&bars->kv_full, 0);
  // This consumer's dQ block: its rows are a 64-column block of dS^T (read
  // transposed), its columns a column block of K (read N-major: the keys are
  // dQ's reduction).
  const uint64_t ds_dq_desc =
      n_major_desc(ds_addr + (consumer % Cfg::kDqRowBlocks) * Cfg::kDsColBlockBytes, Cfg::kDsColBlockBytes);
  const uint64_t k_dq_desc =
      n_major_desc(k_addr + (consumer / Cfg::kDqRowBlocks) * Cfg::kKVColBlockBytes, Cfg::kKVColBlockBytes);
  constexpr int kConsumerThreads = Cfg::kConsumers * kWarpgroupThreads;
  float dq[kDqRegs];

  // The stage's query tile: counted where every tile is streamed (no mask), so
  // that dropout's numbers are drawn before Q arrives; else the loader's record
  // (next_query_tile: registers are short).
  int m_index = 0;
  int64_t head = h_kv * group;
  for (int tile = 0; tile < tiles; ++tile) {
    const int stage = tile % kStages;
    const uint32_t parity = (tile / kStages) & 1;
    int64_t row0;
    bool unmasked = true;
    if constexpr (Cfg::Mask::kPresent) {
      ptx::mbarrier_wait(&bars->q_full[stage], parity);
      const QueryTile t = bars->tile[stage];
      head = h_kv * group + t.head;
      row0 = (m_begin + t.m) * kBlockM;
      unmasked = t.unmasked;
    } else {
      row0 = (m_begin + m_index) * kBlockM;
    }
    const int64_t bh = b * p.heads_q + head;
    const float alibi_log2 = kAlibi ? alibi_slope(p, b, head) * float(M_LOG2E) : 0.f;
    if (!Cfg::Mask::kPresent && ++m_index == block.m_count) {
      m_index = 0;
      ++head;
    }
    // The attn_mask's tile is applied unless it hides none of the tile's pairs
    // (tiles it hides all of are skipped: next_query_tile).
    const bool apply_mask = Cfg::Mask::kPresent && !unmasked;
    const float score_scale = apply_mask ? masked_scores_scale(kMask, scale_log2) : scale_log2;
    // This thread's 16 queries are columns 8j + 2 * (lane % 4) + e of the score tiles.
    const float(&lse_q)[kBlockM] = s_stats[stage][0];
    const float(&delta_q)[kBlockM] = s_stats[stage][1];
    auto query_of = [&](int i) { return accumulator_column(i, lane); };

    // Dropout's decisions for the tile.
    TileDropout<kBlockM> dropout;
    if constexpr (kDropout) dropout.draw(bars->dropout, p, bh, row0, col0 + key_row, lane);

    // S^T = K Q^T and dP^T = V dO^T, 64 keys x kBlockM queries.
    float st[kScoreRegs], dpt[kScoreRegs];
    ptx::mbarrier_wait(&bars->q_full[stage], parity);
    ptx::mbarrier_wait(&bars->dout_full[stage], parity);
    fence_registers(st);
    fence_registers(dpt);
    const uint32_t stage_offset = stage * Cfg::kQBytes;
    const uint64_t q_stage_desc = desc_advance(q_desc, stage_offset);
    const uint64_t dout_stage_desc = desc_advance(dout_desc, stage_offset);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      ptx::wgmma_ss<Elem, kBlockM>(st, kv_step(k_desc, kk), q_step(q_stage_desc, kk), kk > 0);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      ptx::wgmma_ss<Elem, kBlockM>(dpt, kv_step(v_desc, kk), q_step(dout_stage_desc, kk), kk > 0);
    }
    ptx::wgmma_commit();

    // P^T = exp2(S^T * scale * log2(e) - lse * log2(e)), after the attn_mask.
    ptx::wgmma_wait<1>();
    fence_registers(st);
    if constexpr (Cfg::Mask::kPresent) {
      if (apply_mask) apply_attn_mask(st, stage);
    }
    transposed_probabilities<kBlockN, kWindow, kSoftcap, kAlibi>(st, p, col0, row0, seen, key_row, lane, lse_q,
                                                                 score_scale, softcap, alibi_log2);
    // With dropout (Z: 0 where dropped, 1 / (1 - p) where kept), dS^T = P^T *
    // (Z dP^T - delta) needs every probability and dV += (Z P)^T dO the kept
    // ones: both are made once dP^T is in. dV takes P^T where kept, and is
    // scaled by 1 / (1 - p) at the end.
    if constexpr (kDropout) {
      ptx::wgmma_wait<0>();
      fence_registers(dpt);
      const float keep_scale = bars->dropout.keep_scale;
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) {
        dpt[i] = st[i] * ((dropout.keeps(i) ? dpt[i] * keep_scale : 0.f) - delta_q[query_of(i)]);
      }
    }
    // P^T and dS^T as the A fragments of dV and dK (P^T where dropout keeps it).
    uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
    to_fragments<Elem>(st, p_frag);
    if constexpr (kDropout) dropout.drop(p_frag);

    // dV += P^T dO.
    if constexpr (!kDropout) {
      ptx::wgmma_wait<0>();
      fence_registers(dpt);
    }
    accumulate_key_gradient<Elem>(dv, p_frag, dout_rows_desc, stage_offset);

    // dS^T = P^T * (dP^T - delta), to registers and to the tile's dS^T buffer
    // (rows of kBlockM queries in blocks of 64 columns, 128-byte swizzled like
    // the tiles the copy engine writes). The buffer's last readers, both
    // consumers' dQ of tile t - kDsBuffers, finished before the other consumer
    // reached kDsReady of tile t - 1, or, with one buffer, before both reached
    // kDsFree (each waited for its dQ of t - 1). (With 128-query tiles
    // registers are short: P^T is read back from its rounded fragments there,
    // so that st dies with its conversion.)
    if constexpr (!kDropout) {
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) {
        const float pt = kBlockM > 64 ? from_fragments<Elem>(p_frag, i) : st[i];
        dpt[i] = pt * (dpt[i] - delta_q[query_of(i)]);
        if constexpr (kSoftcap) dpt[i] *= softcap.derivative(pt, lse_q[query_of(i)]);
      }
    }
    zero_lone_key_rows<kBlockM, kWindow>(dpt, params, seen, col0, row0, holds_first_key, lane);
    if constexpr (Cfg::Mask::kPresent) zero_rows_seeing_one_key<kBlockM>(dpt, delta_q, lane);
    to_fragments<Elem>(dpt, ds_frag);
    const int ds_buffer = tile % Cfg::kDsBuffers;
    if (Cfg::kDsBuffers == 1 && tile > 0) ptx::named_barrier_sync(kDsFree, kConsumerThreads);
    store_transposed_tile<Cfg::kDsColBlockBytes>(s_ds + ds_buffer * Cfg::kDsBytes, ds_frag, key_row, lane);
    ptx::fence_proxy_async();
    ptx::named_barrier_sync(kDsReady, kConsumerThreads);

    // This consumer's dQ block = dS K over all kBlockN keys (both operands from
    // shared memory). Issued before dK, so that its shared-memory stores below
    // run under dK's wgmma.
    const uint64_t ds_tile_desc = desc_advance(ds_dq_desc, ds_buffer * Cfg::kDsBytes);
    fence_registers(dq);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      ptx::wgmma_ss<Elem, kDqAccumSliceCols, 1, 1>(dq, desc_advance(ds_tile_desc, n_major_step_bytes(kk)),
                                                   desc_advance(k_dq_desc, n_major_step_bytes(kk)), kk > 0);
    }
    ptx::wgmma_commit();

    // dK += dS^T Q.
    accumulate_key_gradient<Elem>(dk, ds_frag, q_rows_desc, stage_offset);

    // dV and dQ are done: dO's stage is free, and the dQ block goes to a
    // buffer (in dq_accum's layout: one float4 a thread and register quad,
    // conflict-free) once the writer has emptied it, then to the writer.
    ptx::wgmma_wait<1>();
    fence_registers(dv);
    fence_registers(p_frag);
    fence_registers(dq);
    ptx::mbarrier_arrive(&bars->dout_empty[stage]);
    const int dq_buffer = tile % Cfg::kDqBuffers;
    float* dq_block = dq_buffer_of(consumer, dq_buffer);
    ptx::named_barrier_sync(dq_empty(consumer, dq_buffer), kDqHandoffThreads);
#pragma unroll
    for (int j = 0; j < kDqRegs / 4; ++j) {
      *reinterpret_cast<float4*>(dq_block + (j * kWarpgroupThreads + tid) * 4) =
          make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
    }
    ptx::fence_proxy_async();
    ptx::named_barrier_arrive(dq_full(consumer, dq_buffer), kDqHandoffThreads);

    // dK is done with Q's stage.
    ptx::wgmma_wait<0>();
    fence_registers(dk);
    fence_registers(ds_frag);
    ptx::mbarrier_arrive(&bars->q_empty[stage]);
  }

  const float dv_scale = kDropout ? static_cast<float>(dropout_keep_scale(params.dropout.p)) : 1.f;
  store_key_gradients<Elem, kVarlen>(params, block, key_row, 0, lane, dk, dv, dv_scale);
#endif
}

template <typename Elem, int kHeadDim, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap = false,
          bool kAlibi = false, bool kVarlen = false>
bool launch_backward(const BwdParams& params, cudaStream_t stream) {
  using Cfg = BwdTileConfig<kHeadDim, mask_elem_bytes(kMask)>;
  return launch_backward_kernel<Elem, Cfg, kVarlen>(
      params, attention_backward_kernel<Elem, Cfg, kDropout, kMask, kWindow, kSoftcap, kAlibi, kVarlen>, stream);
}

// The instantiations with an attn_mask (flash_bwd_sm90_masked.cu): a call of
// head dim up to 128 with a mask that backward_covers.
bool launch_masked_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
