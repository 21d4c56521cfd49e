// FlashAttention on the CPU: the same tiling as the GPU kernels, one task per
// (batch, head, block of rows), tiles converted to the accumulation type on load.
// No buffer grows with len_q x len_k: every task owns a few tile-sized buffers.
//
// This file: the tiling (block sizes, the accumulation, product and lse types),
// the tiles' loads and stores in each layout the products read, the tile
// product (matmul, brgemm for float), and DualTile, a tile held in the
// accumulation type and the product type at once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/vector_math.h"
#include "flash_params.h"

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

inline constexpr int64_t kBlockQ = 128;  // query rows per task, at most (see query_block_rows; but see ReducedProducts)
inline constexpr int64_t kBlockK = 128;  // keys per streamed tile
// Per thread: the backward's P and dP of a query block, kept between its two passes where they fit.
inline constexpr int64_t kCacheBytes = int64_t{32} << 20;
// Per thread: the forward's keys and values of a head, loaded once for all its query blocks where they fit
// (else one tile at a time: long sequences keep the forward's memory independent of their length).
inline constexpr int64_t kHeadKeysBytes = int64_t{16} << 20;

// The backward's softmax and every sum run in Acc: float for 16-bit types,
// double for float and double (the forward's: see forward_tiles). (In float
// the backward's P = exp(S - lse) carried |lse| units of rounding: float32
// gradients came out up to 3x less accurate than torch's math backend.) The
// float32 backward that keeps its tiles runs in float, its P renormalized
// instead (see attention_backward).
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double> || std::is_same_v<T, float>, double, float>;

// The tile products run in Gemm: double for double, else float. float32 inputs
// are exact in float and their products as accurate as torch's (which computes
// them in float too), at twice the speed of double; their operands made in the
// softmax (P, dS) are rounded to float for them, and their results summed in Acc.
template <typename T>
using Gemm = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The type of the saved log-sum-exp (the op's lse output): float, or double for double.
template <typename T>
using Lse = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Query rows per block: max_rows, halved (to 32 at least) while the (batch,
// query head, block) items would number fewer than four a thread: at small
// shapes smaller blocks keep every thread busy, and shorten the longest task
// (causal blocks grow longer down the rows).
inline int64_t query_block_rows(const AttentionProblem& p, int64_t max_rows) {
  const int64_t wanted = 4 * int64_t{at::get_num_threads()};
  int64_t rows = max_rows;
  while (rows > 32 && p.batch * p.heads_q * ceil_div(p.len_q, rows) < wanted) rows /= 2;
  return rows;
}

// Copies rows [row0, row0 + rows) of head (b, h) into a rows x cols tile whose
// rows lie ld apart (dense by default).
template <typename T, typename A>
void load_tile(const TensorView4d& t, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t cols,
               A* tile, std::optional<int64_t> ld = std::nullopt) {
  const T* base = static_cast<const T*>(t.data) + b * t.stride_batch + h * t.stride_head;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = base + (row0 + r) * t.stride_row;
    A* dst = tile + r * ld.value_or(cols);
    if (t.stride_col == 1 && std::is_same_v<T, A>) {
      std::memcpy(dst, src, cols * sizeof(A));
    } else if (t.stride_col == 1) {  // the usual case, in its own loop: vector code
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<A>(src[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<A>(src[c * t.stride_col]);
    }
  }
}

// The same rows transposed: tile[c * ld + r] = row r's value c (a cols x rows
// tile, rows ld apart), for the products that read them as their right factor.
template <typename T, typename A>
void load_tile_transposed(const TensorView4d& t, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t cols,
                          A* tile, int64_t ld) {
  const T* base = static_cast<const T*>(t.data) + b * t.stride_batch + h * t.stride_head;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = base + (row0 + r) * t.stride_row;
    for (int64_t c = 0; c < cols; ++c) tile[c * ld + r] = static_cast<A>(src[c * t.stride_col]);
  }
}

template <typename T, typename A>
void store_tile(const TensorView4d& t, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t cols,
                const A* tile, std::optional<int64_t> ld = std::nullopt) {
  T* base = static_cast<T*>(t.data) + b * t.stride_batch + h * t.stride_head;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = base + (row0 + r) * t.stride_row;
    const A* src = tile + r * ld.value_or(cols);
    if (t.stride_col == 1) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<T>(src[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c * t.stride_col] = static_cast<T>(src[c]);
    }
  }
}

// Query rows as load_tile loads them, times the softmax scale: the scores come
// out of their product scaled, without a pass over every score tile.
template <typename T, typename G>
void load_scaled_queries(const TensorView4d& q, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t dim,
                         double scale, G* tile) {
  load_tile<T>(q, b, h, row0, rows, dim, tile);
  scale_in_place(tile, rows * dim, static_cast<G>(scale));
}

// A head's keys and values (the backward's, and the forward's where they fit),
// and the backward's dK and dV sums, lie transposed in tiles of kBlockK keys:
// tile t (keys t * kBlockK on) is a dense cols x kBlockK block at t * cols *
// kBlockK, so that a product reads or adds to a compact block (columns of one
// len_k-wide matrix lay len_k apart, at power-of-two lengths all in the same
// few cache sets).
inline int64_t key_tiles_size(int64_t len, int64_t cols) { return ceil_div(len, kBlockK) * kBlockK * cols; }

// Tile `tile` of a head's len rows, into its place among the tiles.
template <typename T, typename A>
void load_key_tile_transposed(const TensorView4d& t, int64_t b, int64_t h, int64_t tile, int64_t len, int64_t cols,
                              A* tiles) {
  const int64_t row0 = tile * kBlockK;
  load_tile_transposed<T>(t, b, h, row0, std::min(kBlockK, len - row0), cols, tiles + row0 * cols, kBlockK);
}

template <typename T, typename A>
void store_key_tiles_transposed(const TensorView4d& t, int64_t b, int64_t h, int64_t len, int64_t cols,
                                const A* tiles) {
  T* base = static_cast<T*>(t.data) + b * t.stride_batch + h * t.stride_head;
  for (int64_t r = 0; r < len; ++r) {
    T* dst = base + r * t.stride_row;
    const A* src = tiles + r / kBlockK * kBlockK * cols + r % kBlockK;
    for (int64_t c = 0; c < cols; ++c) dst[c * t.stride_col] = static_cast<T>(src[c * kBlockK]);
  }
}

// c (m x n) = a (m x k) b (k x n), or c += a b where accumulate, for row-major
// tiles whose rows lie lda, ldb and ldc apart. float through ATen's CPU
// batch-reduce GEMM on the raw pointers (oneDNN's JIT kernels where the CPU has
// AVX2, else torch's BLAS): no tensors, no dispatch, and no packing of
// transposed operands (the tiles are loaded in the layout each product reads):
// a third less time than at::mm on 128 x 128 x 64 tiles, 40% less on 64-row
// ones. double through at::mm on strided views. The sum of a product is formed
// apart before c is added: blockwise summation, which keeps long float sums accurate.
inline void matmul(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                   int64_t ldc, bool accumulate = false) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c);
}

inline void matmul(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb,
                   double* c, int64_t ldc, bool accumulate = false) {
  const auto options = at::TensorOptions().dtype(at::kDouble);
  auto matrix = [&](const double* data, int64_t rows, int64_t cols, int64_t ld) {
    return at::from_blob(const_cast<double*>(data), {rows, cols}, {ld, 1}, options);
  };
  at::Tensor out = matrix(c, m, n, ldc);
  if (accumulate) {
    out.addmm_(matrix(a, m, k, lda), matrix(b, k, n, ldb));
  } else {
    at::mm_out(out, matrix(a, m, k, lda), matrix(b, k, n, ldb));
  }
}

// n dense values as a tensor, for ATen's elementwise functions, which run the
// vector code of the CPU they find (at 128 x 128 tiles the per-call cost is small).
template <typename A>
at::Tensor tile_tensor(A* x, int64_t n) {
  return at::from_blob(x, {n}, at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value));
}

// A tile in the accumulation type A and, for the products, in the GEMM type G:
// the same memory where the two agree, else a copy, converted on request. The
// A values live in the tile's own memory, or in the caller's (place_acc).
template <typename A, typename G>
class DualTile {
 public:
  static constexpr bool kShared = std::is_same_v<A, G>;
  explicit DualTile(int64_t n) : acc_(n), gemm_(kShared ? 0 : n), acc_ptr_(acc_.data()) {}
  DualTile(const DualTile&) = delete;  // (acc_ptr_ may point into acc_)
  DualTile& operator=(const DualTile&) = delete;
  // The A values in memory of the caller's (as large as the tile), or back in the tile's own (nullptr).
  void place_acc(A* where) { acc_ptr_ = where != nullptr ? where : acc_.data(); }
  A* acc() { return acc_ptr_; }
  G* gemm() {
    if constexpr (kShared) {
      return acc_ptr_;
    } else {
      return gemm_.data();
    }
  }
  // The first n values, from acc to gemm (rounded), before a product reads them.
  G* to_gemm(int64_t n) {
    if constexpr (!kShared) convert(acc_ptr_, n, gemm_.data());
    return gemm();
  }
  // The first n values, from gemm to acc, after a product wrote them.
  A* from_gemm(int64_t n) {
    if constexpr (!kShared) convert(gemm_.data(), n, acc_ptr_);
    return acc();
  }
  // exp of the first n values of acc, in G: where A is double for float32
  // inputs, the arguments are formed in double (S - lse: |lse| units of float
  // rounding otherwise), and P is rounded to float for its products anyway.
  // Both halves hold P.
  void exp_in_gemm_type(int64_t n) {
    G* values = to_gemm(n);
    if constexpr (std::is_same_v<G, float>) {
      exp_in_place(values, n);
    } else {
      tile_tensor(values, n).exp_();
    }
    from_gemm(n);
  }

 private:
  std::vector<A> acc_;
  std::vector<G> gemm_;
  A* acc_ptr_;
};

// acc (m x n, type A, rows ld_acc apart) += a b (see matmul), the product in
// G: into acc directly where the types agree, else through scratch (m x n).
template <typename A, typename G>
void add_product(int64_t m, int64_t n, int64_t k, const G* a, int64_t lda, const G* b, int64_t ldb, A* acc,
                 int64_t ld_acc, G* scratch) {
  if constexpr (std::is_same_v<A, G>) {
    matmul(m, n, k, a, lda, b, ldb, acc, ld_acc, /*accumulate=*/true);
  } else {
    matmul(m, n, k, a, lda, b, ldb, scratch, n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) acc[i * ld_acc + j] += static_cast<A>(scratch[i * n + j]);
    }
  }
}

}  // namespace detail
}  // namespace flashattn_ext::cpu
