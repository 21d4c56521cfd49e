// The terms that turn a tile's products into its scores, and the scores into
// what the softmax takes: the score modifiers of a head (HeadScoreTerms, from
// score_modifiers.h), applied with the causal mask and the window
// (adjust_scores); dropout's factors (HeadDropout, which dropout_mask draws
// too); and compute_scores, a tile's scores from its queries and keys with all
// of these applied.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "cpu/tiles.h"
#include "dropout.h"
#include "flash_params.h"
#include "score_modifiers.h"

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

// The score modifiers (score_modifiers.h) of one (batch b, query head h), in
// natural units, on scores that come scaled (the queries are: see
// load_scaled_queries and Products::raw_scale).
template <typename T, typename A>
struct HeadScoreTerms {
  bool softcapped;
  Softcap<A> softcap;
  A alibi_slope;  // 0: no ALiBi
  HeadMask<T, A> mask;

  HeadScoreTerms(const AttentionProblem& p, MaskKind mask_kind, const TensorView4d& mask_view, int64_t b, int64_t h)
      : softcapped(p.softcap > 0.0),
        softcap(softcapped ? Softcap<A>(p, 1.0, kNaturalUnits) : Softcap<A>()),
        alibi_slope(flashattn_ext::alibi_slope(p, b, h, A(kNaturalUnits))),
        mask(mask_kind, mask_view, b, h, kNaturalUnits) {}

  // Softcaps n scores, the tanh of all at once (vectorized); with grad, also
  // the cap's derivative there, for the backward.
  void apply_softcap(A* scores, int64_t n, A* grad) const {
    for (int64_t i = 0; i < n; ++i) scores[i] = softcap.tanh_argument(scores[i]);
    at::Tensor tile = tile_tensor(scores, n);
    at::tanh_(tile);
    for (int64_t i = 0; i < n; ++i) {
      if (grad != nullptr) grad[i] = Softcap<A>::derivative(scores[i]);
      scores[i] = softcap.from_tanh(scores[i]);
    }
  }
};

// Dropout for one (batch, head): for each (query, key) pair, 0 where dropped
// and 1 / (1 - p) where kept (see dropout.h), drawn a tile at a time.
template <typename A>
struct HeadDropout {
  bool enabled = false;
  uint64_t seed = 0, offset = 0;
  int bits = kDefaultDropoutBits;
  uint32_t threshold = 0;
  A keep_scale = 1;
  int64_t bh = 0, len_q = 0, len_k = 0;

  HeadDropout(const DropoutParams& dropout, const AttentionProblem& p, int64_t b, int64_t h)
      : enabled(dropout.p > 0.0) {
    if (!enabled) return;
    seed = static_cast<uint64_t>(dropout.rng_state[0]);
    offset = static_cast<uint64_t>(dropout.rng_state[1]);
    bits = dropout_bits_of(dropout.rng_state);
    threshold = dropout_threshold(dropout.p, bits);
    keep_scale = static_cast<A>(dropout_keep_scale(dropout.p));
    bh = b * p.heads_q + h;
    len_q = p.len_q;
    len_k = p.len_k;
  }

  // The factors of queries [row0, row0 + rows) x keys [col0, col0 + cols), a dense rows x cols tile.
  void factors(int64_t row0, int64_t rows, int64_t col0, int64_t cols, A* out) const {
    fill_tile(row0, rows, col0, cols, keep_scale, A(0), out, cols);
  }

  // out[r * ld + c] = kept, or dropped where dropout drops query row0 + r and
  // key col0 + c, for rows x cols pairs, drawn in blocks of 16 x 16 (see
  // block_numbers). Tiles need not start or end at a block's edge: a block
  // across the edge fills only its pairs inside.
  template <typename Out>
  void fill_tile(int64_t row0, int64_t rows, int64_t col0, int64_t cols, Out kept, Out dropped, Out* out,
                 int64_t ld) const {
    if (!enabled) {
      for (int64_t r = 0; r < rows; ++r) std::fill(out + r * ld, out + r * ld + cols, kept);
    } else if (bits == 8) {
      fill_blocks<8>(row0, rows, col0, cols, kept, dropped, out, ld);
    } else {
      fill_blocks<16>(row0, rows, col0, cols, kept, dropped, out, ld);
    }
  }

  // numbers[i][j]: the number of query block_q + i and key block_k + j, for a
  // block of 16 x 16 pairs (block_q and block_k multiples of 16): its 16
  // groups, one Philox call each (two with 16 bits), where dropout_number
  // makes one for each pair. With kBits a constant, so is every pair's slot.
  template <int kBits>
  void block_numbers(int64_t block_q, int64_t block_k, uint16_t numbers[16][16]) const {
    constexpr int kMembers[4] = {0, 1, 8, 9};  // a group's queries (keys), from its first
    constexpr int kCalls = dropout_group_calls(kBits);
    for (int first_q = 0; first_q < 8; first_q += 2) {
      for (int first_k = 0; first_k < 8; first_k += 2) {
        const uint64_t group = dropout_group(bh, block_q + first_q, block_k + first_k, len_q, len_k);
        PhiloxOutput outputs[kCalls];
        for (int call = 0; call < kCalls; ++call) {
          outputs[call] = dropout_call(seed, offset, dropout_call_index(group, kBits, call));
        }
#pragma GCC unroll 4
        for (int mq = 0; mq < 4; ++mq) {
#pragma GCC unroll 4
          for (int mk = 0; mk < 4; ++mk) {
            const int i = first_q + kMembers[mq], j = first_k + kMembers[mk];
            const DropoutSlot slot = dropout_slot(kBits, i, j);  // (depends on i % 16 and j % 16 only)
            numbers[i][j] = static_cast<uint16_t>(dropout_slot_number(outputs[slot.call], slot, kBits));
          }
        }
      }
    }
  }

  // fill_tile with kBits-bit numbers: each block's numbers drawn whole, then
  // compared a row at a time (a loop the compiler vectorizes; comparing each
  // number where it was drawn took twice the time).
  template <int kBits, typename Out>
  void fill_blocks(int64_t row0, int64_t rows, int64_t col0, int64_t cols, Out kept, Out dropped, Out* out,
                   int64_t ld) const {
    const int64_t row_end = row0 + rows, col_end = col0 + cols;
    uint16_t numbers[16][16];
    for (int64_t block_q = row0 / 16 * 16; block_q < row_end; block_q += 16) {
      for (int64_t block_k = col0 / 16 * 16; block_k < col_end; block_k += 16) {
        block_numbers<kBits>(block_q, block_k, numbers);
        // The block's pairs inside the tile.
        const int64_t q_begin = std::max(block_q, row0), q_end = std::min(block_q + 16, row_end);
        const int64_t k_begin = std::max(block_k, col0), k_end = std::min(block_k + 16, col_end);
        for (int64_t i = q_begin; i < q_end; ++i) {
          const uint16_t* number = numbers[i - block_q] + (k_begin - block_k);
          Out* dst = out + (i - row0) * ld + (k_begin - col0);
          for (int64_t j = 0; j < k_end - k_begin; ++j) dst[j] = number[j] >= threshold ? kept : dropped;
        }
      }
    }
  }
};

// The scores of queries row0 on and keys col0 on (rows x cols, dense) with
// the head's score terms applied (softcapped, with its derivative into
// softcap_grad where given; less ALiBi's bias; masked), and -inf where query
// row0 + r may not see key col0 + c.
template <typename T, typename A>
void adjust_scores(A* scores, int64_t rows, int64_t cols, const HeadScoreTerms<T, A>& terms, const Visibility& vis,
                   int64_t row0, int64_t col0, A* softcap_grad = nullptr) {
  if (terms.softcapped) terms.apply_softcap(scores, rows * cols, softcap_grad);
  const bool partial = vis.tile_is_partial(row0, rows, col0, cols);
  const bool per_pair = terms.mask.present() || terms.alibi_slope != A(0);
  if (!partial && !per_pair) return;  // the common tile
  if (!per_pair) {
    // Causal or windowed: each row sees one range of keys, the rest is hidden.
    for (int64_t r = 0; r < rows; ++r) {
      A* row = scores + r * cols;
      const int64_t begin = std::clamp<int64_t>(vis.key_begin(row0 + r) - col0, 0, cols);
      const int64_t end = std::clamp<int64_t>(vis.key_end(row0 + r) - col0, begin, cols);
      std::fill(row, row + begin, kNegInf<A>);
      std::fill(row + end, row + cols, kNegInf<A>);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = row0 + r, j = col0 + c;
      A& score = scores[r * cols + c];
      const A biased = score + alibi_bias(terms.alibi_slope, static_cast<A>(vis.distance(i, j)));
      if (partial && !vis.visible(i, j)) {
        score = kNegInf<A>;
      } else {
        score = terms.mask.present() ? terms.mask.apply(biased, i, j) : biased;
      }
    }
  }
}

// Whether adjust_scores changes any score of the tile (most tiles it leaves as they are).
template <typename T, typename A>
bool adjusts_scores(const HeadScoreTerms<T, A>& terms, const Visibility& vis, int64_t row0, int64_t rows,
                    int64_t col0, int64_t cols) {
  return terms.softcapped || terms.alibi_slope != A(0) || terms.mask.present() ||
         vis.tile_is_partial(row0, rows, col0, cols);
}

// scores[r][c] = <q_r, k_c> (in A; q_r already times the softmax scale, see
// load_scaled_queries; k transposed: key c is column c of k_t, whose rows lie
// ld_k apart), adjusted (see adjust_scores).
template <typename T, typename A, typename G>
void compute_scores(const G* q, const G* k_t, int64_t ld_k, int64_t rows, int64_t cols, int64_t dim,
                    const HeadScoreTerms<T, A>& terms, const Visibility& vis, int64_t row0, int64_t col0,
                    DualTile<A, G>& score_tile, A* softcap_grad = nullptr) {
  matmul(rows, cols, dim, q, dim, k_t, ld_k, score_tile.gemm(), cols);
  adjust_scores(score_tile.from_gemm(rows * cols), rows, cols, terms, vis, row0, col0, softcap_grad);
}

}  // namespace detail
}  // namespace flashattn_ext::cpu
