// The Hopper backward's tile scheduler (both kernels, flash_bwd_sm90.cuh):
// the kernel parameters, a block's place in the grid (its keys, key/value
// head and batch, backward_block) and its walk over the query tiles it
// streams, past those an attn_mask's block map hides (next_query_tile), which
// every role of the block follows.
#pragma once

#include "cuda/attn_mask.cuh"
#include "cuda/dq_accum.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/sm90/tile_config.h"
#include "cuda/tile_order.cuh"
#include "cuda/views.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// What the kernels read: the call, and tensor maps of q, k, v, dout and the
// attn_mask (a __grid_constant__ parameter: the copy engine reads the maps in place).
struct BwdKernelParams {
  BwdParams call;
  CUtensorMap q_map, k_map, v_map, dout_map, mask_map;
  int order_chunks;  // causal: heaviest_first_position's chunks
  MaskTileShape mask;
};

// One of a block's query tiles: query head `head` of the group, query block
// m_begin + m. unmasked: the attn_mask hides none of its pairs (or there is
// none). Starts before the first tile.
struct QueryTile {
  int head = 0, m = -1;
  int unmasked = 1;
};

// A block's keys and the query tiles it streams: kBlockN keys from col0 of key
// head h_kv of batch b; m_count query blocks from m_begin on (those that see
// any of the keys) of each of the group's query heads, less those the
// attn_mask's block map hides: tiles of them in all (next_query_tile).
// dq_accum: where the dQ rows of the group's first query head start in
// dq_accum (the next heads' follow). q_start, k_start: the sequence's first
// query and key row in a packed batch (0 in a dense call), len_q and len_k its
// lengths (the call's in a dense one); dq_accum_head_rows: dq_accum's rows a
// query head. In deterministic mode (dq_semaphore set: the counters of the
// group's first query head, m_tiles a head), the block walks each head's
// query blocks from m_rotation on, wrapping round (DqAddOrder).
struct BwdBlock {
  int64_t h_kv, b, col0, group, m_begin;
  int64_t head0;  // the first of its query heads (of the call's)
  int split;      // which of params.head_splits blocks of its keys (0 if 1)
  int m_count, tiles, m_rotation, m_tiles;
  float* dq_accum;
  int* dq_semaphore;
  int64_t q_start, k_start, len_q, len_k, dq_accum_head_rows;
};

// Moves t to the block's next query tile (query blocks within a head, then
// heads), past those the attn_mask's block map hides; false past the last.
// Every role of the block walks the same sequence. kOrdered (deterministic
// mode): each head's query blocks from block.m_rotation on, wrapping round.
template <typename Cfg, bool kOrdered = false>
__device__ __forceinline__ bool next_query_tile(const BwdParams& params, const BwdBlock& block, QueryTile& t) {
  if (block.m_count == 0) return false;
  while (true) {
    if constexpr (kOrdered) {
      if (t.m < 0) {
        t.m = block.m_rotation;
      } else {
        if (++t.m == block.m_count) t.m = 0;
        if (t.m == block.m_rotation) ++t.head;
      }
    } else if (++t.m == block.m_count) {
      t.m = 0;
      ++t.head;
    }
    if (t.head == block.group) return false;
    if constexpr (!Cfg::Mask::kPresent) {
      return true;
    } else {
      static_assert(Cfg::kBlockN == kKeyBlockKeys && Cfg::kBlockM % kMaskBlockRows == 0, "tiles of whole map blocks");
      const BlockVisibility seen =
          tile_visibility(params.mask_blocks, block.b, block.head0 + t.head,
                          (block.m_begin + t.m) * Cfg::kBlockM, Cfg::kBlockM, block.len_q, block.col0 / Cfg::kBlockN);
      if (seen == BlockVisibility::kHidden) continue;
      t.unmasked = seen == BlockVisibility::kVisible;
      return true;
    }
  }
}

// kWindow: the call has a sliding window (the kernels' template flag), whose
// edges bound the query blocks on both sides. kVarlen: a packed batch (the
// grid's batch is the sequence; blocks past its keys have no tiles).
// kOrdered: deterministic mode (params.dq_semaphore set; neither of those).
template <typename Cfg, bool kWindow, bool kVarlen = false, bool kOrdered = false>
__device__ __forceinline__ BwdBlock backward_block(const BwdKernelParams& kp) {
  const BwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  const int64_t n_blocks = ceil_div(p.len_k, Cfg::kBlockN);
  // The grid covers the (batch, key/value head) pairs whose rows dq_accum
  // holds (a chunk of the call's, or all), numbered from dq_accum_pair0.
  // Deterministic mode may split a key block's query heads over head_splits
  // blocks (deterministic_head_splits): the grid takes them as pairs, split
  // fastest.
  const int splits = kOrdered ? params.head_splits : 1;
  const GridPosition position =
      p.is_causal
          ? heaviest_first_position(blockIdx.x, static_cast<int>(n_blocks), static_cast<int>(p.heads_kv * splits),
                                    static_cast<int>(params.dq_accum_pairs * splits), kp.order_chunks)
          : grid_position(blockIdx.x, n_blocks, p.heads_kv * splits);
  const int64_t pair_in_chunk = position.batch * p.heads_kv + position.head / splits;
  const int64_t pair = params.dq_accum_pair0 + pair_in_chunk;
  BwdBlock block;
  block.h_kv = pair % p.heads_kv;
  block.b = pair / p.heads_kv;
  block.split = static_cast<int>(position.head % splits);
  // Causal: the first key blocks have the most queries, and start first; in
  // deterministic mode last, as each adds its dQ after the blocks above it
  // (DqAddOrder), which then start before it and never wait for it.
  const bool lightest_first = kOrdered && p.is_causal;
  block.col0 = (lightest_first ? n_blocks - 1 - position.block : position.block) * Cfg::kBlockN;
  block.group = p.heads_q / p.heads_kv / splits;
  block.head0 = (block.h_kv * splits + block.split) * block.group;
  // (dq_accum and the counters: from the block's first query head on)
  const int64_t heads_before = (pair_in_chunk * splits + block.split) * block.group;
  if constexpr (kVarlen) {
    const PackedSequences& packed = params.packed;
    const int b = static_cast<int>(block.b);
    const SequenceSpan queries = sequence_span(packed.cu_seqlens_q, packed.total_q, p.len_q, b);
    const SequenceSpan keys = sequence_span(packed.cu_seqlens_k, packed.total_k, p.len_k, b);
    block.q_start = queries.start;
    block.k_start = keys.start;
    block.len_q = queries.length;
    block.len_k = keys.length;
    block.dq_accum_head_rows = packed_dq_accum_start(packed.total_q, p.batch);
    block.dq_accum = params.dq_accum + (block.head0 * block.dq_accum_head_rows +
                                        packed_dq_accum_start(queries.start, b)) * Cfg::kDqAccumCols;
  } else {
    block.q_start = block.k_start = 0;
    block.len_q = p.len_q;
    block.len_k = p.len_k;
    block.dq_accum_head_rows = ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple;
    block.dq_accum = params.dq_accum + heads_before * block.dq_accum_head_rows * Cfg::kDqAccumCols;
  }
  if constexpr (kWindow || kVarlen) {
    const Visibility seen(p, block.len_q, block.len_k);
    const int64_t query_begin = seen.query_begin(block.col0);
    const int64_t query_end = seen.query_end(min(block.col0 + Cfg::kBlockN, block.len_k) - 1);
    block.m_begin = query_begin / Cfg::kBlockM;
    block.m_count = query_end > query_begin && block.col0 < block.len_k
                        ? static_cast<int>(ceil_div(query_end, Cfg::kBlockM) - block.m_begin)
                        : 0;
  } else {
    block.m_begin = Visibility(p).query_begin(block.col0) / Cfg::kBlockM;
    block.m_count = static_cast<int>(ceil_div(p.len_q, Cfg::kBlockM) - block.m_begin);
  }
  block.m_rotation = 0;
  block.m_tiles = static_cast<int>(ceil_div(p.len_q, Cfg::kBlockM));
  block.dq_semaphore = kOrdered ? params.dq_semaphore + heads_before * block.m_tiles : nullptr;
  if (kOrdered && !p.is_causal) block.m_rotation = static_cast<int>(position.block * block.m_tiles / n_blocks);
  block.tiles = static_cast<int>(block.group) * block.m_count;  // (query head of the group, query block) pairs
  if (Cfg::Mask::kPresent && params.mask_blocks.visibility != nullptr) {
    // Less those the mask hides; none left: dK = dV = 0, and no dQ.
    QueryTile t;
    for (block.tiles = 0; next_query_tile<Cfg>(params, block, t);) ++block.tiles;
  }
  return block;
}

// Deterministic mode: how many key blocks add their dQ of query block m
// (each query head's alike) before this block does (rank). The order is the
// one in which their walks reach the tile when all run at one pace, so that
// none waits long:
//  - causal: from the last key block whose walk reaches the tile down, as
//    each block's walk starts at the first query block that sees its keys
//    (and the grid starts them last first: a block waits only for blocks
//    that started before it);
//  - else block j starts at query block o(j) = j * m_tiles / n_blocks (so that
//    the key blocks of a head spread over its query blocks) and reaches m at
//    step d(j) = (m - o(j)) mod m_tiles: they add by d, then by j. (Block j
//    waits for block j + 1, and the last for the first: all of a head's
//    blocks must be resident at once, deterministic_backward_covers.)
// What depends on the block alone is worked out once: the writer asks for a
// rank at every tile, and 64-bit divisions there (about a microsecond on the
// producer's few registers) put it on the tile's critical path.
// count_late: the block before this one in each tile's order reaches the
// tile at least two steps earlier (BwdDqWriter): causal, kBlockN / kBlockM
// steps (the next key block's walk starts that many query blocks on); else
// about m_tiles / n_blocks.
template <typename Cfg>
struct DqAddOrder {
  bool causal, count_late;
  int j, n;           // the key block, and the head's key blocks
  int tiles, start;   // not causal: m_tiles and the walk's first query block
  int base;           // not causal: the rank's part that is the block's alone
  int64_t offset, len_q;  // causal: the diagonal's offset, the queries

  __device__ __forceinline__ DqAddOrder(const AttentionProblem& p, const BwdBlock& block)
      : causal(p.is_causal),
        j(static_cast<int>(block.col0 / Cfg::kBlockN)),
        n(static_cast<int>(ceil_div(p.len_k, Cfg::kBlockN))),
        tiles(block.m_tiles),
        start(block.m_rotation),
        base(0),
        offset(Visibility(p).offset),
        len_q(p.len_q) {
    if (!causal) base = j - first_block(start) - first_block(start + 1);
    count_late = causal ? Cfg::kBlockN >= 2 * Cfg::kBlockM : tiles >= 2 * n;
  }

  // The first key block whose walk starts at query block x or later
  // (deterministic_backward_covers keeps x * n in 32 bits).
  __device__ __forceinline__ int first_block(int x) const {
    return static_cast<int>((static_cast<unsigned>(x) * n + tiles - 1) / static_cast<unsigned>(tiles));
  }

  __device__ __forceinline__ int rank(int m) const {
    if (causal) {
      // Block i's walk starts at query_begin(i * kBlockN) / kBlockM (backward_block): it reaches m where that
      // row lies before the tile's end. Past len_q it is len_q (a block no row sees still adds its zeros to
      // the last tile).
      const int64_t rows_end = int64_t{m + 1} * Cfg::kBlockM;
      const int64_t last = rows_end > len_q ? n - 1 : (rows_end + offset - 1) / Cfg::kBlockN;
      return static_cast<int>(min(last, int64_t{n - 1})) - j;
    }
    // The blocks that reach m first: those whose walks start after this
    // block's and up to m (wrapping round), then those of the same start
    // below j.
    return first_block(m + 1) + base + (m < start ? n : 0);
  }
};

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
