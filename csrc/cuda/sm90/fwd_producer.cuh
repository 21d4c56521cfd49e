// The Hopper forward's producer: one thread of the producer warpgroup (the
// others give their registers to the consumers and leave) walks the block's
// tiles (FwdTileScheduler), hands each to the consumers through shared memory
// (two slots: it runs at most one tile ahead), and drives the copy engine: a
// tile's Q once, then the K and V tiles of the key blocks its rows see (and
// the attn_mask's tile of each, less the blocks its block map hides) into the
// ring of stages, each completed on an mbarrier ("full") and handed back by
// the consumers on another ("empty"). The ring runs on across tiles; the next
// tile's Q loads as soon as the consumers' last Q K^T of the current one is
// done (q_empty), and a stage whose K buffer holds a consumer's output (head
// dim 128: fwd_epilogue.cuh) is refilled only once the copy engine has read it
// (out_free). FP8's values come transposed (FwdFp8TileConfig): a tile of
// them is every head-dim row's kBlockN keys.
#pragma once

#include "cuda/attn_mask.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/sm90/fwd_tile_scheduler.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// Producer and consumers step through the same sequence of tiles (round r's
// in slot r % 2) and the same ring of K/V stages (the kv-th tile loaded or
// read overall in stage kv % kStages). A fresh barrier's preceding phase
// counts as complete, so the first waits for an "empty" pass at once.
template <typename Cfg, bool kWindow, bool kVarlen>
__device__ __forceinline__ void produce_tiles(const FwdKernelParams& kp, const FwdBuffers& smem,
                                              FwdSharedState<Cfg::kStages>* shared) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  const FwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  ptx::prefetch_tensor_map(&kp.q_map);
  ptx::prefetch_tensor_map(&kp.k_map);
  ptx::prefetch_tensor_map(&kp.v_map);
  if constexpr (Cfg::Mask::kPresent) ptx::prefetch_tensor_map(&kp.mask_map);
  const int mask_tile_bytes = kp.mask.tile_bytes(Cfg::Mask::kColBlocks);
  const FwdTileScheduler<Cfg, kWindow, kVarlen> scheduler{kp};
  int tile = blockIdx.x;
  // Bit s: stage s's K buffer holds an output not yet read (out_waits: the
  // parity of its next out_free phase).
  uint32_t out_held = 0, out_waits = 0;
  for (int round = 0, kv = 0, q_round = 0;; ++round) {
    const int slot = round % 2;
    FwdTile t = scheduler.tile(tile);
    // The tile's key blocks; the consumers are handed those that the mask
    // does not hide (its block map: the other blocks are skipped).
    const int key_blocks = t.n_blocks;
    const bool mapped = Cfg::Mask::kPresent && params.mask_blocks.visibility != nullptr && t.n_blocks > 0;
    auto visibility = [&](int n_block) {
      return mapped ? tile_visibility(params.mask_blocks, t.batch, t.head, t.row0, kBlockM, p.len_q, n_block)
                    : BlockVisibility::kPartial;
    };
    if (mapped) {
      int shown = 0;
#pragma unroll 4
      for (int n_block = t.first_block; n_block < t.first_block + key_blocks; ++n_block) {
        shown += visibility(n_block) != BlockVisibility::kHidden;
      }
      t.n_blocks = shown;
    }
    ptx::mbarrier_wait(&shared->tile_empty[slot], ((round / 2) & 1) ^ 1);
    shared->tile[slot] = t;
    ptx::mbarrier_arrive(&shared->tile_full[slot]);
    if (t.n_blocks == kNoTileLeft) return;
    const int next_tile = scheduler.next();  // used only at the end
    // (A packed batch is batch 0 of its tensors, its sequences at rows q_start and k_start.)
    const int head = t.head, kv_head = t.kv_head, batch = kVarlen ? 0 : t.batch;
    if (t.n_blocks > 0) {
      ptx::mbarrier_wait(&shared->q_empty, (q_round++ & 1) ^ 1);
      ptx::mbarrier_arrive_expect_tx(&shared->q_full, Cfg::kQBytes);
      for (int c = 0; c < Cfg::kColBlocks; ++c) {
        ptx::tma_load_4d(smem.q + c * Cfg::kQColBlockBytes, &kp.q_map, &shared->q_full, c * Cfg::kColBlockCols,
                         t.q_start + t.row0, head, batch);
      }
    }
    for (int n_block = t.first_block; n_block < t.first_block + key_blocks; ++n_block) {
      const BlockVisibility seen = visibility(n_block);
      if (seen == BlockVisibility::kHidden) continue;
      const bool unmasked = seen == BlockVisibility::kVisible;  // (no mask tile to load)
      const int stage = kv % kStages;
      const uint32_t parity = (kv / kStages) & 1;
      const int key_row = t.k_start + n_block * kBlockN;
      ptx::mbarrier_wait(&shared->k_empty[stage], parity ^ 1);
      if (out_held >> stage & 1) {
        ptx::mbarrier_wait(&shared->out_free[stage], out_waits >> stage & 1);
        out_held ^= 1u << stage;
        out_waits ^= 1u << stage;
      }
      if constexpr (Cfg::Mask::kPresent) shared->stage_block[stage] = 2 * n_block + unmasked;
      ptx::mbarrier_arrive_expect_tx(&shared->k_full[stage], Cfg::kKBytes + (unmasked ? 0 : mask_tile_bytes));
      for (int c = 0; c < Cfg::kColBlocks; ++c) {
        ptx::tma_load_4d(smem.k + stage * Cfg::kKBytes + c * Cfg::kKVColBlockBytes, &kp.k_map, &shared->k_full[stage],
                         c * Cfg::kColBlockCols, key_row, kv_head, batch);
      }
      if (Cfg::Mask::kPresent && !unmasked) {
        for (int c = 0; c < Cfg::Mask::kColBlocks; ++c) {
          ptx::tma_load_4d(smem.mask + stage * Cfg::Mask::kBytes + c * kp.mask.block_bytes, &kp.mask_map,
                           &shared->k_full[stage], key_row + c * Cfg::Mask::kColBlockCols,
                           kp.mask.rows_full ? t.row0 : 0, head * kp.mask.head_step, batch * kp.mask.batch_step);
        }
      }
      ptx::mbarrier_wait(&shared->v_empty[stage], parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(&shared->v_full[stage], Cfg::kVBytes);
      for (int c = 0; c < Cfg::kColBlocksV; ++c) {
        if constexpr (Cfg::kValuesTransposed) {  // (head dim, keys): every head-dim row, the tile's keys
          ptx::tma_load_4d(smem.v + stage * Cfg::kVBytes + c * Cfg::kVtColBlockBytes, &kp.v_map,
                           &shared->v_full[stage], key_row + c * Cfg::kColBlockCols, 0, kv_head, batch);
          if (Cfg::kVtTailKeys > 0 && c == Cfg::kColBlocksV - 1) {
            ptx::tma_load_4d(smem.v + stage * Cfg::kVBytes + Cfg::kVtTailOffset, &kp.v_tail_map,
                             &shared->v_full[stage], key_row + Cfg::kColBlocksV * Cfg::kColBlockCols, 0, kv_head,
                             batch);
          }
        } else {
          ptx::tma_load_4d(smem.v + stage * Cfg::kVBytes + c * Cfg::kKVColBlockBytes, &kp.v_map,
                           &shared->v_full[stage], c * kSwizzleCols, key_row, kv_head, batch);
        }
      }
      ++kv;
    }
    if (Cfg::kOutThroughSmem && t.n_blocks > 0) out_held |= 1u << ((kv - 1) % kStages);
    tile = next_tile;
  }
}

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
