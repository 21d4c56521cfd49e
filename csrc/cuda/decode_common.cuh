// Device code of both decode kernels: sm80/decode.cu's (mma.sync fed by cp.async,
// any GPU from Ampere on) and sm90/decode_sm90_kernel.cuh's (fed by the copy engine).
// Both compute, per warp, the online softmax of a 16-row block of query rows
// (the GQA group's heads times the query tokens of one key/value head) over
// 16 keys at a time, as m16n8k16 accumulators: a lane holds rows lane / 4 and
// lane / 4 + 8, and of each 8-key n tile keys (lane % 4) * 2 and the next.
#pragma once

#include <algorithm>

#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/score_modifiers.cuh"

namespace flashattn_ext::cuda::decoding {

constexpr int kRows = kDecodeTileRows;

// How many chunks to split each of `units` units' keys into, from 1 to most:
// the fewest whose items fill waves of `slots` (the blocks that run at once)
// within 5% of the best count's fill.
inline int64_t evenest_chunks(int64_t units, int64_t slots, int64_t most) {
  auto fill = [&](int64_t chunks) {
    const int64_t items = units * chunks;
    return double(items) / double(ceil_div(items, slots) * slots);
  };
  double best = 0.;
  for (int64_t chunks = 1; chunks <= most; ++chunks) best = std::max(best, fill(chunks));
  int64_t chunks = 1;
  while (fill(chunks) < 0.95 * best) ++chunks;
  return chunks;
}

// Where key j of sequence b lies in the caches (see DecodeParams): the outer
// index (the sequence, or the block of a paged cache) and the row in it. A
// block index outside the cache is clamped into it, as lengths are
// (sequence_length, below).
// 32-bit division: the glue checks that j < 2^31.
struct CachePosition {
  int64_t outer;
  int row;
};

__device__ __forceinline__ CachePosition cache_position(const DecodeParams& params, int64_t b, int j) {
  if (params.block_table.data == nullptr) return {b, j};
  const int block_size = static_cast<int>(params.block_size);
  const int64_t block = params.block_table.at(b, j / block_size);
  return {min(max(block, int64_t{0}), params.num_blocks - 1), j % block_size};
}

// Row j of head h of sequence b's cache.
template <typename Elem>
__device__ __forceinline__ Elem* cache_row(const DecodeParams& params, const TensorView4d& cache, int64_t b,
                                           int64_t h, int64_t j) {
  const CachePosition at = cache_position(params, b, static_cast<int>(j));
  return static_cast<Elem*>(cache.data) + at.outer * cache.stride_batch + h * cache.stride_head +
         int64_t(at.row) * cache.stride_row;
}

// Keys that sequence b's queries see, clamped to the capacity so that no read
// leaves the cache (the CPU op raises on such lengths; the CUDA op does not
// read them back, which would wait for the GPU, but decode_poison marks the
// sequence's results NaN).
__device__ __forceinline__ int64_t sequence_length(const DecodeParams& params, int64_t b) {
  return params.clamped_length(b);
}

// Row `index` of key/value head h_kv's query rows: (query head, query token)
// of its group, rows in (head, token) order.
struct QueryRow {
  int64_t head, token;
};
__device__ __forceinline__ QueryRow query_row(int64_t h_kv, int group, int len_q, int index) {
  return {h_kv * group + index / len_q, index % len_q};
}

// What changes a pair's score besides the scale and softcap: nothing, ALiBi's
// bias, or a bool attn_mask (a dense call's, cuda/route.cpp). A template
// argument: ALiBi's 64-bit distances cost the kernels without it up to 23
// registers, and the mask's row pointers 4.
enum class ScoreTerm { kNone, kAlibi, kMask };

// What a lane's two rows (first and first + step of a block of `rows` rows
// from row0 of the query rows of key/value heads h_kv on: lane / 4 and + 8
// where the query rows are an mma's 16 rows) see: keys [begin, end), bounded
// by key_end, of key/value head h_kv + head; rows past the block's see none.
// kAlibi: each row's slope in log2 units; kMask: each row's row of the mask
// (its columns contiguous).
template <ScoreTerm kTerm>
struct LaneRows {
  int64_t begin[2], end[2], token[2];
  int head[2];
  float alibi_log2[2];
  const uint8_t* mask_row[2];

  __device__ __forceinline__ LaneRows(const DecodeParams& params, const Visibility& vis, int64_t b, int64_t h_kv,
                                      int row0, int rows, int64_t key_end, int first, int step) {
    const AttentionProblem& p = params.problem;
    const int group = static_cast<int>(p.heads_q / p.heads_kv), len_q = static_cast<int>(p.len_q);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = first + half * step;
      const QueryRow row = query_row(h_kv, group, len_q, row0 + r);
      token[half] = row.token;
      head[half] = (row0 + r) / (group * len_q);
      begin[half] = r >= rows ? 0 : vis.key_begin(row.token);
      end[half] = r >= rows ? 0 : min(vis.key_end(row.token), key_end);
      alibi_log2[half] = kTerm == ScoreTerm::kAlibi && r < rows ? alibi_slope_log2(p, b, row.head) : 0.f;
      mask_row[half] = kTerm == ScoreTerm::kMask
                           ? static_cast<const uint8_t*>(params.mask.data) + b * params.mask.stride_batch +
                                 row.head * params.mask.stride_head + row.token * params.mask.stride_row
                           : nullptr;
    }
  }
};

// Bit i (i = nt * 4 + e, as the scores s[nt][e] of finish_scores) set where
// the mask shows the lane's pair i (kMask; all set otherwise). Its
// loads are issued before a tile's data is waited for, so that their latency
// hides under that wait.
template <ScoreTerm kTerm>
__device__ __forceinline__ uint32_t mask_bits(const LaneRows<kTerm>& rows, int64_t key0, int pair0, int heads_log2,
                                              int lane) {
  if constexpr (kTerm != ScoreTerm::kMask) {
    return 0xff;
  } else {
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int pair = pair0 + (i / 4) * 8 + (lane % 4) * 2 + i % 2;
      const int64_t j = key0 + (pair >> heads_log2);
      const int half = (i % 4) / 2;
      // (Only keys the row may see are read: the mask ends at the capacity.)
      if (j >= rows.begin[half] && j < rows.end[half] && rows.mask_row[half][j] != 0) bits |= 1u << i;
    }
    return bits;
  }
}

// How raw scores become log2-unit logits: scale * x, or with softcapping
// softcap * tanh(scale * x / softcap) (score_modifiers.cuh).
struct ScoreScale {
  float scale_log2;
  SoftcapLog2 softcap;
  bool softcapped;

  __device__ __forceinline__ explicit ScoreScale(const AttentionProblem& p)
      : scale_log2(score_scale_log2(p)), softcap(p), softcapped(p.softcap > 0.0) {}
};

// Scores in log2 units: scaled (or capped), -inf where a row does not see
// the pair's key, the pair is another head's or the mask hides it (bit i of
// visible: mask_bits), less ALiBi's bias where it counts. score(i) is the
// lane's i-th score and place(i) its {pair, half}: the pair's index in a tile
// whose keys start at key0 (pair i is key key0 + (i >> heads_log2) of head
// i % 2^heads_log2; one head: key key0 + i), and which of the lane's rows
// (LaneRows) it is a score of.
template <ScoreTerm kTerm, int kScores, typename Score, typename Place>
__device__ __forceinline__ void finish_scores_each(Score&& score, const ScoreScale& scale,
                                                   const LaneRows<kTerm>& rows, const Visibility& vis, int64_t key0,
                                                   int heads_log2, uint32_t visible, Place&& place) {
  if (scale.softcapped) {  // one branch a tile, not one per score
#pragma unroll
    for (int i = 0; i < kScores; ++i) score(i) = scale.softcap.capped(score(i));
  } else {
#pragma unroll
    for (int i = 0; i < kScores; ++i) score(i) *= scale.scale_log2;
  }
  // Each row's keys as offsets from key0, in 32 bits (keys are below 2^31:
  // the glue checks), clamped to the tile's pairs (fewer than 2^8 keys), so
  // that each score takes 32-bit compares, not 64-bit ones.
  int first[2], past[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    first[half] = min(max(static_cast<int>(rows.begin[half] - key0), -1), 1 << 8);
    past[half] = min(max(static_cast<int>(rows.end[half] - key0), -1), 1 << 8);
  }
#pragma unroll
  for (int i = 0; i < kScores; ++i) {
    const int2 at = place(i);
    const int pair = at.x, half = at.y, key = pair >> heads_log2;
    if ((pair & ((1 << heads_log2) - 1)) != rows.head[half] || key < first[half] || key >= past[half] ||
        !(visible >> i & 1)) {
      score(i) = -INFINITY;
    } else if constexpr (kTerm == ScoreTerm::kAlibi) {
      score(i) += alibi_bias(rows.alibi_log2[half], static_cast<float>(vis.distance(rows.token[half], key0 + key)));
    }
  }
}

// A warp's scores of 16 (key, key/value head) pairs from pair0 of a tile
// whose keys start at key0, as mma accumulators (the queries' rows the mma's
// rows: s[nt][e] is row lane / 4 + (e / 2) * 8's score of pair pair0 + nt * 8
// + (lane % 4) * 2 + e % 2), finished (finish_scores_each; bit nt * 4 + e of
// visible is s[nt][e]'s).
template <ScoreTerm kTerm>
__device__ __forceinline__ void finish_scores(float (&s)[2][4], const ScoreScale& scale, const LaneRows<kTerm>& rows,
                                              const Visibility& vis, int64_t key0, int pair0, int heads_log2,
                                              int lane, uint32_t visible) {
  finish_scores_each<kTerm, 8>([&](int i) -> float& { return s[i / 4][i % 4]; }, scale, rows, vis, key0, heads_log2,
                               visible, [&](int i) {
                                 return make_int2(pair0 + (i / 4) * 8 + (lane % 4) * 2 + i % 2, (i % 4) / 2);
                               });
}

// The online softmax over a warp's 16 keys: their scores become probabilities
// (unnormalized), the rows' running max and this lane's share of their sums
// move on, and the output accumulators (acc, kDimTiles n tiles) are rescaled.
// Each row lives in the 4 lanes of a quad.
template <int kDimTiles>
__device__ __forceinline__ void online_softmax(float (&s)[2][4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&acc)[kDimTiles][4]) {
  float rescales[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]), fmaxf(s[1][2 * half], s[1][2 * half + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
    const float new_max = fmaxf(row_max[half], tile_max);
    // A row with nothing visible yet keeps max -inf; subtract 0 instead so
    // that exp2(-inf - max) stays 0 rather than NaN.
    const float max_used = new_max == -INFINITY ? 0.f : new_max;
    const float rescale = ptx::exp2_approx(row_max[half] - max_used);
    row_max[half] = new_max;
    float tile_sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        s[nt][e] = ptx::exp2_approx(s[nt][e] - max_used);
        tile_sum += s[nt][e];
      }
    }
    row_sum[half] = row_sum[half] * rescale + tile_sum;  // this lane's partial sum
    rescales[half] = rescale;
  }
  // Most tiles leave every row's max where it was: then no accumulator to
  // rescale (kDimTiles * 4 multiplies by 1, a tenth of a tile's instructions).
  if (__any_sync(0xffffffff, rescales[0] != 1.f || rescales[1] != 1.f)) {
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[dt][e] *= rescales[e / 2];
    }
  }
}

// Calls fn with params' ScoreTerm as a std::integral_constant (a mask and
// ALiBi together never reach the decode kernels: cuda/route.cpp).
template <typename Fn>
void dispatch_score_term(const DecodeParams& params, Fn&& fn) {
  if (params.mask.data != nullptr) {
    fn(std::integral_constant<ScoreTerm, ScoreTerm::kMask>{});
  } else if (params.problem.alibi_slopes != nullptr) {
    fn(std::integral_constant<ScoreTerm, ScoreTerm::kAlibi>{});
  } else {
    fn(std::integral_constant<ScoreTerm, ScoreTerm::kNone>{});
  }
}

}  // namespace flashattn_ext::cuda::decoding
