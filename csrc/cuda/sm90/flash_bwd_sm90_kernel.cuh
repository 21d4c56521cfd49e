// The Hopper backward kernel (sm_90a) at head dims up to 128, with dQ
// accumulated in float32 (flash_bwd_sm90.cu instantiates it without an
// attn_mask, flash_bwd_sm90_masked.cu with one): one
// thread block per (block of 128 keys, key/value head, batch), split by role
// into warpgroups as in the forward.
//  - In the producer warpgroup, one warp loads K and V once, then streams the
//    Q and dO tiles (kBlockM queries) of every query head of the group, with their
//    lse and delta, through a ring of stages (full / empty mbarriers); another
//    warp (the dQ writer) has the copy engine add each tile's dQ to dq_accum
//    (a bulk reduce from shared memory: bwd_dq_writer.cuh).
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
#include "cuda/sm90/bwd_dq_writer.cuh"
#include "cuda/sm90/bwd_shared.cuh"
#include "cuda/sm90/flash_bwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Where a consumer thread reads the attn_mask tile of a stage. S^T register
// 4 j + 2 h + e (key key_row + 8 h, query 8 j + 2 (lane % 4) + e of the tile)
// reads the mask tile's row of that query (row 0 of a one-row tile) at that
// key: 128-byte rows whose 16-byte chunk c lies at chunk c ^ (row % 8).
// value[h][e] is where register (j = 0, h, e) of stage 0 reads; j steps it by
// j_bytes (8 rows).
template <typename Elem, typename Cfg, MaskKind kMask>
struct AttnMaskReader {
  const unsigned char* value[2][2];
  const int j_bytes;

  __device__ __forceinline__ AttnMaskReader(const MaskTileShape& shape, const unsigned char* s_mask, int key_row,
                                            int lane)
      : j_bytes(shape.rows_full ? 8 * kSwizzleRowBytes : 0) {
    if constexpr (Cfg::Mask::kPresent) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key_byte = (key_row + 8 * h) * Cfg::Mask::kElemBytes;
          const int row = shape.rows_full ? (lane % 4) * 2 + e : 0;  // below 8: its own swizzle row
          const int chunk = key_byte % kSwizzleRowBytes / 16;
          value[h][e] = s_mask + key_byte / kSwizzleRowBytes * shape.block_bytes + row * kSwizzleRowBytes +
                        (chunk ^ row) * 16 + key_byte % 16;
        }
      }
    }
  }

  // Applies the stage's mask tile to s (S^T), in log2 units: a bool mask sets
  // the hidden scores to -inf; an additive one's scaled scores plus its values.
  template <int kScoreRegs>
  __device__ __forceinline__ void apply(float (&s)[kScoreRegs], int stage, float scale) const {
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) {
      const int j = i / 4, h = (i / 2) % 2, e = i % 2;
      const unsigned char* v = value[h][e] + stage * Cfg::Mask::kBytes + j * j_bytes;
      if constexpr (kMask == MaskKind::kBool) {
        mask_score(s[i], *v != 0);
      } else {
        mask_score(s[i], ptx::to_float(*reinterpret_cast<const Elem*>(v)), scale);
      }
    }
  }
};

// A consumer warpgroup: 64 keys of the block (consumer * 64 on), their dK and
// dV in registers. What it keeps across the query tiles (its threads' keys,
// the wgmma descriptors, the scales), the mainloop over the tiles (run) and
// the steps of a tile. (run's loop holds the tile's steps, and run the
// registers they work on and the attn_mask reader: a step function of its
// own, or the reader's pointers as members, compiled to other PTX.)
template <typename Elem, typename Cfg, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap, bool kAlibi,
          bool kVarlen, bool kOrdered>
struct BwdConsumer {
  static constexpr int kHeadDim = Cfg::kHeadDim, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kScoreRegs = kBlockM / 2;  // a thread's share of its warpgroup's 64 keys x kBlockM queries
  static constexpr int kGradRegs = kHeadDim / 2;  // and of its 64 x kHeadDim dK or dV
  static constexpr int kDqRegs = kDqAccumSliceCols / 2;  // a thread's share of its 64 x 64 dQ block
  using Barriers = BwdNamedBarriers<Cfg>;
  using Frags = uint32_t[kBlockM / 16][4];  // P^T or dS^T as wgmma A fragments
  // With 128-query tiles (head dim 64) in bfloat16, and neither dropout nor
  // softcap, dS^T = P^T (dP^T - delta) is made from the rounded fragments of
  // P^T and of dP^T - delta, two products an instruction
  // (times_probabilities): float P^T is not kept (registers are short), and
  // reading it back from its fragments took more instructions than the
  // products. (Not in float16: dP^T - delta may pass its range where dS^T
  // does not.)
  static constexpr bool kPairedDs =
      kBlockM > 64 && !kDropout && !kSoftcap && std::is_same_v<Elem, __nv_bfloat16>;

  const BwdKernelParams& kp;
  const BwdParams& params;
  const AttentionProblem& p;
  const BwdBlock& block;
  const BwdSharedMemory<Cfg>& shared;
  const Visibility& seen;
  const int consumer, tid, lane;
  const int key_row;  // and key_row + 8, in the block
  // Whether this thread holds key 0's dS (four lanes of the first key block's
  // CTAs), which is exactly 0 for rows that see key 0 alone (visibility.cuh).
  const bool holds_first_key;
  // wgmma descriptors at their first k16 step, built once; a stage, a buffer
  // and a step move them by constant offsets. K-major: this consumer's 64 rows
  // of K and V, stage 0's Q and dO. N-major: stage 0's Q and dO as the B of
  // dK += dS^T Q and dV += P^T dO (a step: 16 rows of queries).
  const uint64_t k_desc, v_desc, q_desc, dout_desc, q_rows_desc, dout_rows_desc;
  const float scale, scale_log2;
  const BackwardSoftcap softcap;

  __device__ __forceinline__ BwdConsumer(const BwdKernelParams& kp_, const BwdBlock& block_,
                                         const BwdSharedMemory<Cfg>& shared_, const Visibility& seen_, int consumer_)
      : kp(kp_),
        params(kp_.call),
        p(kp_.call.problem),
        block(block_),
        shared(shared_),
        seen(seen_),
        consumer(consumer_),
        tid(threadIdx.x % kWarpgroupThreads),
        lane(tid % kWarpSize),
        key_row(consumer * 64 + (tid / kWarpSize) * 16 + lane / 4),
        holds_first_key(block.col0 + key_row == 0),
        k_desc(k_major_desc(ptx::smem_addr(shared.k) + consumer * 64 * kSwizzleRowBytes)),
        v_desc(k_major_desc(ptx::smem_addr(shared.v) + consumer * 64 * kSwizzleRowBytes)),
        q_desc(k_major_desc(ptx::smem_addr(shared.q))),
        dout_desc(k_major_desc(ptx::smem_addr(shared.dout))),
        q_rows_desc(n_major_desc(ptx::smem_addr(shared.q), Cfg::kQColBlockBytes)),
        dout_rows_desc(n_major_desc(ptx::smem_addr(shared.dout), Cfg::kQColBlockBytes)),
        scale(static_cast<float>(p.scale)),
        scale_log2(score_scale_log2(p)),
        softcap(kSoftcap ? BackwardSoftcap(p) : BackwardSoftcap()) {}

  // The next tile's query block (m_begin + m_index) and query head, where the
  // consumers count them (locate_tile; next_query_tile's walk).
  struct TileCount {
    int m_index;
    int64_t head;
  };

  // A streamed query tile as the consumers see it: its stage of the ring (and
  // the phase to wait for), its first query, its query head's (batch, head)
  // row, ALiBi's slope, the scale of its scores, whether its attn_mask tile
  // is applied.
  struct StreamedTile {
    int stage;
    uint32_t parity;
    int64_t row0, bh;
    float alibi_log2, score_scale;
    bool apply_mask;
  };

  // This consumer's dQ block's operands: its rows are a 64-column block of
  // dS^T (read transposed), its columns a column block of K (read N-major:
  // the keys are dQ's reduction).
  struct DqOperands {
    uint64_t ds_desc, k_desc;
    __device__ __forceinline__ DqOperands(const BwdSharedMemory<Cfg>& shared, int consumer)
        : ds_desc(n_major_desc(ptx::smem_addr(shared.ds) + (consumer % Cfg::kDqRowBlocks) * Cfg::kDsColBlockBytes,
                               Cfg::kDsColBlockBytes)),
          k_desc(n_major_desc(ptx::smem_addr(shared.k) + (consumer / Cfg::kDqRowBlocks) * Cfg::kKVColBlockBytes,
                              Cfg::kKVColBlockBytes)) {}
  };

  // The descriptors at k16 step kk: of K or V (kv_step), of Q or dO (q_step).
  __device__ __forceinline__ static uint64_t kv_step(uint64_t desc, int kk) {
    return desc_advance(desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk));
  }
  __device__ __forceinline__ static uint64_t q_step(uint64_t desc, int kk) {
    return desc_advance(desc, k_major_step_bytes(Cfg::kQColBlockBytes, kk));
  }
  // This thread's 16 queries are columns 8j + 2 * (lane % 4) + e of the score tiles.
  __device__ __forceinline__ int query_of(int i) const { return accumulator_column(i, lane); }

  // The mainloop: dK and dV over the block's query tiles, then stored.
  __device__ __forceinline__ void run() const {
    const AttnMaskReader<Elem, Cfg, kMask> attn_mask(kp.mask, shared.mask, key_row, lane);
    float dk[kGradRegs], dv[kGradRegs];
#pragma unroll
    for (int i = 0; i < kGradRegs; ++i) dk[i] = dv[i] = 0.f;

    if (block.tiles > 0) ptx::mbarrier_wait(&shared.bars->kv_full, 0);
    const DqOperands dq_operands(shared, consumer);
    float dq[kDqRegs];
    TileCount count{kOrdered ? block.m_rotation : 0, block.head0};
    for (int tile = 0; tile < block.tiles; ++tile) {
      // The tile: its stage's Q, dO, lse and delta; dropout's decisions for it.
      const StreamedTile t = locate_tile(tile, count);
      const float(&lse_q)[kBlockM] = shared.stats[t.stage][0];
      const float(&delta_q)[kBlockM] = shared.stats[t.stage][1];
      TileDropout<kBlockM> dropout;
      if constexpr (kDropout) dropout.draw(shared.bars->dropout, p, t.bh, t.row0, block.col0 + key_row, lane);

      // S^T = K Q^T and dP^T = V dO^T, 64 keys x kBlockM queries.
      float st[kScoreRegs], dpt[kScoreRegs];
      ptx::mbarrier_wait(&shared.bars->q_full[t.stage], t.parity);
      ptx::mbarrier_wait(&shared.bars->dout_full[t.stage], t.parity);
      issue_score_gemms(st, dpt, t.stage);
      const uint32_t stage_offset = t.stage * Cfg::kQBytes;

      // P^T = exp2(S^T * scale * log2(e) - lse * log2(e)), after the attn_mask.
      wgmma_wait_fenced<1>(st);
      if constexpr (Cfg::Mask::kPresent) {
        if (t.apply_mask) attn_mask.apply(st, t.stage, scale);
      }
      transposed_probabilities<kBlockN, kWindow, kSoftcap, kAlibi>(st, p, block.col0, t.row0, seen, key_row, lane,
                                                                   lse_q, t.score_scale, softcap, t.alibi_log2);
      // With dropout, dS^T needs every probability: it is made before P^T is dropped.
      if constexpr (kDropout) dropped_ds(dpt, st, dropout, delta_q);
      // P^T and dS^T as the A fragments of dV and dK (P^T where dropout keeps it).
      Frags p_frag, ds_frag;
      to_fragments<Elem>(st, p_frag);
      if constexpr (kDropout) dropout.drop(p_frag);

      // dV += P^T dO.
      if constexpr (!kDropout) wgmma_wait_fenced<0>(dpt);
      accumulate_key_gradient<Elem>(dv, p_frag, dout_rows_desc, stage_offset);

      // dS^T = P^T * (dP^T - delta), to registers and to the tile's dS^T buffer.
      if constexpr (kPairedDs) {  // (dpt: dP^T - delta until the product)
        dp_less_delta(dpt, delta_q);
      } else if constexpr (!kDropout) {
        ds_from_probabilities(dpt, st, p_frag, lse_q, delta_q);
      }
      zero_lone_key_rows<kBlockM, kWindow>(dpt, params, seen, block.col0, t.row0, holds_first_key, lane);
      if constexpr (Cfg::Mask::kPresent) zero_rows_seeing_one_key<kBlockM>(dpt, delta_q, lane);
      to_fragments<Elem>(dpt, ds_frag);
      if constexpr (kPairedDs) times_probabilities(ds_frag, p_frag);
      const int ds_buffer = tile % Cfg::kDsBuffers;
      store_ds(ds_frag, tile, ds_buffer);

      // This consumer's dQ block = dS K; then dK += dS^T Q.
      issue_dq_gemm(dq, dq_operands, ds_buffer);
      accumulate_key_gradient<Elem>(dk, ds_frag, q_rows_desc, stage_offset);

      // dV and dQ are done: dO's stage is free, and the dQ block goes to the writer.
      wgmma_wait_fenced<1>(dv, p_frag, dq);
      ptx::mbarrier_arrive(&shared.bars->dout_empty[t.stage]);
      hand_off_dq(dq, tile);

      // dK is done with Q's stage.
      wgmma_wait_fenced<0>(dk, ds_frag);
      ptx::mbarrier_arrive(&shared.bars->q_empty[t.stage]);
    }

    const float dv_scale = kDropout ? static_cast<float>(dropout_keep_scale(params.dropout.p)) : 1.f;
    if (kOrdered && params.head_splits > 1) {  // (deterministic_head_splits)
      store_key_grad_partials(params, block, key_row, lane, dk, dv, dv_scale);
    } else {
      // Staged in this consumer's rows of V: only its own dP^T GEMMs read them, all done.
      store_key_gradients<Elem, kVarlen, Cfg::kKVColBlockBytes>(params, block, consumer, key_row, lane, dk, dv,
                                                                dv_scale, shared.v, Barriers::key_grad_staging(consumer));
    }
  }

  // Where the consumers find tile `tile`: its stage, and its query tile,
  // counted where every tile is streamed (no mask), so that dropout's numbers
  // are drawn before Q arrives (count moves on to the next tile's); else the
  // loader's record (next_query_tile: registers are short).
  __device__ __forceinline__ StreamedTile locate_tile(int tile, TileCount& count) const {
    const int stage = tile % kStages;
    const uint32_t parity = (tile / kStages) & 1;
    int64_t row0;
    bool unmasked = true;
    if constexpr (Cfg::Mask::kPresent) {
      ptx::mbarrier_wait(&shared.bars->q_full[stage], parity);
      const QueryTile t = shared.bars->tile[stage];
      count.head = block.head0 + t.head;
      row0 = (block.m_begin + t.m) * kBlockM;
      unmasked = t.unmasked;
    } else {
      row0 = (block.m_begin + count.m_index) * kBlockM;
    }
    const int64_t bh = block.b * p.heads_q + count.head;
    const float alibi_log2 = kAlibi ? alibi_slope_log2(p, block.b, count.head) : 0.f;
    if constexpr (kOrdered) {  // (next_query_tile's walk)
      if (++count.m_index == block.m_count) count.m_index = 0;
      if (count.m_index == block.m_rotation) ++count.head;
    } else if (!Cfg::Mask::kPresent && ++count.m_index == block.m_count) {
      count.m_index = 0;
      ++count.head;
    }
    // The attn_mask's tile is applied unless it hides none of the tile's pairs
    // (tiles it hides all of are skipped: next_query_tile).
    const bool apply_mask = Cfg::Mask::kPresent && !unmasked;
    const float score_scale = apply_mask ? masked_scores_scale(kMask, scale_log2) : scale_log2;
    return {stage, parity, row0, bh, alibi_log2, score_scale, apply_mask};
  }

  // Issues S^T = K Q^T and dP^T = V dO^T over the stage's Q and dO, 64 keys x
  // kBlockM queries: two wgmma groups.
  __device__ __forceinline__ void issue_score_gemms(float (&st)[kScoreRegs], float (&dpt)[kScoreRegs],
                                                    int stage) const {
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
  }

  // With dropout (Z: 0 where dropped, 1 / (1 - p) where kept), dS^T = P^T *
  // (Z dP^T - delta) needs every probability and dV += (Z P)^T dO the kept
  // ones: both are made once dP^T is in. dV takes P^T where kept, and is
  // scaled by 1 / (1 - p) at the end. dpt becomes dS^T.
  __device__ __forceinline__ void dropped_ds(float (&dpt)[kScoreRegs], const float (&st)[kScoreRegs],
                                             const TileDropout<kBlockM>& dropout,
                                             const float (&delta_q)[kBlockM]) const {
    wgmma_wait_fenced<0>(dpt);
    const float keep_scale = shared.bars->dropout.keep_scale;
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) {
      dpt[i] = st[i] * ((dropout.keeps(i) ? dpt[i] * keep_scale : 0.f) - delta_q[query_of(i)]);
    }
  }

  // Without dropout, dS^T = P^T * (dP^T - delta) (times the cap's derivative
  // with softcap); dpt becomes dS^T. (With 128-query tiles registers are short:
  // P^T is read back from its rounded fragments there, so that st dies with
  // its conversion; in bfloat16 without softcap kPairedDs takes its place.)
  __device__ __forceinline__ void ds_from_probabilities(float (&dpt)[kScoreRegs], const float (&st)[kScoreRegs],
                                                        const Frags& p_frag, const float (&lse_q)[kBlockM],
                                                        const float (&delta_q)[kBlockM]) const {
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) {
      const float pt = kBlockM > 64 ? from_fragments<Elem>(p_frag, i) : st[i];
      dpt[i] = pt * (dpt[i] - delta_q[query_of(i)]);
      if constexpr (kSoftcap) dpt[i] *= softcap.cap_derivative(pt, lse_q[query_of(i)]);
    }
  }

  // dpt = dP^T - delta (kPairedDs: the second factor of dS^T, zeroed where
  // dS^T must be exactly 0 before its product).
  __device__ __forceinline__ void dp_less_delta(float (&dpt)[kScoreRegs], const float (&delta_q)[kBlockM]) const {
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) dpt[i] -= delta_q[query_of(i)];
  }

  // ds_frag (dP^T - delta, rounded) times P^T as rounded for dV, a pair of
  // products an instruction: dS^T's fragments (kPairedDs).
  __device__ __forceinline__ static void times_probabilities(Frags& ds_frag, const Frags& p_frag) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) ds_frag[kk][r] = ptx::mul_bf16x2(ds_frag[kk][r], p_frag[kk][r]);
    }
  }

  // dS^T to the tile's buffer (rows of kBlockM queries in blocks of 64
  // columns, 128-byte swizzled like the tiles the copy engine writes), for
  // both consumers' dQ. The buffer's last readers, both consumers' dQ of tile
  // t - kDsBuffers, finished before the other consumer reached kDsReady of
  // tile t - 1, or, with one buffer, before both reached kDsFree (each waited
  // for its dQ of t - 1). Returns once both consumers' halves are in.
  __device__ __forceinline__ void store_ds(const Frags& ds_frag, int tile, int ds_buffer) const {
    if (Cfg::kDsBuffers == 1 && tile > 0) ptx::named_barrier_sync(Barriers::kDsFree, Barriers::kConsumerThreads);
    store_transposed_tile<Cfg::kDsColBlockBytes>(shared.ds + ds_buffer * Cfg::kDsBytes, ds_frag, key_row, lane);
    ptx::fence_proxy_async();
    ptx::named_barrier_sync(Barriers::kDsReady, Barriers::kConsumerThreads);
  }

  // Issues this consumer's dQ block = dS K over all kBlockN keys (both
  // operands from shared memory): one wgmma group. Issued before dK, so that
  // its shared-memory stores (hand_off_dq) run under dK's wgmma.
  __device__ __forceinline__ void issue_dq_gemm(float (&dq)[kDqRegs], const DqOperands& operands, int ds_buffer) const {
    const uint64_t ds_tile_desc = desc_advance(operands.ds_desc, ds_buffer * Cfg::kDsBytes);
    fence_registers(dq);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      ptx::wgmma_ss<Elem, kDqAccumSliceCols, 1, 1>(dq, desc_advance(ds_tile_desc, n_major_step_bytes(kk)),
                                                   desc_advance(operands.k_desc, n_major_step_bytes(kk)), kk > 0);
    }
    ptx::wgmma_commit();
  }

  // The tile's dQ block to a buffer (in dq_accum's layout: one float4 a
  // thread and register quad, conflict-free) once the writer has emptied it,
  // then to the writer.
  __device__ __forceinline__ void hand_off_dq(const float (&dq)[kDqRegs], int tile) const {
    const int dq_buffer = tile % Cfg::kDqBuffers;
    float* dq_block = shared.dq_buffer(consumer, dq_buffer);
    ptx::named_barrier_sync(Barriers::dq_empty(consumer, dq_buffer), Barriers::kDqHandoffThreads);
#pragma unroll
    for (int j = 0; j < kDqRegs / 4; ++j) {
      *reinterpret_cast<float4*>(dq_block + (j * kWarpgroupThreads + tid) * 4) =
          make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
    }
    ptx::fence_proxy_async();
    ptx::named_barrier_arrive(Barriers::dq_full(consumer, dq_buffer), Barriers::kDqHandoffThreads);
  }
};

// kWindow: a sliding window (backward_block). kSoftcap: logit softcapping
// (BackwardSoftcap), without a mask or dropout; the cap's derivative from P^T
// in float (64-query tiles) or from its rounded fragments (128-query tiles, head dim 64:
// log2 P off by up to 2^-8 moves tanh by that over softcap * log2(e)).
// kAlibi: ALiBi's bias on the recomputed scores (it has no gradient), without a
// mask, dropout or softcap. kVarlen: a packed batch (backward_block), with
// none of these but a window. kOrdered: deterministic mode (backward_block),
// without a mask, window or packed batch.
template <typename Elem, typename Cfg, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap, bool kAlibi,
          bool kVarlen, bool kOrdered>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_backward_kernel(const __grid_constant__ BwdKernelParams kp) {
  static_assert(Cfg::Mask::kPresent == (kMask != MaskKind::kNone), "a mask tile exactly where there is a mask");
  static_assert(!kSoftcap || (!kDropout && !Cfg::Mask::kPresent), "softcap without a mask or dropout");
  static_assert(!kAlibi || (!kDropout && !Cfg::Mask::kPresent && !kSoftcap), "ALiBi alone");
  static_assert(!kVarlen || (!kDropout && !Cfg::Mask::kPresent && !kSoftcap && !kAlibi), "a packed batch alone");
  static_assert(!kOrdered || (!Cfg::Mask::kPresent && !kWindow && !kVarlen), "deterministic mode: none of these");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const BwdSharedMemory<Cfg> shared(smem);
  const BwdBlock block = backward_block<Cfg, kWindow, kVarlen, kOrdered>(kp);
  // The keys each query sees (the causal diagonal, the window), in the block's sequence.
  const Visibility seen = kVarlen ? Visibility(kp.call.problem, block.len_q, block.len_k) : Visibility(kp.call.problem);

  // Read from lane 0: the compiler then knows it is the same across the warp
  // and keeps what derives from it (the wgmma descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / kWarpgroupThreads, 0);
  if (threadIdx.x == 0) {
    init_backward_barriers<Cfg>(shared.bars);
    if constexpr (kDropout) shared.bars->dropout = dropout_state(kp.call.dropout);
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: two warps. The loader's first lane drives the copy engine, and
    // every lane stages lse and delta of the queries (load_backward_tiles); the
    // dQ writer adds dQ (BwdDqWriter).
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    if (warp > 1 || block.tiles == 0) return;
    if (warp == 1) {
      BwdDqWriter<Cfg, kVarlen, kOrdered>{kp.call, block, shared, lane}.run();
      return;
    }
    load_backward_tiles<Cfg, kVarlen, kOrdered>(kp, block, shared.k, shared.v, shared.q, shared.dout, shared.mask,
                                                shared.stats, shared.bars, lane);
    return;
  }

  // Consumers (BwdConsumer): the mainloop over the query tiles, then dK and dV.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const BwdConsumer<Elem, Cfg, kDropout, kMask, kWindow, kSoftcap, kAlibi, kVarlen, kOrdered> consumer(
      kp, block, shared, seen, warpgroup - 1);
  consumer.run();
#endif
}

template <typename Elem, int kHeadDim, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap = false,
          bool kAlibi = false, bool kVarlen = false, bool kOrdered = false>
bool launch_backward(const BwdParams& params, cudaStream_t stream) {
  using Cfg = BwdTileConfig<kHeadDim, mask_elem_bytes(kMask)>;
  return launch_backward_kernel<Elem, Cfg, kVarlen>(
      params, attention_backward_kernel<Elem, Cfg, kDropout, kMask, kWindow, kSoftcap, kAlibi, kVarlen, kOrdered>,
      stream);
}

// The instantiations with an attn_mask (flash_bwd_sm90_masked.cu): a call of
// head dim up to 128 with a mask that backward_covers.
bool launch_masked_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
