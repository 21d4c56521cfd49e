// The Hopper forward's tile scheduler: which (block of query rows, head,
// batch) tile a block takes next, and what its consumers run of it
// (fwd_tile: its rows, its sequence in a packed batch, its key blocks). A
// block takes its first tile from its index and the next from an atomic
// counter, in the order of heaviest_first_position for causal calls,
// grid_position(_heads_first)'s otherwise, and for a packed batch in the
// order of tile_order (built on the device: cuda::plan_packed_forward).
#pragma once

#include "cuda/launch.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/tile_order.cuh"
#include "cuda/views.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// The tile scheduler counts tiles in an int (with room for the grid's last fetches past the end).
constexpr int64_t kMaxTiles = int64_t{1} << 30;

// packed_pairs: a packed batch's (sequence, query block) pairs, as the plan
// kernel counted them (kVarlen only).
template <typename Cfg, bool kWindow, bool kVarlen>
__device__ __forceinline__ FwdTile fwd_tile(const FwdKernelParams& kp, int tile, int packed_pairs) {
  const AttentionProblem& p = kp.call.problem;
  const int m_blocks = static_cast<int>(ceil_div(p.len_q, Cfg::kBlockM)), heads = static_cast<int>(p.heads_q);
  FwdTile t;
  if constexpr (kVarlen) {
    // Heads outermost, each head's (sequence, query block) pairs in the order
    // of tile_order: the tiles that run together read the same head's keys and
    // values from L2, and the grid ends with light ones.
    const PackedSequences& packed = kp.call.packed;
    t.head = tile / packed_pairs;
    const int pair = tile - t.head * packed_pairs;
    t.batch = packed.tile_order[2 * pair];
    const SequenceSpan queries = sequence_span(packed.cu_seqlens_q, packed.total_q, p.len_q, t.batch);
    const SequenceSpan keys = sequence_span(packed.cu_seqlens_k, packed.total_k, p.len_k, t.batch);
    t.q_start = queries.start;
    t.k_start = keys.start;
    t.len_q = queries.length;
    t.len_k = keys.length;
    t.row0 = packed.tile_order[2 * pair + 1] * Cfg::kBlockM;
  } else {
    const int pairs = kp.tiles / m_blocks;
    const GridPosition position = p.is_causal ? heaviest_first_position(tile, m_blocks, heads, pairs, kp.order_chunks)
                                  : kp.heads_first ? grid_position_heads_first(tile, m_blocks, heads)
                                                   : grid_position(tile, m_blocks, heads);
    t.row0 = static_cast<int>((m_blocks - 1 - position.block) * Cfg::kBlockM);  // longest causal rows first
    t.head = static_cast<int>(position.head);
    t.batch = static_cast<int>(position.batch);
    t.q_start = t.k_start = 0;
    t.len_q = static_cast<int>(p.len_q);
    t.len_k = static_cast<int>(p.len_k);
  }
  t.kv_head = t.head / static_cast<int>(p.heads_q / p.heads_kv);
  if constexpr (kWindow || kVarlen) {
    const Visibility seen(p, t.len_q, t.len_k);
    const int64_t key_begin = seen.key_begin(t.row0);
    const int64_t key_end = seen.key_end_of_rows(t.row0, Cfg::kBlockM);
    t.first_block = static_cast<int>(key_begin / Cfg::kBlockN);
    t.n_blocks = key_end > key_begin ? static_cast<int>(ceil_div(key_end, Cfg::kBlockN)) - t.first_block : 0;
  } else {
    t.first_block = 0;
    t.n_blocks = static_cast<int>(ceil_div(Visibility(p).key_end_of_rows(t.row0, Cfg::kBlockM), Cfg::kBlockN));
  }
  return t;
}

// The producer's walk through the tiles: tile(index) is the index-th, or one
// with n_blocks == kNoTileLeft past the last; next() fetches the index of the
// block's next tile (blocks take their first tiles by their own index).
template <typename Cfg, bool kWindow, bool kVarlen>
struct FwdTileScheduler {
  const FwdKernelParams& kp;
  // (A packed batch's were counted on the device.)
  const int packed_pairs = kVarlen ? *kp.call.packed.tile_pairs : 0;
  const int tiles = kVarlen ? packed_pairs * static_cast<int>(kp.call.problem.heads_q) : kp.tiles;

  __device__ __forceinline__ FwdTile tile(int index) const {
    FwdTile t;
    t.n_blocks = kNoTileLeft;
    if (index < tiles) t = fwd_tile<Cfg, kWindow, kVarlen>(kp, index, packed_pairs);
    return t;
  }
  __device__ __forceinline__ int next() const { return gridDim.x + atomicAdd(kp.call.tile_counter, 1); }
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
