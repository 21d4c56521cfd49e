// Decoding (decode_attention: the new keys and values appended to the caches,
// paged or not, plain or FP8, then one task per query row over every key it sees) and
// dropout_mask (the keep decisions of dropout, drawn as the kernels draw them,
// by HeadDropout).
#include "cpu/flash_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/score_terms.h"
#include "cpu/tiles.h"
#include "cpu/vector_math.h"
#include "score_modifiers.h"

namespace flashattn_ext::cpu {

// The kernels' parts (tiles.h and the rest) live in detail.
using namespace detail;

namespace {

// Row j of head h of sequence b's cache (see DecodeParams).
template <typename C>
C* cache_row(const DecodeParams& params, const TensorView4d& cache, int64_t b, int64_t h, int64_t j) {
  int64_t outer = b, row = j;
  if (params.block_table.data != nullptr) {
    outer = params.block_table.at(b, j / params.block_size);
    row = j % params.block_size;
  }
  return static_cast<C*>(cache.data) + outer * cache.stride_batch + h * cache.stride_head + row * cache.stride_row;
}

// The caches' elements: the queries' own type, or float8 e4m3 times a scale
// (DecodeParams::k_scale), read and written through one interface.
template <typename T>
struct PlainCache {
  using Element = T;
  template <typename A>
  static A read(const T& x, A /*scale*/) {
    return static_cast<A>(x);
  }
  static T write(const T& x, float /*scale*/) { return x; }
};

struct Fp8Cache {
  using Element = c10::Float8_e4m3fn;
  static constexpr float kMax = 448.0f;  // e4m3's largest finite value
  template <typename A>
  static A read(const Element& x, A scale) {
    return static_cast<A>(static_cast<float>(x)) * scale;
  }
  // Round to nearest (even), saturating: as a CUDA cvt .satfinite, where
  // c10's conversion would make values past 480 NaN.
  template <typename T>
  static Element write(const T& x, float scale) {
    const float scaled = static_cast<float>(x) / scale;
    return Element(std::isnan(scaled) ? scaled : std::clamp(scaled, -kMax, kMax));
  }
};

// Head h's scale of the key (or value) cache: 1 for a plain cache.
inline float cache_scale(const DecodeParams& params, const float* scales, int64_t h) {
  return scales == nullptr ? 1.0f : scales[h * params.scale_stride_head];
}

// Writes key_new and value_new into the caches.
template <typename T, typename Cache>
void append_to_cache(const DecodeParams& params) {
  using C = typename Cache::Element;
  const AttentionProblem& p = params.problem;
  at::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.heads_kv, h = task % p.heads_kv;
      for (int64_t i = 0; i < params.len_new; ++i) {
        const int64_t j = params.cache_seqlens.at(0, b) + i;
        for (const auto& [src, dst, dim, scales] :
             {std::tuple{&params.k_new, &params.k_cache, p.head_dim, params.k_scale},
              std::tuple{&params.v_new, &params.v_cache, p.head_dim_v, params.v_scale}}) {
          const T* from = static_cast<const T*>(src->data) + b * src->stride_batch + h * src->stride_head +
                          i * src->stride_row;
          C* to = cache_row<C>(params, *dst, b, h, j);
          const float scale = cache_scale(params, scales, h);
          for (int64_t c = 0; c < dim; ++c) to[c * dst->stride_col] = Cache::write(from[c * src->stride_col], scale);
        }
      }
    }
  });
}

template <typename T, typename Cache>
void decode_with_cache(const DecodeParams& params) {
  using A = Acc<T>;
  using C = typename Cache::Element;
  const AttentionProblem& p = params.problem;
  if (params.len_new > 0) append_to_cache<T, Cache>(params);
  if (p.heads_kv == 0) return;  // then no query heads either
  const int64_t group = p.heads_q / p.heads_kv, dim = p.head_dim, dim_v = p.head_dim_v;
  const A scale = static_cast<A>(p.scale);
  const bool softcapped = p.softcap > 0.0;
  const Softcap<A> softcap = softcapped ? Softcap<A>(p, p.scale, kNaturalUnits) : Softcap<A>();
  auto tanh = [](A x) { return std::tanh(x); };
  auto* lse = static_cast<Lse<T>*>(params.lse);
  // One task per query row, over every key it sees: the scores of a row (up to
  // the capacity) in a buffer, then softmax and P V in two passes.
  at::parallel_for(0, p.batch * p.heads_q * p.len_q, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> q(dim), scores, acc(dim_v);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (p.heads_q * p.len_q), h = task / p.len_q % p.heads_q, i = task % p.len_q;
      // The sequence's own keys, with the causal mask and the window aligned
      // bottom-right (p.causal_lower_right): keys [key_begin, key_end).
      const Visibility vis(p, p.len_q, params.cache_seqlens.at(0, b) + params.len_new);
      const int64_t key_begin = vis.key_begin(i), key_end = std::max(vis.key_end(i), key_begin);
      const A slope = alibi_slope(p, b, h, A(kNaturalUnits));
      const A key_scale = cache_scale(params, params.k_scale, h / group);
      const A value_scale = cache_scale(params, params.v_scale, h / group);
      load_tile<T>(params.q, b, h, i, 1, dim, q.data());
      scores.resize(key_end - key_begin);
      A row_max = kNegInf<A>;
      for (int64_t j = key_begin; j < key_end; ++j) {
        const C* k = cache_row<C>(params, params.k_cache, b, h / group, j);
        A dot = 0;
        for (int64_t c = 0; c < dim; ++c) dot += q[c] * Cache::read(k[c * params.k_cache.stride_col], key_scale);
        A& score = scores[j - key_begin];
        score = (softcapped ? softcap.apply(dot, tanh) : dot * scale) +
                alibi_bias(slope, static_cast<A>(vis.distance(i, j)));
        row_max = std::max(row_max, score);
      }
      std::fill(acc.begin(), acc.end(), A(0));
      A row_sum = 0;
      for (int64_t j = key_begin; j < key_end; ++j) {
        const A weight = std::exp(scores[j - key_begin] - row_max);
        row_sum += weight;
        const C* v = cache_row<C>(params, params.v_cache, b, h / group, j);
        for (int64_t c = 0; c < dim_v; ++c) {
          acc[c] += weight * Cache::read(v[c * params.v_cache.stride_col], value_scale);
        }
      }
      // A row that sees no key gets out = 0 and lse = -inf, as in the attention ops.
      const bool seen = key_end > key_begin;
      for (A& value : acc) value = seen ? value / row_sum : A(0);
      store_tile<T>(params.out, b, h, i, 1, dim_v, acc.data());
      lse[task] = static_cast<Lse<T>>(seen ? row_max + std::log(row_sum) : kNegInf<A>);
    }
  });
}

}  // namespace

template <typename T>
void decode_attention(const DecodeParams& params) {
  if (params.k_scale != nullptr) {
    if constexpr (!std::is_same_v<T, double>) decode_with_cache<T, Fp8Cache>(params);  // (checked: no float64)
  } else {
    decode_with_cache<T, PlainCache<T>>(params);
  }
}

void dropout_mask(const DropoutMaskShape& shape, const DropoutParams& dropout, bool* mask) {
  const int64_t rows = shape.row_end - shape.row_begin;
  AttentionProblem p;
  p.heads_q = shape.heads;
  p.len_q = shape.len_q;
  p.len_k = shape.len_k;
  // A task for each 16 queries (as dropout's groups align them) of a head: whole groups, each drawn once.
  const int64_t first_block = shape.row_begin / 16, blocks = rows > 0 ? ceil_div(shape.row_end, 16) - first_block : 0;
  at::parallel_for(0, shape.batch * shape.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = first_block + task % blocks;
      const int64_t row0 = std::max(shape.row_begin, block * 16), row_end = std::min(shape.row_end, block * 16 + 16);
      const HeadDropout<double> head(dropout, p, bh / shape.heads, bh % shape.heads);
      head.fill_tile(row0, row_end - row0, 0, shape.len_k, /*kept=*/true, /*dropped=*/false,
                     mask + (bh * rows + row0 - shape.row_begin) * shape.len_k, shape.len_k);
    }
  });
}

#define FLASHATTN_EXT_INSTANTIATE(T) template void decode_attention<T>(const DecodeParams&);
FLASHATTN_EXT_CPU_FOR_EACH_TYPE(FLASHATTN_EXT_INSTANTIATE)
#undef FLASHATTN_EXT_INSTANTIATE

}  // namespace flashattn_ext::cpu
