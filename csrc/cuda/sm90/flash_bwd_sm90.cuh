// What the Hopper backward kernels share (flash_bwd_sm90_kernel.cuh: head dims
// up to 128; flash_bwd_sm90_hdim256.cu: head dim 256): the kernel parameters,
// the block's place in the grid and its walk over the query tiles (past those
// an attn_mask's block map hides), the producer's loads of K and V and of the
// streamed Q and dO tiles, the final stores of dK and dV, and the launch.
#pragma once

#include <limits>

#include "cuda/attn_mask.cuh"
#include "cuda/dq_accum.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/accumulators.cuh"
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

// A block's keys and the query tiles it streams: kBlockN keys from col0 of key
// head h_kv of batch b; m_count query blocks from m_begin on (those that see
// any of the keys) of each of the group's query heads, less those the
// attn_mask's block map hides: tiles of them in all (next_query_tile).
// dq_accum: where the dQ rows of the group's first query head start in
// dq_accum (the next heads' follow). q_start, k_start: the sequence's first
// query and key row in a packed batch (0 in a dense call), len_q and len_k its
// lengths (the call's in a dense one); dq_accum_head_rows: dq_accum's rows a
// query head.
struct BwdBlock {
  int64_t h_kv, b, col0, group, m_begin;
  int m_count, tiles;
  float* dq_accum;
  int64_t q_start, k_start, len_q, len_k, dq_accum_head_rows;
};

// Moves t to the block's next query tile (query blocks within a head, then
// heads), past those the attn_mask's block map hides; false past the last.
// Every role of the block walks the same sequence.
template <typename Cfg>
__device__ __forceinline__ bool next_query_tile(const BwdParams& params, const BwdBlock& block, QueryTile& t) {
  if (block.m_count == 0) return false;
  while (true) {
    if (++t.m == block.m_count) {
      t.m = 0;
      ++t.head;
    }
    if (t.head == block.group) return false;
    if constexpr (!Cfg::Mask::kPresent) {
      return true;
    } else {
      static_assert(Cfg::kBlockN == kKeyBlockKeys && Cfg::kBlockM % kMaskBlockRows == 0, "tiles of whole map blocks");
      const BlockVisibility seen =
          tile_visibility(params.mask_blocks, block.b, block.h_kv * block.group + t.head,
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
template <typename Cfg, bool kWindow, bool kVarlen = false>
__device__ __forceinline__ BwdBlock backward_block(const BwdKernelParams& kp) {
  const BwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  const int64_t n_blocks = ceil_div(p.len_k, Cfg::kBlockN);
  // The grid covers the (batch, key/value head) pairs whose rows dq_accum
  // holds (a chunk of the call's, or all), numbered from dq_accum_pair0.
  const GridPosition position =
      p.is_causal ? heaviest_first_position(blockIdx.x, static_cast<int>(n_blocks), static_cast<int>(p.heads_kv),
                                            static_cast<int>(params.dq_accum_pairs), kp.order_chunks)
                  : grid_position(blockIdx.x, n_blocks, p.heads_kv);
  const int64_t pair_in_chunk = position.batch * p.heads_kv + position.head;
  const int64_t pair = params.dq_accum_pair0 + pair_in_chunk;
  BwdBlock block;
  block.h_kv = pair % p.heads_kv;
  block.b = pair / p.heads_kv;
  block.col0 = position.block * Cfg::kBlockN;  // causal: the first key blocks have the most queries
  block.group = p.heads_q / p.heads_kv;
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
    block.dq_accum = params.dq_accum + (block.h_kv * block.group * block.dq_accum_head_rows +
                                        packed_dq_accum_start(queries.start, b)) * Cfg::kHeadDim;
  } else {
    block.q_start = block.k_start = 0;
    block.len_q = p.len_q;
    block.len_k = p.len_k;
    block.dq_accum_head_rows = ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple;
    block.dq_accum = params.dq_accum + pair_in_chunk * block.group * block.dq_accum_head_rows * Cfg::kHeadDim;
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
    block.m_begin = first_visible_query(p, causal_offset(p), block.col0) / Cfg::kBlockM;
    block.m_count = static_cast<int>(ceil_div(p.len_q, Cfg::kBlockM) - block.m_begin);
  }
  block.tiles = static_cast<int>(block.group) * block.m_count;  // (query head of the group, query block) pairs
  if (Cfg::Mask::kPresent && params.mask_blocks.visibility != nullptr) {
    // Less those the mask hides; none left: dK = dV = 0, and no dQ.
    QueryTile t;
    for (block.tiles = 0; next_query_tile<Cfg>(params, block, t);) ++block.tiles;
  }
  return block;
}

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
// not 16-byte aligned for the copy engine).
template <typename Cfg, bool kVarlen = false>
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
    ptx::mbarrier_arrive_expect_tx(&bars->kv_full, 2 * Cfg::kKVBytes);
    for (int c = 0; c < Cfg::kColBlocks; ++c) {
      ptx::tma_load_4d(s_k + c * Cfg::kKVColBlockBytes, &kp.k_map, &bars->kv_full, c * kSwizzleCols, key_row,
                       kv_head, batch);
      ptx::tma_load_4d(s_v + c * Cfg::kKVColBlockBytes, &kp.v_map, &bars->kv_full, c * kSwizzleCols, key_row,
                       kv_head, batch);
    }
  }
  if (Cfg::Mask::kPresent && lane == 0) ptx::prefetch_tensor_map(&kp.mask_map);
  QueryTile t;
  for (int tile = 0; next_query_tile<Cfg>(params, block, t); ++tile) {
    const int head = static_cast<int>(block.h_kv * block.group) + t.head;
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
      ptx::mbarrier_arrive_expect_tx(&bars->dout_full[stage], Cfg::kQBytes);
      for (int c = 0; c < Cfg::kColBlocks; ++c) {
        ptx::tma_load_4d(s_dout + stage * Cfg::kQBytes + c * Cfg::kQColBlockBytes, &kp.dout_map,
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

// Logit softcapping in the backward: the scores capped as in the forward
// (softcap * tanh(scale * s / softcap), in log2 units), and dS^T times the
// cap's derivative 1 - tanh^2, its tanh taken back from the float P^T and the
// lse (log2 P + lse is the capped score): no registers kept for it.
struct Softcap {
  float scale_over_cap = 0.f, cap_log2 = 0.f;

  Softcap() = default;
  __device__ __forceinline__ explicit Softcap(const AttentionProblem& p)
      : scale_over_cap(static_cast<float>(p.scale / p.softcap)), cap_log2(static_cast<float>(p.softcap * M_LOG2E)) {}

  __device__ __forceinline__ float cap(float s) const { return cap_log2 * ptx::tanh_approx(s * scale_over_cap); }
  // (0 where P is: the pair is hidden or its weight underflowed, and its dS is 0.)
  __device__ __forceinline__ float derivative(float p, float lse_log2) const {
    const float t = (ptx::log2_approx(p) + lse_log2) / cap_log2;
    return p > 0.f ? 1.f - t * t : 0.f;
  }
};

// A consumer's 64 keys x kBlockM queries of a tile's scores S^T become P^T =
// exp2(S^T * score_scale - lse) (lse_q: the tile's queries' lse in log2
// units, +inf for rows past the end and rows that see no key, whose P is then
// 0). Only tiles on the causal diagonal, a window's edges (kWindow) or at the
// end of the keys hide pairs; there, in 32-bit tile coordinates, key >=
// key_end is past the end, key - query > right_edge right of the diagonal (or
// the window's right edge) and key - query < left_edge left of the window.
// key_row: the thread's first key in the block (the other is key_row + 8); its
// queries are its accumulator's columns. kSoftcap: the scores are capped
// (softcap) instead of scaled by score_scale; kAlibi: scaled, then less
// alibi_log2 * |i + offset - j| (ALiBi's bias in log2 units).
template <int kBlockN, bool kWindow, bool kSoftcap = false, bool kAlibi = false, int kBlockM, int kRegs>
__device__ __forceinline__ void transposed_probabilities(float (&st)[kRegs], const AttentionProblem& p, int64_t col0,
                                                         int64_t row0, const Visibility& seen, int key_row, int lane,
                                                         const float (&lse_q)[kBlockM], float score_scale,
                                                         const Softcap& softcap = {}, float alibi_log2 = 0.f) {
  // i + offset - j at the tile's (key 0, query 0): 32 bits, as the tile coordinates.
  const int corner = kAlibi ? static_cast<int>(row0 + seen.offset - col0) : 0;
  auto log2_score = [&](float s, int key, int query) {
    if constexpr (kSoftcap) return softcap.cap(s);
    if constexpr (kAlibi) return fmaf(s, score_scale, -alibi_log2 * fabsf(static_cast<float>(corner + query - key)));
    return s * score_scale;
  };
  const bool crosses_edge = kWindow ? seen.tile_is_partial(row0, kBlockM, col0, kBlockN)
                                    : p.is_causal && col0 + kBlockN - 1 > row0 + seen.offset;
  const bool crosses_end = col0 + kBlockN > seen.len_k;
  if (crosses_edge || crosses_end) {
    const int key_end = static_cast<int>(min(seen.len_k - col0, int64_t{kBlockN}));
    auto in_tile = [](int64_t d) { return static_cast<int>(clamp_index(d, -kBlockM, kBlockN)); };
    const int right_edge = crosses_edge && seen.right >= 0 ? in_tile(row0 + seen.offset + seen.right - col0) : kBlockN;
    const int left_edge = kWindow && seen.left >= 0 ? in_tile(row0 + seen.offset - seen.left - col0) : -kBlockM;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int key = key_row + accumulator_row_offset(i), query = accumulator_column(i, lane);
      const bool hidden = key >= key_end || key - query > right_edge || (kWindow && key - query < left_edge);
      st[i] = hidden ? 0.f : ptx::exp2_approx(log2_score(st[i], key, query) - lse_q[query]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int key = key_row + accumulator_row_offset(i), query = accumulator_column(i, lane);
      st[i] = ptx::exp2_approx(log2_score(st[i], key, query) - lse_q[query]);
    }
  }
}

// In the first key block (col0 == 0), zeroes the dS^T of key 0 for the
// tile's queries that see key 0 alone, exactly 0 there (visibility.cuh):
// the holder's key 0 scores are its registers at row offset 0.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_first_key_alone(float (&dst)[kRegs], const AttentionProblem& p,
                                                     const Visibility& seen, int64_t col0, int64_t row0,
                                                     bool holds_first_key, int lane) {
  if (col0 != 0) return;  // a branch uniform across the CTA, and selects within it (no divergence in the loop)
  const RowRange alone = rows_seeing_first_key_alone(p.is_causal, seen.len_k, seen.offset, row0, kBlockM);
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    if (accumulator_row_offset(i) != 0) continue;
    dst[i] = holds_first_key && alone.holds(accumulator_column(i, lane)) ? 0.f : dst[i];
  }
}

// With a sliding window, zeroes the dS^T of the tile's queries that see one
// key alone (exactly 0 there, as SDPA gives; the window's form of
// zero_first_key_alone). How many keys a query sees rises, stays and falls
// along the queries (the window clipped by the ends of the keys), so a tile
// has such queries only where its first or last one sees at most one key:
// only those tiles test each query.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_window_rows_seeing_one_key(float (&dst)[kRegs], const Visibility& seen,
                                                                int64_t row0, int lane) {
  auto keys_seen = [&](int64_t row) { return seen.key_end(row) - seen.key_begin(row); };
  if (keys_seen(row0) > 1 && keys_seen(min(row0 + kBlockM, seen.len_q) - 1) > 1) return;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) dst[i] = keys_seen(row0 + accumulator_column(i, lane)) == 1 ? 0.f : dst[i];
}

// Dropout's decisions for a streamed tile of kBlockM queries against a
// consumer warpgroup's 64 keys, as both backward kernels draw and apply them
// (the same Philox numbers as the forward's): keep[j][w] for the lane's 16 x
// 16 block j and its queries of parity w (dropout_block_pair_flags), drawn two
// blocks a step, before the tile's GEMMs, while their registers are not yet live.
template <int kBlockM>
struct TileDropout {
  uint32_t keep[kBlockM / 16][2] = {};

  // key0: the key of the thread's first S^T register row (col0 + key_row).
  __device__ __forceinline__ void draw(const DropoutState dropout, const AttentionProblem& p, int64_t bh,
                                       int64_t row0, int64_t key0, int lane) {
    const uint64_t group0 = dropout_group(bh, row0 + (lane % 4) * 2, key0, p.len_q, p.len_k);
    const uint64_t step = 4 * dropout_quads(p.len_k);  // 16 queries on
#pragma unroll
    for (int pair = 0; pair < kBlockM / 32; ++pair) {
      dropout_block_pair_flags<true>(*reinterpret_cast<uint32_t(*)[2][2]>(&keep[2 * pair]), dropout,
                                     group0 + 2 * pair * step, step, lane);
    }
  }
  // Whether S^T register i is kept: block i / 8, query parity i % 2, query half (i / 4) % 2, key half (i / 2) % 2.
  __device__ __forceinline__ bool keeps(int i) const {
    return dropout_flag(keep[i / 8][i % 2], ((i / 4) % 2) * 2 + (i / 2) % 2);
  }
  // P^T's A fragments (dV's operand) where kept: register r of block j is query half r / 2, key half r % 2.
  __device__ __forceinline__ void drop(uint32_t (&frag)[kBlockM / 16][4]) const {
#pragma unroll
    for (int j = 0; j < kBlockM / 16; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) frag[j][r] &= dropout_pair_mask(keep[j], r);
    }
  }
};

// Zeroes the dS^T of the tile's queries that see one key alone, by the
// window's edges or the causal diagonal (exactly 0 there, as SDPA gives, where
// rounding would leave noise); not with attention sinks, whose softmax gives
// that key less than all the weight (its dS is then not 0).
template <int kBlockM, bool kWindow, int kRegs>
__device__ __forceinline__ void zero_lone_key_rows(float (&dst)[kRegs], const BwdParams& params,
                                                   const Visibility& seen, int64_t col0, int64_t row0,
                                                   bool holds_first_key, int lane) {
  if (params.sinks != nullptr) return;
  if constexpr (kWindow) {
    zero_window_rows_seeing_one_key<kBlockM>(dst, seen, row0, lane);
  } else {
    zero_first_key_alone<kBlockM>(dst, params.problem, seen, col0, row0, holds_first_key, lane);
  }
}

// Zeroes the dS^T of the tile's queries that an attn_mask leaves one key
// (their delta marked kOneKeyRowDelta, their dS^T so far NaN: visibility.cuh).
// The warp's lanes first look at the tile's kBlockM rows together, so that a
// tile with none (nearly all) costs a few loads and a vote, not a select a score.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_rows_seeing_one_key(float (&dst)[kRegs], const float (&delta_q)[kBlockM],
                                                         int lane) {
  bool marked = false;
#pragma unroll
  for (int row = lane; row < kBlockM; row += kWarpSize) marked |= marks_one_key_row(delta_q[row]);
  if (!__any_sync(0xffffffffu, marked)) return;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) dst[i] = marks_one_key_row(delta_q[accumulator_column(i, lane)]) ? 0.f : dst[i];
}

// Stores a consumer's 64 keys x (16 kSteps) queries of A fragments (P^T or
// dS^T) into a tile of rows of queries, a key a row, in blocks of 64 columns
// (kColBlockBytes apart), 128-byte swizzled like the tiles the copy engine
// writes (16-byte chunk c of row r at chunk c ^ (r % 8)), so that wgmma reads
// it as it lies. Register r of step kk: rows +0 / +8 (r % 2), columns +0 / +8 (r / 2).
template <int kColBlockBytes, int kSteps>
__device__ __forceinline__ void store_transposed_tile(unsigned char* tile, const uint32_t (&frag)[kSteps][4],
                                                      int key_row, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = key_row + (r % 2) * 8, chunk = 2 * kk + r / 2;  // chunk: 8 queries
      *reinterpret_cast<uint32_t*>(tile + (chunk / 8) * kColBlockBytes + row * kSwizzleRowBytes +
                                   (((chunk % 8) ^ (row % 8)) * 16) + (lane % 4) * 4) = frag[kk][r];
    }
  }
}

// grad (64 keys x N columns) += A (a 64 x 16 kSteps fragment of P^T or dS^T)
// times the stage's rows of dO or Q (rows_desc: N-major, stage 0's; a step: 16
// rows), issued as one wgmma group (not waited for).
template <typename Elem, int kRegs, int kSteps>
__device__ __forceinline__ void accumulate_key_gradient(float (&grad)[kRegs], uint32_t (&a)[kSteps][4],
                                                        uint64_t rows_desc, uint32_t stage_offset) {
  const uint64_t stage_desc = desc_advance(rows_desc, stage_offset);
  fence_registers(a);
  fence_registers(grad);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    ptx::wgmma_rs<Elem, 2 * kRegs, 1>(grad, a[kk], desc_advance(stage_desc, n_major_step_bytes(kk)), true);
  }
  ptx::wgmma_commit();
}

// Stores a consumer's dK (times the scale) and dV (times dropout's 1 / (1 -
// p)): its rows key_row and key_row + 8 of the block, its accumulators'
// columns from col0 of the head dim on. Columns past the head dim (padded to
// the kernel's) are not stored (as in the forward's output).
template <typename Elem, bool kVarlen = false, int kGradRegs>
__device__ __forceinline__ void store_key_gradients(const BwdParams& params, const BwdBlock& block, int key_row,
                                                    int col0, int lane, const float (&dk)[kGradRegs],
                                                    const float (&dv)[kGradRegs], float dv_scale) {
  const AttentionProblem& p = params.problem;
  const float scale = static_cast<float>(p.scale);
  // (A packed batch: batch 0 of the tensors, the sequence's keys from row k_start.)
  const int64_t batch = kVarlen ? 0 : block.b, len_k = kVarlen ? block.len_k : p.len_k;
  Elem* dk_head = head_ptr<Elem>(params.dk, batch, block.h_kv) + block.k_start * params.dk.stride_row;
  Elem* dv_head = head_ptr<Elem>(params.dv, batch, block.h_kv) + block.k_start * params.dv.stride_row;
  const int dim = static_cast<int>(p.head_dim);
  const bool padded = dim < col0 + 2 * kGradRegs;
  const int cols0 = col0 + (lane % 4) * 2;  // this thread's columns: 8 j + cols0 and the next
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t key = block.col0 + key_row + half * 8;
    if (key >= len_k) continue;
    Elem* dk_row = dk_head + key * params.dk.stride_row + cols0;
    Elem* dv_row = dv_head + key * params.dv.stride_row + cols0;
#pragma unroll
    for (int j = 0; j < kGradRegs / 4; ++j) {
      if (padded && j * 8 + cols0 >= dim) continue;
      *reinterpret_cast<uint32_t*>(dk_row + j * 8) =
          ptx::pack2<Elem>(dk[4 * j + 2 * half] * scale, dk[4 * j + 2 * half + 1] * scale);
      *reinterpret_cast<uint32_t*>(dv_row + j * 8) =
          ptx::pack2<Elem>(dv[4 * j + 2 * half] * dv_scale, dv[4 * j + 2 * half + 1] * dv_scale);
    }
  }
}

// Builds the tensor maps, computes delta (zeroing dq_accum), then, for each
// chunk of (batch, key/value head) pairs (as many chunks as dq_accum's room
// for params.dq_accum_pairs of them needs, of sizes that differ by one at
// most), launches the kernel, one block per (kBlockN keys, key/value head,
// batch), and scales and rounds dq_accum into dq (zeroing it again before the
// next chunk). False where a tensor map cannot describe the inputs (the call
// goes to the sm80 kernels). kVarlen: a packed batch, in one chunk (its
// delta computed as that of one batch element of all the packed rows, its
// dq_accum zeroed apart).
template <typename Elem, typename Cfg, bool kVarlen = false, typename Kernel>
bool launch_backward_kernel(const BwdParams& params, Kernel kernel, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  BwdKernelParams kp;
  kp.call = params;
  constexpr bool kBFloat16 = std::is_same_v<Elem, __nv_bfloat16>;
  const MappedShape shape = mapped_shape(p, params.packed, std::max(Cfg::kBlockM, Cfg::kBlockN));
  if (!shape.fits) return false;
  const int64_t rows_q = shape.rows_q, rows_k = shape.rows_k;
  auto map = [&](CUtensorMap* m, const TensorView4d& t, int64_t rows, int64_t heads, int box_rows) {
    return encode_tensor_map(m, t, shape.tensors, rows, heads, kBFloat16, box_rows);
  };
  if (!map(&kp.q_map, params.q, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.dout_map, params.dout, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.k_map, params.k, rows_k, p.heads_kv, Cfg::kBlockN) ||
      !map(&kp.v_map, params.v, rows_k, p.heads_kv, Cfg::kBlockN)) {
    return false;
  }
  if (Cfg::Mask::kPresent &&
      !encode_mask_tiles(&kp.mask_map, &kp.mask, params.mask, Cfg::Mask::kElemBytes, p, Cfg::kBlockM)) {
    return false;
  }
  const int64_t n_blocks = ceil_div(p.len_k, Cfg::kBlockN), pairs = p.heads_kv * p.batch;
  if (n_blocks * params.dq_accum_pairs > std::numeric_limits<int>::max()) return false;  // the grid's limit
  const ElementType type = kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16;
  if constexpr (kVarlen) {
    if (params.dq_accum_pairs != pairs) return false;  // (one chunk)
    BwdParams all_rows = params;
    all_rows.problem = shape.tensors;
    all_rows.problem.len_q = rows_q;
    all_rows.dq_accum = nullptr;
    compute_delta(all_rows, type, stream);
    cudaMemsetAsync(params.dq_accum, 0, packed_dq_accum_floats(params) * sizeof(float), stream);
  } else {
    compute_delta(params, type, stream);
  }
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  const int sms = multiprocessor_count();
  const int64_t chunks = ceil_div(pairs, params.dq_accum_pairs);
  BwdParams& chunk = kp.call;
  chunk.dq_accum_pair0 = chunk.dq_accum_pairs = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    chunk.dq_accum_pair0 += chunk.dq_accum_pairs;
    chunk.dq_accum_pairs = pairs / chunks + (c < pairs % chunks);
    if (c > 0) cudaMemsetAsync(chunk.dq_accum, 0, dq_accum_floats(p, chunk.dq_accum_pairs) * sizeof(float), stream);
    kp.order_chunks = one_wave_chunks(chunk.dq_accum_pairs, n_blocks, sms);
    kernel<<<static_cast<unsigned>(n_blocks * chunk.dq_accum_pairs), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
    convert_dq_accum(chunk, type, DqAccumLayout::kWgmmaTiles, stream);
  }
  return true;
}

// Head dim 256's dispatch (flash_bwd_sm90_hdim256.cu): a call of head dim 129
// to 256 that backward_covers.
bool launch_hdim256_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
