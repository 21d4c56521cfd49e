// The forward's two tile products, QK^T and PV, as policies that forward_tiles
// takes: ConvertedProducts (in float, or double for double, on tiles converted
// on load) and ReducedProducts (in the 16-bit input type, summed in float,
// through oneDNN's VNNI kernels where the CPU has them: AMX), which the
// backward also uses to recompute the scores as the forward made them; and
// takes_reduced_products, the choice between the two
// (FLASHATTN_EXT_CPU_REDUCED_GEMM, else the CPU).
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/tiles.h"
#include "flash_params.h"

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

// The forward's two tile products, QK^T and PV, for forward_tiles: a policy
// that holds a thread's query tile (up to max_rows rows) and a head's key and
// value tiles (kept_keys keys, in key tiles of kBlockK: tile t holds keys t *
// kBlockK on, loaded by load_keys and load_values), and the scores of the
// query tile against a key tile (raw_scores: short of the factor raw_scale(),
// 1 where they come out scaled), and adds P V to the output's accumulator,
// whose rows lie acc_ld() apart: P in float, or (kTakesRoundedProbs) rounded
// to 16 bits into rounded_probs(rows, cols) by the softmax's own sweep. The
// key and value tiles are the policy's own, or (use_tiles) a head's in memory
// that threads share: key_tiles_elems and value_tiles_elems Stored values
// each for a whole head.

// In G (float, or double for double) on tiles converted on load: the queries
// times the softmax scale (see load_scaled_queries), the keys transposed.
template <typename T, typename G>
class ConvertedProducts {
 public:
  using Stored = G;
  static constexpr int64_t kMaxRows = kBlockQ;

  ConvertedProducts(const AttentionProblem& p, int64_t max_rows, int64_t kept_keys)
      : dim_(p.head_dim),
        dim_v_(p.head_dim_v),
        scale_(p.scale),
        q_(max_rows * dim_),
        own_k_t_(key_tiles_size(kept_keys, dim_)),
        own_v_(key_tiles_size(kept_keys, dim_v_)),
        k_t_(own_k_t_.data()),
        v_(own_v_.data()) {}

  static int64_t key_tiles_elems(const AttentionProblem& p) { return key_tiles_size(p.len_k, p.head_dim); }
  static int64_t value_tiles_elems(const AttentionProblem& p) { return key_tiles_size(p.len_k, p.head_dim_v); }
  static int64_t head_bytes(const AttentionProblem& p) {
    return (key_tiles_elems(p) + value_tiles_elems(p)) * int64_t{sizeof(Stored)};
  }
  void use_tiles(Stored* keys, Stored* values) {
    k_t_ = keys;
    v_ = values;
  }
  int64_t acc_ld() const { return dim_v_; }

  void load_queries(const TensorView4d& q, int64_t b, int64_t h, int64_t row0, int64_t rows) {
    load_scaled_queries<T>(q, b, h, row0, rows, dim_, scale_, q_.data());
  }
  void load_keys(const TensorView4d& k, int64_t b, int64_t h, int64_t col0, int64_t cols, int64_t tile) {
    load_tile_transposed<T>(k, b, h, col0, cols, dim_, k_t_ + tile * kBlockK * dim_, kBlockK);
  }
  void load_values(const TensorView4d& v, int64_t b, int64_t h, int64_t col0, int64_t cols, int64_t tile) {
    load_tile<T>(v, b, h, col0, cols, dim_v_, v_ + tile * kBlockK * dim_v_);
  }

  static constexpr bool kTakesRoundedProbs = false;

  // The scores of the query tile's rows against the tile's cols keys, into
  // score_tile.acc(), scaled already (by the queries).
  float raw_scale() const { return 1.f; }
  template <typename A>
  void raw_scores(int64_t rows, int64_t cols, int64_t tile, DualTile<A, G>& score_tile) {
    matmul(rows, cols, dim_, q_.data(), dim_, k_t_ + tile * kBlockK * dim_, kBlockK, score_tile.gemm(), cols);
    score_tile.from_gemm(rows * cols);
  }

  // acc += P V, P (rows x cols) dense. matmul sums the tile's share apart before
  // adding it: blockwise summation keeps the rounding error of long float32 sums down.
  void add_probs_times_values(int64_t rows, int64_t cols, int64_t tile, const G* probs, G* acc) {
    matmul(rows, dim_v_, cols, probs, cols, v_ + tile * kBlockK * dim_v_, dim_v_, acc, dim_v_,
           /*accumulate=*/true);
  }

  void release() {}

 private:
  int64_t dim_, dim_v_;
  double scale_;
  std::vector<G> q_, own_k_t_, own_v_;
  G *k_t_, *v_;
};

template <typename T>
inline constexpr bool kIs16Bit = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// FLASHATTN_EXT_CPU_REDUCED_GEMM (read once): 1 makes the 16-bit forward take
// ReducedProducts on every CPU, unpacked where oneDNN has no VNNI kernels for
// the type (brgemm then falls back to torch's gemm), for testing that path on
// CPUs without AMX; 0 keeps the float products everywhere, for comparisons;
// unset (or anything else), the CPU decides.
enum class ReducedProductsSetting { kAuto, kOn, kOff };
inline ReducedProductsSetting reduced_products_setting() {
  static const ReducedProductsSetting setting = [] {
    const char* value = std::getenv("FLASHATTN_EXT_CPU_REDUCED_GEMM");
    if (value != nullptr && std::strcmp(value, "1") == 0) return ReducedProductsSetting::kOn;
    if (value != nullptr && std::strcmp(value, "0") == 0) return ReducedProductsSetting::kOff;
    return ReducedProductsSetting::kAuto;
  }();
  return setting;
}

// The reduced products' right factors (keys transposed, values) lie in blocks
// of kPackedCols columns, the widest that oneDNN's VNNI packing writes, their
// rows (the sum's dimension) padded to even (VNNI interleaves row pairs); zeros
// fill both pads, and the products' padded columns are dropped.
inline constexpr int64_t kPackedCols = 64;

inline int64_t round_up(int64_t n, int64_t multiple) { return ceil_div(n, multiple) * multiple; }

// n values of R (a 16-bit float type), zeroed: std::vector<R>(n) zeroes them a
// value at a time (about 1 ns each: 60 us of a thread's start in a small
// bfloat16 forward, 150 us on 16 threads), memset at a thirtieth of that.
template <typename R>
class ZeroedBuffer {
  static_assert(std::is_trivially_default_constructible_v<R>, "new R[n] must leave the values to memset");

 public:
  explicit ZeroedBuffer(int64_t n) : data_(new R[n]) { std::memset(data_.get(), 0, n * sizeof(R)); }
  R* data() { return data_.get(); }
  R& operator[](int64_t i) { return data_[i]; }

 private:
  std::unique_ptr<R[]> data_;
};

// In the 16-bit input type R, summed in float, as torch's CPU kernel runs them
// where the CPU has AMX (about 2.5x the speed of the float products there): the
// right factors packed into oneDNN's VNNI layout where it has kernels for R
// (cpublas::could_pack), else as they are. The queries are loaded unscaled
// (scaled, they would be rounded to R again) and the float scores scaled; P is
// rounded to R for P V, as torch does.
template <typename R>
class ReducedProducts {
 public:
  // (Without values: for the backward's scores alone.)
  ReducedProducts(const AttentionProblem& p, int64_t max_rows, int64_t kept_keys, bool with_values = true)
      : dim_(p.head_dim),
        padded_dim_(round_up(dim_, 2)),
        dim_v_(p.head_dim_v),
        padded_dim_v_(round_up(dim_v_, kPackedCols)),
        scale_(static_cast<float>(p.scale)),
        vnni_(vnni_kernels()),
        q_(max_rows * padded_dim_),
        own_keys_(key_tiles_size(kept_keys, padded_dim_)),
        own_values_(with_values ? key_tiles_size(kept_keys, padded_dim_v_) : 0),
        probs_(max_rows * kBlockK),
        block_(std::max(padded_dim_, kBlockK) * kPackedCols),
        keys_(own_keys_.data()),
        values_(own_values_.data()) {}

  using Stored = R;
  // Query rows per forward task, at most: the AMX products are brgemm calls of
  // 64 keys or value columns each, and taller tiles spread a call's cost
  // (4 x 16 x 2048 x 64 bf16 on 16 threads: the products' thread time about
  // a tenth less than at 128 rows). The float products, 2 to 3 times slower,
  // keep 128 (256 took a tenth longer on AVX2).
  static constexpr int64_t kMaxRows = 2 * kBlockQ;

  // Whether oneDNN has VNNI kernels for R on this CPU (AMX: bfloat16 since Sapphire Rapids, float16 since Granite Rapids).
  static bool vnni_kernels() { return at::native::cpublas::could_pack(c10::CppTypeToScalarType<R>::value); }
  static int64_t key_tiles_elems(const AttentionProblem& p) { return key_tiles_size(p.len_k, round_up(p.head_dim, 2)); }
  static int64_t value_tiles_elems(const AttentionProblem& p) {
    return key_tiles_size(p.len_k, round_up(p.head_dim_v, kPackedCols));
  }
  static int64_t head_bytes(const AttentionProblem& p) {
    return (key_tiles_elems(p) + value_tiles_elems(p)) * int64_t{sizeof(Stored)};
  }
  void use_tiles(Stored* keys, Stored* values) {
    keys_ = keys;
    values_ = values;
  }
  int64_t acc_ld() const { return padded_dim_v_; }

  // (The pad column, where there is one, keeps the zeros q_ starts with.)
  void load_queries(const TensorView4d& q, int64_t b, int64_t h, int64_t row0, int64_t rows) {
    load_tile<R>(q, b, h, row0, rows, dim_, q_.data(), padded_dim_);
  }

  // The tile's keys transposed, a padded_dim_ x kPackedCols block for each kPackedCols keys.
  void load_keys(const TensorView4d& k, int64_t b, int64_t h, int64_t col0, int64_t cols, int64_t tile) {
    for (int64_t key0 = 0; key0 < cols; key0 += kPackedCols) {
      R* block = start_block(padded_dim_, key_block(tile, key0));
      load_tile_transposed<R>(k, b, h, col0 + key0, std::min(kPackedCols, cols - key0), dim_, block, kPackedCols);
      finish_block(padded_dim_, key_block(tile, key0));
    }
  }

  // The tile's values, a rows x kPackedCols block for each kPackedCols value
  // columns, rows = cols rounded up to even.
  void load_values(const TensorView4d& v, int64_t b, int64_t h, int64_t col0, int64_t cols, int64_t tile) {
    for (int64_t c0 = 0; c0 < dim_v_; c0 += kPackedCols) {
      TensorView4d columns = v;
      columns.data = static_cast<R*>(v.data) + c0 * v.stride_col;
      R* block = start_block(round_up(cols, 2), value_block(tile, c0));
      load_tile<R>(columns, b, h, col0, cols, std::min(kPackedCols, dim_v_ - c0), block, kPackedCols);
      finish_block(round_up(cols, 2), value_block(tile, c0));
    }
  }

  static constexpr bool kTakesRoundedProbs = true;

  // The scores unscaled (the forward scales them in its sweep for the row max), and scaled.
  float raw_scale() const { return scale_; }
  void raw_scores(int64_t rows, int64_t cols, int64_t tile, DualTile<float, float>& score_tile) {
    // Each block's kPackedCols columns, rows ld apart; then the rows moved
    // together (down, in order: no row overwrites one still to move).
    const int64_t ld = round_up(cols, kPackedCols);
    float* scores = score_tile.acc();
    for (int64_t key0 = 0; key0 < cols; key0 += kPackedCols) {
      at::native::cpublas::brgemm(rows, kPackedCols, padded_dim_, padded_dim_, kPackedCols, ld, /*add_C=*/false,
                                  q_.data(), key_block(tile, key0), scores + key0, vnni_);
    }
    if (ld != cols) {
      for (int64_t r = 1; r < rows; ++r) std::memmove(scores + r * cols, scores + r * ld, cols * sizeof(float));
    }
  }
  void scores(int64_t rows, int64_t cols, int64_t tile, DualTile<float, float>& score_tile) {
    raw_scores(rows, cols, tile, score_tile);
    scale_in_place(score_tile.acc(), rows * cols, scale_);
  }

  // Where P goes, rounded to R, for a tile of rows x cols keys, its rows
  // probs_ld(cols) apart (padded to even with a zero, see load_values).
  static int64_t probs_ld(int64_t cols) { return round_up(cols, 2); }
  R* rounded_probs(int64_t rows, int64_t cols) {
    const int64_t ld = probs_ld(cols);
    if (ld != cols) {
      for (int64_t r = 0; r < rows; ++r) probs_[r * ld + cols] = R(0);
    }
    return probs_.data();
  }

  // acc += P V, P in float (rows x cols, dense), or already rounded into rounded_probs.
  void add_probs_times_values(int64_t rows, int64_t cols, int64_t tile, const float* probs, float* acc) {
    R* rounded = rounded_probs(rows, cols);
    for (int64_t r = 0; r < rows; ++r) convert(probs + r * cols, cols, rounded + r * probs_ld(cols));
    add_rounded_probs_times_values(rows, cols, tile, acc);
  }
  void add_rounded_probs_times_values(int64_t rows, int64_t cols, int64_t tile, float* acc) {
    const int64_t ld = probs_ld(cols);
    for (int64_t c0 = 0; c0 < dim_v_; c0 += kPackedCols) {
      at::native::cpublas::brgemm(rows, kPackedCols, ld, ld, kPackedCols, padded_dim_v_, /*add_C=*/true,
                                  probs_.data(), value_block(tile, c0), acc + c0, vnni_);
    }
  }

  // Hands back the AMX state brgemm set up for this thread.
  void release() { at::native::cpublas::brgemm_release(vnni_); }

 private:
  R* key_block(int64_t tile, int64_t key0) { return keys_ + (tile * kBlockK + key0) * padded_dim_; }
  R* value_block(int64_t tile, int64_t c0) { return values_ + (tile * padded_dim_v_ + c0) * kBlockK; }

  // A block of rows x kPackedCols to load, zeroed (its pads stay zero): the
  // destination itself, or scratch where it is packed.
  R* start_block(int64_t rows, R* destination) {
    R* block = vnni_ ? block_.data() : destination;
    std::memset(block, 0, rows * kPackedCols * sizeof(R));  // (zero bits: +0)
    return block;
  }
  // The block's rows packed into the destination, where the VNNI kernels read it.
  void finish_block(int64_t rows, R* destination) {
    if (!vnni_) return;
    const at::ScalarType type = c10::CppTypeToScalarType<R>::value;
    at::native::cpublas::pack(rows, kPackedCols, kPackedCols, kPackedCols, type, type, block_.data(), destination);
  }

  int64_t dim_, padded_dim_, dim_v_, padded_dim_v_;
  float scale_;
  bool vnni_;
  ZeroedBuffer<R> q_, own_keys_, own_values_, probs_, block_;
  R *keys_, *values_;
};

// Whether the forward of T takes ReducedProducts (and the backward its scores the same way).
template <typename T>
bool takes_reduced_products() {
  if constexpr (kIs16Bit<T>) {
    switch (reduced_products_setting()) {
      case ReducedProductsSetting::kOn: return true;
      case ReducedProductsSetting::kOff: return false;
      default: return ReducedProducts<T>::vnni_kernels();
    }
  } else {
    return false;
  }
}

}  // namespace detail
}  // namespace flashattn_ext::cpu
