// The forward over every query block (forward_tiles): the online softmax over
// a head's key tiles, its tile products by ConvertedProducts or ReducedProducts
// (products.h). attention_forward (forward.cpp) runs it with the output, the
// backward (backward.cpp) without, for a log-sum-exp in its own accumulation type.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/products.h"
#include "cpu/score_terms.h"
#include "cpu/tiles.h"
#include "flash_params.h"

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

// The i-th of n query blocks in the order 0, n - 1, 1, n - 2, ...: causal
// blocks grow longer down the rows, so that the few consecutive tasks a thread
// takes at small shapes (blocks of one head) are as long in all as another
// thread's (at 1 x 4 x 512 x 64 on 16 threads, four blocks of 32 rows a
// thread: the busiest thread took twice the mean's time in order, 1.5x so;
// the bfloat16 forward 250 to 188 us).
inline int64_t longest_and_shortest_in_turn(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// The forward over every query block, its tile products by Products (see
// ConvertedProducts). lse_all (batch, heads_q, len_q) receives the log-sum-exp
// in the type L; with kWithOutput the output goes to params.out.
template <typename T, bool kWithOutput = true, typename L, typename Products = ConvertedProducts<T, Gemm<T>>>
void forward_tiles(const FwdParams& params, L* lse_all) {
  // The forward's softmax runs in float for float32 inputs too, as torch's CPU
  // kernel does (the running max keeps exp's arguments near 0): only the
  // backward needs double. The backward's own LSE pass (no output) stays in Acc.
  using A = std::conditional_t<kWithOutput && std::is_same_v<T, float>, float, Acc<T>>;
  using G = Gemm<T>;
  const AttentionProblem& p = params.problem;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  const int64_t block_q = query_block_rows(p, Products::kMaxRows);
  const int64_t q_blocks = ceil_div(p.len_q, block_q);
  const Visibility vis(p);

  // A thread keeps the keys and values of the head its last task read, each
  // tile loaded once for all the head's query blocks (a thread's tasks are
  // consecutive: the blocks of one head, then the next); where a head's do not
  // fit in kHeadKeysBytes, one tile, loaded for each use. Where the key/value
  // heads number fewer than the threads, several threads would each load (and
  // pack) a whole head: a pass of their own loads every head's tiles once,
  // spread over all threads, into memory that the threads then share (at
  // 1 x 4 x 512 x 64 on 16 threads, four loads of each head otherwise).
  const bool keep_head = Products::head_bytes(p) <= kHeadKeysBytes;
  const int64_t heads_kv = p.batch * p.heads_kv;
  const bool share_heads = keep_head && heads_kv < at::get_num_threads();
  using Stored = typename Products::Stored;
  const int64_t key_elems = Products::key_tiles_elems(p), value_elems = Products::value_tiles_elems(p);
  const int64_t key_tiles = ceil_div(p.len_k, kBlockK);
  // (Not zeroed: the loads write every value that a product reads.)
  std::unique_ptr<Stored[]> shared_keys, shared_values;
  if (share_heads) {
    shared_keys.reset(new Stored[heads_kv * key_elems]);
    if constexpr (kWithOutput) shared_values.reset(new Stored[heads_kv * value_elems]);
    at::parallel_for(0, heads_kv * key_tiles, 1, [&](int64_t begin, int64_t end) {
      Products loader(p, /*max_rows=*/0, /*kept_keys=*/0);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / key_tiles, tile = item % key_tiles;
        const int64_t b = head / p.heads_kv, h_kv = head % p.heads_kv;
        const int64_t col0 = tile * kBlockK, cols = std::min(kBlockK, p.len_k - col0);
        loader.use_tiles(shared_keys.get() + head * key_elems,
                         kWithOutput ? shared_values.get() + head * value_elems : nullptr);
        loader.load_keys(params.k, b, h_kv, col0, cols, tile);
        if constexpr (kWithOutput) loader.load_values(params.v, b, h_kv, col0, cols, tile);
      }
    });
  }

  at::parallel_for(0, p.batch * p.heads_q * q_blocks, 1, [&](int64_t begin, int64_t end) {
    // keys_loaded[t] keys of tile t of the thread's own head loaded.
    const int64_t kept_keys = share_heads ? 0 : keep_head ? p.len_k : kBlockK;
    Products products(p, block_q, kept_keys);
    std::vector<int64_t> keys_loaded(ceil_div(kept_keys, kBlockK));
    int64_t loaded_head = -1;
    const int64_t acc_ld = products.acc_ld();
    std::vector<A> acc(block_q * acc_ld), row_max(block_q), row_sum(block_q), rescale(block_q), max_used(block_q);
    std::vector<A> tile_max(block_q), tile_sum(block_q);
    DualTile<A, G> score_tile(block_q * kBlockK);
    std::vector<A> drop_factors(params.dropout.p > 0.0 ? block_q * kBlockK : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t q_block = longest_and_shortest_in_turn(task % q_blocks, q_blocks);
      const int64_t h = (task / q_blocks) % p.heads_q;
      const int64_t b = task / (q_blocks * p.heads_q);
      const int64_t h_kv = h / group;
      if (b * p.heads_kv + h_kv != loaded_head) {
        loaded_head = b * p.heads_kv + h_kv;
        if (share_heads) {
          products.use_tiles(shared_keys.get() + loaded_head * key_elems,
                             kWithOutput ? shared_values.get() + loaded_head * value_elems : nullptr);
        }
        std::fill(keys_loaded.begin(), keys_loaded.end(), 0);
      }
      const int64_t row0 = q_block * block_q;
      const int64_t rows = std::min(block_q, p.len_q - row0);

      const HeadScoreTerms<T, A> terms(p, params.mask_kind, params.mask, b, h);
      const HeadDropout<A> dropout(params.dropout, p, b, h);
      products.load_queries(params.q, b, h, row0, rows);
      std::fill(acc.begin(), acc.end(), A(0));
      std::fill(row_max.begin(), row_max.end(), kNegInf<A>);
      std::fill(row_sum.begin(), row_sum.end(), A(0));

      const int64_t key_end = vis.key_end(row0 + rows - 1);
      for (int64_t col0 = vis.key_begin(row0) / kBlockK * kBlockK; col0 < key_end; col0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, key_end - col0);
        const int64_t tile = keep_head ? col0 / kBlockK : 0;
        if (!share_heads && (!keep_head || keys_loaded[tile] < cols)) {
          products.load_keys(params.k, b, h_kv, col0, cols, tile);
          if constexpr (kWithOutput) products.load_values(params.v, b, h_kv, col0, cols, tile);
          keys_loaded[tile] = cols;
        }
        products.raw_scores(rows, cols, tile, score_tile);
        A* scores = score_tile.acc();
        // The scores scaled and adjusted, then each row's max; where adjust_scores
        // leaves the tile as it is (most tiles), scaled in the max's sweep.
        const A raw_scale = static_cast<A>(products.raw_scale());
        const bool adjusting = adjusts_scores(terms, vis, row0, rows, col0, cols);
        if (adjusting) {
          if (raw_scale != A(1)) scale_in_place(scores, rows * cols, raw_scale);
          adjust_scores(scores, rows, cols, terms, vis, row0, col0);
        }

        // Online softmax: fold this tile into the running max, sum and output.
        scale_max_rows(scores, rows, cols, adjusting ? A(1) : raw_scale, tile_max.data());
        for (int64_t r = 0; r < rows; ++r) {
          const A new_max = std::max(row_max[r], tile_max[r]);
          // A row with nothing visible yet keeps max -inf: subtract 0 (its
          // scores are all -inf, and exp gives 0) rather than -inf (NaN).
          max_used[r] = new_max == kNegInf<A> ? A(0) : new_max;
          rescale[r] = new_max == kNegInf<A> ? A(1) : std::exp(row_max[r] - new_max);  // 0 on the first visible tile
          row_max[r] = new_max;
        }
        // P rounded to 16 bits in the same sweep, straight where the products
        // take it, unless dropout is to change it first.
        constexpr bool kTakesRoundedProbs = kWithOutput && Products::kTakesRoundedProbs;
        const bool probs_rounded = kTakesRoundedProbs && !dropout.enabled;
        if constexpr (std::is_same_v<A, float>) {  // exp, less the max, and sum in one sweep of each row
          if (probs_rounded) {
            if constexpr (kTakesRoundedProbs) {  // (probs_rounded is false without)
              exp_shifted_sum_rows(scores, rows, cols, max_used.data(), products.rounded_probs(rows, cols),
                                   Products::probs_ld(cols), tile_sum.data());
            }
          } else {
            exp_shifted_sum_rows(scores, rows, cols, max_used.data(), tile_sum.data());
          }
          for (int64_t r = 0; r < rows; ++r) row_sum[r] = row_sum[r] * rescale[r] + tile_sum[r];
        } else {  // the scores less the row max, then one exp over the tile in G
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) scores[r * cols + c] -= max_used[r];
          }
          score_tile.exp_in_gemm_type(rows * cols);
          for (int64_t r = 0; r < rows; ++r) row_sum[r] = row_sum[r] * rescale[r] + sum_of(&scores[r * cols], cols);
        }
        // Dropout applies to the probabilities after the (undropped) row sum.
        if (dropout.enabled) {
          dropout.factors(row0, rows, col0, cols, drop_factors.data());
          for (int64_t i = 0; i < rows * cols; ++i) scores[i] *= drop_factors[i];
        }
        if constexpr (kWithOutput) {
          // o = o * rescale + P V, the product added to o in place (A is G here).
          static_assert(std::is_same_v<A, G>);
          for (int64_t r = 0; r < rows; ++r) {
            scale_in_place(&acc[r * acc_ld], p.head_dim_v, rescale[r]);
          }
          if (probs_rounded) {
            if constexpr (kTakesRoundedProbs) products.add_rounded_probs_times_values(rows, cols, tile, acc.data());
          } else {
            const G* probs = dropout.enabled ? score_tile.to_gemm(rows * cols) : score_tile.gemm();
            products.add_probs_times_values(rows, cols, tile, probs, acc.data());
          }
        }
      }

      L* lse = lse_all + (b * p.heads_q + h) * p.len_q + row0;
      for (int64_t r = 0; r < rows; ++r) {
        // A row that sees no key (len_k == 0, or bottom-right causal with
        // len_q > len_k) gets out = 0 and lse = -inf.
        const bool empty = row_sum[r] == A(0);
        const A inv_sum = empty ? A(0) : A(1) / row_sum[r];
        scale_in_place(&acc[r * acc_ld], p.head_dim_v, inv_sum);
        lse[r] = static_cast<L>(empty ? kNegInf<A> : row_max[r] + std::log(row_sum[r]));
      }
      if constexpr (kWithOutput) store_tile<T>(params.out, b, h, row0, rows, p.head_dim_v, acc.data(), acc_ld);
    }
    products.release();
  });
}

}  // namespace detail
}  // namespace flashattn_ext::cpu
