// The backward: attention_backward and backward_tiles, which recompute each
// tile pair's P and dP (recompute_probabilities), sum the softmax-gradient
// correction delta, and accumulate dQ, dK and dV (score_gradient,
// raw_score_gradient, add_product); where the saved lse will not do, a forward
// pass without the output (forward_tiles, forward.h) makes one in the
// backward's accumulation type first.
#include "cpu/flash_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/forward.h"
#include "cpu/products.h"
#include "cpu/score_terms.h"
#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace flashattn_ext::cpu {

// The kernels' parts (tiles.h and the rest) live in detail.
using namespace detail;

namespace {

// For one (query tile, key tile) pair: recomputes P = exp(S - lse) into
// prob_tile and dP = dO V^T into dscore_tile (both halves of each); k_t and
// v_t hold the tile's keys and values as columns, rows ld_kv apart.
// Rows with lse = -inf see no key. With softcapping, softcap_grad receives the
// cap's derivative, for the caller to carry dS through it (see
// raw_score_gradient); terms: the head's score modifiers. With
// same_as_forward (the forward's products, holding the head's keys and these
// rows' queries), S comes from the products the forward's came from, to the
// same bits: P = exp(S - lse) is then as exact as with the float products (1
// where a row sees one key). With dout_values (such products holding the
// head's values as their keys and these rows' dO as their queries), dP comes
// from them: dO and V are in T already, so in T the product loses nothing.
template <typename T, typename A, typename G>
void recompute_probabilities(const G* q, const G* k_t, const G* v_t, int64_t ld_kv, const G* dout, const A* lse,
                             int64_t rows, int64_t cols, const AttentionProblem& p, const Visibility& vis,
                             const HeadScoreTerms<T, A>& terms, int64_t row0, int64_t col0,
                             DualTile<A, G>& prob_tile, DualTile<A, G>& dscore_tile, A* softcap_grad,
                             ReducedProducts<T>* same_as_forward, ReducedProducts<T>* dout_values) {
  if constexpr (kIs16Bit<T>) {
    if (same_as_forward != nullptr) {
      same_as_forward->scores(rows, cols, col0 / kBlockK, prob_tile);
      adjust_scores(prob_tile.acc(), rows, cols, terms, vis, row0, col0, softcap_grad);
    }
  }
  if (same_as_forward == nullptr) {
    compute_scores(q, k_t, ld_kv, rows, cols, p.head_dim, terms, vis, row0, col0, prob_tile, softcap_grad);
  }
  if constexpr (kIs16Bit<T>) {
    if (dout_values != nullptr) dout_values->raw_scores(rows, cols, col0 / kBlockK, dscore_tile);
  }
  if (dout_values == nullptr) {
    matmul(rows, cols, p.head_dim_v, dout, p.head_dim_v, v_t, ld_kv, dscore_tile.gemm(), cols);
    dscore_tile.from_gemm(rows * cols);
  }
  A* probs = prob_tile.acc();
  // P = exp(S - lse), one exp over the tile; a row that sees no key (lse -inf)
  // gets -inf, so P = 0 there.
  for (int64_t r = 0; r < rows; ++r) {
    A* s = probs + r * cols;
    if (lse[r] == kNegInf<A>) {
      std::fill(s, s + cols, kNegInf<A>);
    } else {
      for (int64_t c = 0; c < cols; ++c) s[c] -= lse[r];
    }
  }
  prob_tile.exp_in_gemm_type(rows * cols);
}

// dS = P * (Z * dP - delta) in place of dP (rows x cols), or into out where
// set, where Z is dropout's factor (factors, rows x cols; nullptr without
// dropout: 1); with dropped set, also P * Z there, the probabilities that the output used.
template <typename A>
void score_gradient(const A* probs, A* dscores, const A* delta, int64_t rows, int64_t cols, const A* factors,
                    A* dropped = nullptr, A* out = nullptr) {
  for (int64_t r = 0; r < rows; ++r) {
    A* ds = (out != nullptr ? out : dscores) + r * cols;
    const A* dp = dscores + r * cols;
    const A* prob = probs + r * cols;
    if (factors != nullptr) {
      const A* z = factors + r * cols;
      for (int64_t c = 0; c < cols; ++c) ds[c] = prob[c] * (dp[c] * z[c] - delta[r]);
      if (dropped != nullptr) {
        for (int64_t c = 0; c < cols; ++c) dropped[r * cols + c] = prob[c] * z[c];
      }
    } else {  // the loop the compiler vectorizes
      for (int64_t c = 0; c < cols; ++c) ds[c] = prob[c] * (dp[c] - delta[r]);
    }
  }
}

// n values of A as G for a product: the values themselves where the types
// agree, else rounded into scratch.
template <typename A, typename G>
const G* as_gemm(const A* x, int64_t n, G* scratch) {
  if constexpr (std::is_same_v<A, G>) {
    return x;
  } else {
    convert(x, n, scratch);
    return scratch;
  }
}

// dS *= scale, and with softcapping the cap's derivative: the gradient of the
// scaled scores, which dQ and dK are made from.
template <typename A>
void raw_score_gradient(A* dscores, const A* softcap_grad, int64_t n, A scale, bool softcapped) {
  if (softcapped) {
    for (int64_t i = 0; i < n; ++i) dscores[i] *= scale * softcap_grad[i];
  } else {
    for (int64_t i = 0; i < n; ++i) dscores[i] *= scale;
  }
}

// The elements of a query block's P (or dP) against all its keys.
int64_t kept_tile_elems(const AttentionProblem& p) { return ceil_div(p.len_k, kBlockK) * kBlockQ * kBlockK; }

// Whether the backward keeps each query block's P and dP between its two
// passes: where they fit in kCacheBytes a thread (two of the seven products
// and an exp saved a tile pair), and not with softcap, whose derivative the
// second pass would need too (dropout's decisions it keeps beside them, a
// byte a pair: see backward_tiles).
template <typename A>
bool backward_keeps_tiles(const AttentionProblem& p) {
  return p.softcap == 0.0 && 2 * kept_tile_elems(p) * int64_t{sizeof(A)} <= kCacheBytes;
}

// The backward: one task per (batch, key/value head) (or a share of one, see
// `splits`), which holds the head's K and V and accumulates its dK and dV whole
// (len_k rows each: a thread's buffers grow with len_k, as the inputs do, never
// with len_q x len_k), so that no two tasks write the same element (no atomics;
// the same bits on every run with the same thread count). For each query head
// of the group and each block of query rows: delta, then for every block of
// keys the rows see, P and dS recomputed, dV += (P Z)^T dO, dK += dS^T Q and
// dQ += dS K: seven tile products a (query block, key block) pair, five where
// the delta pass's P and dP are kept for the second (see `cached` below).
//
// delta[i] = rowsum(P_i * Z_i * dP_i), the softmax-gradient correction of each
// row (Z: dropout's factor, 1 without dropout), summed in a pass of its own. It
// equals rowsum(dO_i * O_i), but O is rounded to the input type, and that
// rounding, amplified where dP - delta cancels, made 16-bit gradients up to 6x
// and float32 ones (with float products) up to 3.6x less accurate than torch's,
// and left noise instead of 0 in the dq of a row that sees one key.
//
// With renormalize (float32 inputs, whose saved lse is float: |lse| units of
// float rounding, a factor common to a row's P), P is made with that lse and
// divided by its row sum before delta is summed from it: the P that an exact lse
// gives, without a pass to compute one. Only where the tiles are kept.
//
// With scores_as_forward (where the forward took ReducedProducts), S is
// recomputed by those products, and dP = dO V^T made by such products too
// (see recompute_probabilities).
template <typename T, typename A = Acc<T>, typename G = Gemm<T>>
void backward_tiles(const BwdParams& params, const A* lse_all, bool renormalize = false,
                    bool scores_as_forward = false) {
  const AttentionProblem& p = params.problem;
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t block_q = query_block_rows(p, kBlockQ);
  const int64_t q_blocks = ceil_div(p.len_q, block_q);
  const Visibility vis(p);
  const A scale = static_cast<A>(p.scale);
  const std::vector<A> zeros(kBlockQ, A(0));

  // With fewer (batch, key/value head) pairs than twice the threads, each pair's
  // (query head, query block) items are dealt round-robin (causal rows grow
  // longer down the blocks) to `splits` tasks, whose dK and dV partial sums are
  // added up afterwards.
  const int64_t pairs = p.batch * p.heads_kv, items = group * q_blocks;
  const int64_t splits = std::clamp<int64_t>(ceil_div(2 * at::get_num_threads(), std::max<int64_t>(pairs, 1)), 1,
                                             std::max<int64_t>(items, 1));
  const int64_t partial_size = key_tiles_size(p.len_k, dim + dim_v);  // a task's dK^T, then dV^T
  // A thread's P and dP of a query block against all its keys (see backward_keeps_tiles).
  const bool cached = backward_keeps_tiles<A>(p);
  TORCH_INTERNAL_ASSERT(cached || !renormalize, "renormalizing P needs the kept tiles");
  const int64_t cache_elems = cached ? kept_tile_elems(p) : 0;
  std::vector<A> partials(splits > 1 ? pairs * splits * partial_size : 0);

  // A pair's K as rows (for dQ) and as columns (for S), V as columns (for dP),
  // and where the scores are as the forward's, K and V packed for its products
  // (for S and dP). A task loads its pair's; where pairs are split, a pass of
  // their own loads each pair's once, a key tile an item, into memory that the
  // pair's tasks share (at 1 x 4 x 512 x 64 on 16 threads, each of the four
  // pairs would be loaded by 8 tasks).
  struct PairKeys {
    G *k, *k_t, *v_t;
  };
  // A pair's keys and values in pair_elems values from base: k, then k_t, then v_t.
  const int64_t k_elems = key_tiles_size(p.len_k, dim), pair_elems = 2 * k_elems + key_tiles_size(p.len_k, dim_v);
  auto pair_keys_at = [&](G* base) { return PairKeys{base, base + k_elems, base + 2 * k_elems}; };
  const int64_t key_tiles = ceil_div(p.len_k, kBlockK);
  const bool share_pairs = splits > 1;
  // (Not zeroed: the loads write every value that a product reads.)
  std::unique_ptr<G[]> shared_keys(share_pairs ? new G[pairs * pair_elems] : nullptr);
  auto shared_pair = [&](int64_t pair) { return pair_keys_at(shared_keys.get() + pair * pair_elems); };
  // The packed ones: ReducedProducts' keys (K for S, V for dP: see recompute_probabilities).
  using Packed = typename ReducedProducts<T>::Stored;
  std::optional<AttentionProblem> dout_problem;  // dP's products: V as their keys, dO as their queries
  if (scores_as_forward) {
    dout_problem = p;
    dout_problem->head_dim = dim_v;
  }
  const int64_t packed_k_elems = scores_as_forward ? ReducedProducts<T>::key_tiles_elems(p) : 0;
  const int64_t packed_v_elems = scores_as_forward ? ReducedProducts<T>::key_tiles_elems(*dout_problem) : 0;
  std::unique_ptr<Packed[]> shared_packed(share_pairs && scores_as_forward
                                              ? new Packed[pairs * (packed_k_elems + packed_v_elems)]
                                              : nullptr);
  auto packed_keys = [&](int64_t pair) { return shared_packed.get() + pair * (packed_k_elems + packed_v_elems); };
  auto packed_values = [&](int64_t pair) { return packed_keys(pair) + packed_k_elems; };
  // Tile `tile` of the pair's keys and values in each layout, into keys and, where the scores are as the
  // forward's, the products' own tiles.
  auto load_pair_tile = [&](int64_t pair, int64_t tile, const PairKeys& keys, ReducedProducts<T>* scores_products,
                            ReducedProducts<T>* dout_products) {
    const int64_t h_kv = pair % p.heads_kv, b = pair / p.heads_kv;
    const int64_t col0 = tile * kBlockK, cols = std::min(kBlockK, p.len_k - col0);
    if (scores_products != nullptr) {
      scores_products->load_keys(params.k, b, h_kv, col0, cols, tile);
      dout_products->load_keys(params.v, b, h_kv, col0, cols, tile);
    }
    load_tile<T>(params.k, b, h_kv, col0, cols, dim, keys.k + col0 * dim);
    load_key_tile_transposed<T>(params.k, b, h_kv, tile, p.len_k, dim, keys.k_t);
    load_key_tile_transposed<T>(params.v, b, h_kv, tile, p.len_k, dim_v, keys.v_t);
  };
  if (share_pairs) {
    at::parallel_for(0, pairs * key_tiles, 1, [&](int64_t begin, int64_t end) {
      std::optional<ReducedProducts<T>> scores_loader, dout_loader;
      if (scores_as_forward) {
        scores_loader.emplace(p, /*max_rows=*/0, /*kept_keys=*/0, /*with_values=*/false);
        dout_loader.emplace(*dout_problem, /*max_rows=*/0, /*kept_keys=*/0, /*with_values=*/false);
      }
      for (int64_t item = begin; item < end; ++item) {
        const int64_t pair = item / key_tiles;
        if (scores_as_forward) {
          scores_loader->use_tiles(packed_keys(pair), nullptr);
          dout_loader->use_tiles(packed_values(pair), nullptr);
        }
        load_pair_tile(pair, item % key_tiles, shared_pair(pair), scores_as_forward ? &*scores_loader : nullptr,
                       scores_as_forward ? &*dout_loader : nullptr);
      }
    });
  }

  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    // The pair's keys and values (see PairKeys), Q and dO as rows (for S and
    // dP) and as columns (for dK^T and dV^T).
    const int64_t own_keys = share_pairs ? 0 : p.len_k;
    std::vector<G> own_pair(share_pairs ? 0 : pair_elems), q(kBlockQ * dim),
        q_t(dim * kBlockQ), dout(kBlockQ * dim_v), dout_t(dim_v * kBlockQ),
        product(std::max(kBlockK, kBlockQ) * std::max(dim, dim_v));
    // dK and dV transposed, in key tiles (see key_tiles_size).
    std::vector<A> dk_t(key_tiles_size(p.len_k, dim)), dv_t(key_tiles_size(p.len_k, dim_v)),
        softcap_grad(p.softcap > 0.0 ? kBlockQ * kBlockK : 0), dq(kBlockQ * dim), delta(kBlockQ),
        row_norm(kBlockQ), drop_factors(params.dropout.p > 0.0 ? kBlockQ * kBlockK : 0);
    // P, dS, and P Z (with dropout: what the output used)
    DualTile<A, G> prob_tile(kBlockQ * kBlockK), dscore_tile(kBlockQ * kBlockK),
        dropped_tile(params.dropout.p > 0.0 ? kBlockQ * kBlockK : 0);
    std::vector<A> cache_p(cache_elems), cache_dp(cache_elems), row_product(kBlockK);
    // With dropout, which pairs the delta pass's draw kept (1) and dropped (0):
    // the second pass reads them instead of drawing again (a byte a pair, an
    // eighth of the float tiles above).
    std::vector<uint8_t> cache_keep(params.dropout.p > 0.0 ? cache_elems : 0);
    // And dP = dO V^T in the same products: V as their keys, dO as their queries (see recompute_probabilities).
    std::optional<ReducedProducts<T>> same_as_forward, dout_values;
    if (scores_as_forward) {
      same_as_forward.emplace(p, kBlockQ, own_keys, /*with_values=*/false);
      dout_values.emplace(*dout_problem, kBlockQ, own_keys, /*with_values=*/false);
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t split = task % splits, pair = task / splits;
      const int64_t h_kv = pair % p.heads_kv, b = pair / p.heads_kv;
      const PairKeys keys = share_pairs ? shared_pair(pair) : pair_keys_at(own_pair.data());
      if (share_pairs) {
        if (same_as_forward) {
          same_as_forward->use_tiles(packed_keys(pair), nullptr);
          dout_values->use_tiles(packed_values(pair), nullptr);
        }
      } else {
        for (int64_t tile = 0; tile < key_tiles; ++tile) {
          load_pair_tile(pair, tile, keys, same_as_forward ? &*same_as_forward : nullptr,
                         dout_values ? &*dout_values : nullptr);
        }
      }
      std::fill(dk_t.begin(), dk_t.end(), A(0));
      std::fill(dv_t.begin(), dv_t.end(), A(0));
      for (int64_t item = split; item < items; item += splits) {
        const int64_t h = h_kv * group + item / q_blocks, q_block = item % q_blocks;
        const HeadScoreTerms<T, A> terms(p, params.mask_kind, params.mask, b, h);
        const HeadDropout<A> dropout(params.dropout, p, b, h);
        const int64_t row0 = q_block * block_q;
        const int64_t rows = std::min(block_q, p.len_q - row0);
        const A* lse = lse_all + (b * p.heads_q + h) * p.len_q + row0;
        load_scaled_queries<T>(params.q, b, h, row0, rows, dim, p.scale, q.data());
        if (same_as_forward) {
          same_as_forward->load_queries(params.q, b, h, row0, rows);
          dout_values->load_queries(params.dout, b, h, row0, rows);
        }
        load_tile_transposed<T>(params.q, b, h, row0, rows, dim, q_t.data(), kBlockQ);
        load_tile<T>(params.dout, b, h, row0, rows, dim_v, dout.data());
        load_tile_transposed<T>(params.dout, b, h, row0, rows, dim_v, dout_t.data(), kBlockQ);
        const int64_t key_end = vis.key_end(row0 + rows - 1);
        // Calls tile(col0, cols) for each block of keys these rows see.
        auto for_each_key_tile = [&](auto&& tile) {
          for (int64_t col0 = vis.key_begin(row0) / kBlockK * kBlockK; col0 < key_end; col0 += kBlockK) {
            tile(col0, std::min(kBlockK, key_end - col0));
          }
        };
        // P and dP of one tile pair, recomputed into prob_tile and dscore_tile.
        auto recompute = [&](int64_t col0, int64_t cols) {
          recompute_probabilities(q.data(), keys.k_t + col0 * dim, keys.v_t + col0 * dim_v, kBlockK, dout.data(),
                                  lse, rows, cols, p, vis, terms, row0, col0, prob_tile, dscore_tile,
                                  softcap_grad.data(), same_as_forward ? &*same_as_forward : nullptr,
                                  dout_values ? &*dout_values : nullptr);
        };
        // Where the tiles' P and dP fit, the delta pass keeps them (tile t at
        // t * kBlockQ * kBlockK) for the second pass instead of its recomputing them.
        auto cached_tile = [&](auto& cache, int64_t col0) {
          return cache.data() + (col0 - vis.key_begin(row0) / kBlockK * kBlockK) / kBlockK * (kBlockQ * kBlockK);
        };

        // Dropout's factors of a tile, into drop_factors; nullptr without
        // dropout. The delta pass draws them; where the tiles are kept, it
        // keeps its decisions for the second pass (second), which otherwise
        // draws again.
        auto tile_factors = [&](int64_t col0, int64_t cols, bool second) -> const A* {
          if (!dropout.enabled) return nullptr;
          if (!cached) {
            dropout.factors(row0, rows, col0, cols, drop_factors.data());
            return drop_factors.data();
          }
          uint8_t* keep = cached_tile(cache_keep, col0);
          if (!second) dropout.fill_tile(row0, rows, col0, cols, uint8_t{1}, uint8_t{0}, keep, cols);
          for (int64_t i = 0; i < rows * cols; ++i) drop_factors[i] = keep[i] != 0 ? dropout.keep_scale : A(0);
          return drop_factors.data();
        };

        // delta = rowsum(P * Z * dP): dS with a zero delta, summed, a row at a
        // time beside dP; from the kept tiles once all are made, where they are
        // kept (and P renormalized, where asked).
        std::fill(delta.begin(), delta.end(), A(0));
        auto add_to_delta = [&](const A* probs, A* dscores, int64_t col0, int64_t cols) {
          const A* factors = tile_factors(col0, cols, /*second=*/false);
          for (int64_t r = 0; r < rows; ++r) {
            score_gradient(probs + r * cols, dscores + r * cols, zeros.data(), 1, cols,
                           factors != nullptr ? factors + r * cols : nullptr,
                           /*dropped=*/static_cast<A*>(nullptr), row_product.data());
            delta[r] += sum_of(row_product.data(), cols);
          }
        };
        std::fill(row_norm.begin(), row_norm.end(), A(0));
        for_each_key_tile([&](int64_t col0, int64_t cols) {
          if (cached) {
            prob_tile.place_acc(cached_tile(cache_p, col0));
            dscore_tile.place_acc(cached_tile(cache_dp, col0));
          }
          recompute(col0, cols);
          if (!cached) {
            add_to_delta(prob_tile.acc(), dscore_tile.acc(), col0, cols);
          } else if (renormalize) {
            for (int64_t r = 0; r < rows; ++r) row_norm[r] += sum_of(prob_tile.acc() + r * cols, cols);
          }
        });
        prob_tile.place_acc(nullptr);
        dscore_tile.place_acc(nullptr);
        if (cached) {
          for_each_key_tile([&](int64_t col0, int64_t cols) {
            A* probs = cached_tile(cache_p, col0);
            if (renormalize) {
              for (int64_t r = 0; r < rows; ++r) {
                // Divided, not times 1 / sum: a row that sees one key gets P = 1
                // exactly (its exact zeros). A row that sees none keeps P = 0.
                const A norm = row_norm[r] > A(0) ? row_norm[r] : A(1);
                for (int64_t c = 0; c < cols; ++c) probs[r * cols + c] /= norm;
              }
            }
            add_to_delta(probs, cached_tile(cache_dp, col0), col0, cols);
          });
        }

        std::fill(dq.begin(), dq.end(), A(0));
        for_each_key_tile([&](int64_t col0, int64_t cols) {
          // P (as A, and as G for dV's product), dP then dS in place.
          const A* probs;
          const G* used;  // P Z, what the output used
          A* dscores;
          if (cached) {
            probs = cached_tile(cache_p, col0);
            used = as_gemm(probs, rows * cols, prob_tile.gemm());
            dscores = cached_tile(cache_dp, col0);
          } else {
            recompute(col0, cols);
            probs = prob_tile.acc();
            used = prob_tile.gemm();
            dscores = dscore_tile.acc();
          }
          A* dropped = dropout.enabled ? dropped_tile.acc() : nullptr;
          score_gradient(probs, dscores, delta.data(), rows, cols, tile_factors(col0, cols, /*second=*/true), dropped);
          if (dropout.enabled) used = dropped_tile.to_gemm(rows * cols);
          // An additive mask enters the scores as is: its gradient is dS. Each
          // (query, key) pair is visited once; pairs skipped keep their zero.
          if (params.dmask.data != nullptr) {
            T* dmask =
                static_cast<T*>(params.dmask.data) + b * params.dmask.stride_batch + h * params.dmask.stride_head;
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = 0; c < cols; ++c) {
                dmask[(row0 + r) * params.dmask.stride_row + (col0 + c) * params.dmask.stride_col] =
                    static_cast<T>(dscores[r * cols + c]);
              }
            }
          }
          raw_score_gradient(dscores, softcap_grad.data(), rows * cols, scale, p.softcap > 0.0);
          const G* dscores_g = as_gemm(dscores, rows * cols, dscore_tile.gemm());
          // dV^T += dO^T (P Z), dK^T += Q^T dS, dQ += dS K.
          add_product(dim_v, cols, rows, dout_t.data(), kBlockQ, used, cols, dv_t.data() + col0 * dim_v, kBlockK,
                      product.data());
          add_product(dim, cols, rows, q_t.data(), kBlockQ, dscores_g, cols, dk_t.data() + col0 * dim, kBlockK,
                      product.data());
          add_product(rows, dim, cols, dscores_g, cols, keys.k + col0 * dim, dim, dq.data(), dim, product.data());
        });
        store_tile<T>(params.dq, b, h, row0, rows, dim, dq.data());
      }
      if (splits == 1) {
        store_key_tiles_transposed<T>(params.dk, b, h_kv, p.len_k, dim, dk_t.data());
        store_key_tiles_transposed<T>(params.dv, b, h_kv, p.len_k, dim_v, dv_t.data());
      } else {
        A* partial = partials.data() + task * partial_size;
        std::copy(dk_t.begin(), dk_t.end(), partial);
        std::copy(dv_t.begin(), dv_t.end(), partial + dk_t.size());
      }
    }
    if (same_as_forward) {
      same_as_forward->release();
      dout_values->release();
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> sum(partial_size);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t h_kv = pair % p.heads_kv, b = pair / p.heads_kv;
      std::fill(sum.begin(), sum.end(), A(0));
      for (int64_t split = 0; split < splits; ++split) {
        const A* partial = partials.data() + (pair * splits + split) * partial_size;
        for (int64_t i = 0; i < partial_size; ++i) sum[i] += partial[i];
      }
      store_key_tiles_transposed<T>(params.dk, b, h_kv, p.len_k, dim, sum.data());
      store_key_tiles_transposed<T>(params.dv, b, h_kv, p.len_k, dim_v, sum.data() + key_tiles_size(p.len_k, dim));
    }
  });
}

}  // namespace

template <typename T>
void attention_backward(const BwdParams& params) {
  using A = Acc<T>;
  const AttentionProblem& p = params.problem;
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (p.heads_kv == 0) return;  // no heads: nothing to compute
  if constexpr (std::is_same_v<Lse<T>, A>) {
    backward_tiles<T>(params, static_cast<const A*>(params.lse), /*renormalize=*/false,
                      /*scores_as_forward=*/takes_reduced_products<T>());
  } else if (params.sinks == nullptr && backward_keeps_tiles<float>(p)) {
    // float32 where the tiles are kept: all in float, as torch's backward runs. The saved lse's
    // rounding is a factor common to a row's P, which renormalizing removes (see backward_tiles).
    backward_tiles<T, float>(params, static_cast<const float*>(params.lse), /*renormalize=*/true);
  } else {
    // Otherwise P = exp(S - lse) with lse computed again in A (see Acc), the forward's sinks merged
    // in (renormalizing, the path above would drop them).
    std::vector<A> lse(rows);
    FwdParams lse_pass;
    lse_pass.problem = p;
    lse_pass.q = params.q;
    lse_pass.k = params.k;
    lse_pass.mask_kind = params.mask_kind;
    lse_pass.mask = params.mask;
    forward_tiles<T, /*kWithOutput=*/false>(lse_pass, lse.data());
    if (params.sinks != nullptr) {  // (rows ordered (batch, head, query), as the op's lse)
      for (int64_t row = 0; row < rows; ++row) {
        const A sink = static_cast<A>(params.sinks[row / p.len_q % p.heads_q]), high = std::max(lse[row], sink);
        if (high != kNegInf<A>) lse[row] = high + std::log(std::exp(lse[row] - high) + std::exp(sink - high));
      }
    }
    backward_tiles<T>(params, lse.data());
  }
}

#define FLASHATTN_EXT_INSTANTIATE(T) template void attention_backward<T>(const BwdParams&);
FLASHATTN_EXT_CPU_FOR_EACH_TYPE(FLASHATTN_EXT_INSTANTIATE)
#undef FLASHATTN_EXT_INSTANTIATE

}  // namespace flashattn_ext::cpu
