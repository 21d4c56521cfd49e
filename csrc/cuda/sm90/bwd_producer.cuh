// The Hopper backward's producer (both kernels, flash_bwd_sm90.cuh): the
// barriers of the ring of stages between the loader warp and the consumers,
// and the loader's loop: K and V once, then each query tile's Q, dO, lse,
// delta (and attn_mask tile) into the next free stage.
#pragma once

#include "cuda/dropout_flags.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/bwd_scheduler.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// The block's mbarriers: kv_full (K and V are in), and per stage of the ring
// full (loaded) and empty (released by both consumers) for Q and dO.
template <int kStages>
struct BwdBarriers {
  uint64_t kv_full;
  uint64_t q_full[kStages], dout_full[kStages];  // q_full also covers the stage's lse, delta and tile
  uint64_t q_empty[kStages], dout_empty[kStages];
  QueryTile tile[kStages];  // the stage's query tile, from the loader (next_query_tile): the consumers read it
  // With dropout, beside them: its seed, offset and threshold, read from
  // rng_state once (device memory: a load in each tile would hold up the
  // tile's Philox calls, and registers are short).
  DropoutState dropout;
};

// By thread 0, before the block's first __syncthreads.
template <typename Cfg>
__device__ __forceinline__ void init_backward_barriers(BwdBarriers<Cfg::kStages>* bars) {
  ptx::mbarrier_init(&bars->kv_full, 1);
  for (int s = 0; s < Cfg::kStages; ++s) {
    ptx::mbarrier_init(&bars->q_full[s], 1 + kWarpSize);
    ptx::mbarrier_init(&bars->dout_full[s], 1);
    ptx::mbarrier_init(&bars->q_empty[s], Cfg::kConsumers * kWarpgroupThreads);
    ptx::mbarrier_init(&bars->dout_empty[s], Cfg::kConsumers * kWarpgroupThreads);
  }
  ptx::fence_barrier_init();
}

// The producer's loader warp: its first lane drives the copy engine, loading
// K and V once, then each query tile's Q (with its attn_mask tile, unless the
// mask hides none of the tile's pairs) and dO into the ring of stages; every
// lane stages lse and delta of the tile's queries (plain loads: their rows are
// not 16-byte aligned for the copy engine). V and dO have Cfg::kColBlocksV
// column blocks (fewer than Q's and K's at MLA's head dims). kOrdered:
// deterministic mode's walk (next_query_tile).
template <typename Cfg, bool kVarlen = false, bool kOrdered = false>
__device__ __forceinline__ void load_backward_tiles(const BwdKernelParams& kp, const BwdBlock& block,
                                                    unsigned char* s_k, unsigned char* s_v, unsigned char* s_q,
                                                    unsigned char* s_dout, unsigned char* s_mask,
                                                    float (*s_stats)[2][Cfg::kBlockM],
                                                    BwdBarriers<Cfg::kStages>* bars, int lane) {
  constexpr int kBlockM = Cfg::kBlockM, kStages = Cfg::kStages;
  const BwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  // (A packed batch is batch 0 of its tensors, the sequence at rows q_start and k_start.)
  const int batch = kVarlen ? 0 : static_cast<int>(block.b), kv_head = static_cast<int>(block.h_kv);
  const int key_row = static_cast<int>(block.k_start + block.col0);
  if (lane == 0) {
    ptx::mbarrier_arrive_expect_tx(&bars->kv_full, Cfg::kKBytes + Cfg::kVBytes);
    for (int c = 0; c < Cfg::kColBlocks; ++c) {
      ptx::tma_load_4d(s_k + c * Cfg::kKVColBlockBytes, &kp.k_map, &bars->kv_full, c * kSwizzleCols, key_row,
                       kv_head, batch);
      if (c < Cfg::kColBlocksV) {
        ptx::tma_load_4d(s_v + c * Cfg::kKVColBlockBytes, &kp.v_map, &bars->kv_full, c * kSwizzleCols, key_row,
                         kv_head, batch);
      }
    }
  }
  if (Cfg::Mask::kPresent && lane == 0) ptx::prefetch_tensor_map(&kp.mask_map);
  QueryTile t;
  for (int tile = 0; next_query_tile<Cfg, kOrdered>(params, block, t); ++tile) {
    const int head = static_cast<int>(block.head0) + t.head;
    // ((batch, heads_q, len_q); a packed batch's (heads_q, total_q).)
    const int64_t stats_row0 =
        kVarlen ? head * params.packed.total_q + block.q_start : (block.b * p.heads_q + head) * p.len_q;
    const float* lse = static_cast<const float*>(params.lse) + stats_row0;
    const float* delta = static_cast<const float*>(params.delta) + stats_row0;
    const int64_t len_q = kVarlen ? block.len_q : p.len_q;
    const int q_row = static_cast<int>((block.m_begin + t.m) * kBlockM);
    const int q_coord = static_cast<int>(block.q_start) + q_row;
    const int stage = tile % kStages;
    const uint32_t parity = (tile / kStages) & 1;
    const bool load_mask = Cfg::Mask::kPresent && !t.unmasked;
    ptx::mbarrier_wait(&bars->q_empty[stage], parity ^ 1);
    if (lane == 0) {
      bars->tile[stage] = t;
      const int mask_tile_bytes = load_mask ? kp.mask.tile_bytes(Cfg::Mask::kColBlocks) : 0;
      ptx::mbarrier_arrive_expect_tx(&bars->q_full[stage], Cfg::kQBytes + mask_tile_bytes);
      for (int c = 0; c < Cfg::kColBlocks; ++c) {
        ptx::tma_load_4d(s_q + stage * Cfg::kQBytes + c * Cfg::kQColBlockBytes, &kp.q_map, &bars->q_full[stage],
                         c * kSwizzleCols, q_coord, head, batch);
      }
      if (load_mask) {
        for (int c = 0; c < Cfg::Mask::kColBlocks; ++c) {
          ptx::tma_load_4d(s_mask + stage * Cfg::Mask::kBytes + c * kp.mask.block_bytes, &kp.mask_map,
                           &bars->q_full[stage], key_row + c * Cfg::Mask::kColBlockCols, kp.mask.rows_full ? q_row : 0,
                           head * kp.mask.head_step, batch * kp.mask.batch_step);
        }
      }
    }
    // dO's stage is released before Q's: no wait here. Both copies are
    // under way before the stats' plain loads.
    if (lane == 0) {
      ptx::mbarrier_wait(&bars->dout_empty[stage], parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(&bars->dout_full[stage], Cfg::kDoBytes);
      for (int c = 0; c < Cfg::kColBlocksV; ++c) {
        ptx::tma_load_4d(s_dout + stage * Cfg::kDoBytes + c * Cfg::kQColBlockBytes, &kp.dout_map,
                         &bars->dout_full[stage], c * kSwizzleCols, q_coord, head, batch);
      }
    }
    for (int i = lane; i < kBlockM; i += kWarpSize) {
      s_stats[stage][0][i] = lse_log2(lse, q_row + i, len_q);
      s_stats[stage][1][i] = q_row + i < len_q ? delta[q_row + i] : 0.f;
    }
    ptx::mbarrier_arrive(&bars->q_full[stage]);
  }
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
