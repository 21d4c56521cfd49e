// FlashAttention on the CPU: the same tiling as the GPU kernels, one task per
// (batch, head, block of rows), tiles converted to the accumulation type on load.
// No buffer grows with len_q x len_k: every task owns a few tile-sized buffers.
#include "cpu/flash_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace flashattn_ext::cpu {
namespace {

constexpr int64_t kBlockQ = 128;  // query rows per task, at most (see query_block_rows; but see ReducedProducts)
constexpr int64_t kBlockK = 128;  // keys per streamed tile
// Per thread: the backward's P and dP of a query block, kept between its two passes where they fit.
constexpr int64_t kCacheBytes = int64_t{32} << 20;
// Per thread: the forward's keys and values of a head, loaded once for all its query blocks where they fit
// (else one tile at a time: long sequences keep the forward's memory independent of their length).
constexpr int64_t kHeadKeysBytes = int64_t{16} << 20;

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Query rows per block: max_rows, halved (to 32 at least) while the (batch,
// query head, block) items would number fewer than four a thread: at small
// shapes smaller blocks keep every thread busy, and shorten the longest task
// (causal blocks grow longer down the rows).
int64_t query_block_rows(const AttentionProblem& p, int64_t max_rows) {
  const int64_t wanted = 4 * int64_t{at::get_num_threads()};
  int64_t rows = max_rows;
  while (rows > 32 && p.batch * p.heads_q * ceil_div(p.len_q, rows) < wanted) rows /= 2;
  return rows;
}

template <typename A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// The float loops over every score, compiled for AVX-512, AVX2 + FMA and the
// baseline, one picked at load time for the CPU at hand (GCC's function
// multiversioning, where the C library resolves such functions; the rest of
// this file is built for the baseline, whose vectors are a quarter of
// AVX-512's): the softmax's exp, sum and max, the scale passes and the
// conversions of float tiles to 16 bits. Each is a template over the lanes of
// its vectors (kFloats), and FLASHATTN_EXT_CPU_VERSIONS(ret, name, params,
// impl, args) defines ret name(params) as impl<kFloats>(args) for each
// instruction set, with the width of its registers: 16 floats for AVX-512, 8
// for AVX2, 4 for the baseline (one vector width for all three: GCC 12 splits
// a vector compare wider than the registers into one compare a lane).
// Elsewhere GCC and Clang take the baseline's 4, other compilers one float at a time.
// The templates these call are inlined into them (FLASHATTN_EXT_CPU_INLINE:
// GCC leaves a template's own copy, built for the baseline, called otherwise).
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args)                    \
  __attribute__((target("arch=x86-64-v4"))) ret name params { return impl<16> args; } \
  __attribute__((target("arch=x86-64-v3"))) ret name params { return impl<8> args; }  \
  __attribute__((target("default"))) ret name params { return impl<4> args; }
#define FLASHATTN_EXT_CPU_INLINE inline __attribute__((always_inline))
// (Every function that takes or returns a vector is inlined: no call passes one.)
#pragma GCC diagnostic ignored "-Wpsabi"
// And AVX512-BF16's conversion to bfloat16, for CPUs that have it (see exp_shifted_sum).
#define FLASHATTN_EXT_CPU_AVX512BF16 1
#include <immintrin.h>
#elif defined(__GNUC__)
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args) \
  ret name params { return impl<4> args; }
#define FLASHATTN_EXT_CPU_INLINE inline
#else
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args) \
  ret name params { return impl<1> args; }
#define FLASHATTN_EXT_CPU_INLINE inline
#endif

// Vectors of kFloats lanes, in the vector extensions of GCC and Clang, whose
// operators act lane by lane: floats, their bits as int32_t and uint32_t, and
// 16-bit lanes. kFloats 1: the scalars themselves, for the loops' remainders
// (the same steps; where the compiler fuses a multiply and an add differently
// in the two, as it may for AVX2 and AVX-512, a last bit may differ).
template <int kFloats>
struct Vec {
#if defined(__GNUC__)
  typedef float Float __attribute__((vector_size(4 * kFloats)));
  typedef int32_t Int __attribute__((vector_size(4 * kFloats)));
  typedef uint32_t Bits __attribute__((vector_size(4 * kFloats)));
  typedef uint16_t Bits16 __attribute__((vector_size(2 * kFloats)));
#endif
};
template <>
struct Vec<1> {
  using Float = float;
  using Int = int32_t;
  using Bits = uint32_t;
  using Bits16 = uint16_t;
};
// The helpers below take a float or a vector of floats, V.
template <typename V>
constexpr int kFloatsOf = sizeof(V) / sizeof(float);
template <typename V>
using VecOf = Vec<kFloatsOf<V>>;

// The bits of x as another type of the same size (std::bit_cast, C++20).
template <typename To, typename From>
FLASHATTN_EXT_CPU_INLINE To reinterpret(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// A vector of floats from memory of any alignment, and any vector (or scalar) to it.
template <int kFloats>
FLASHATTN_EXT_CPU_INLINE typename Vec<kFloats>::Float load(const float* x) {
  typename Vec<kFloats>::Float v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
template <typename V>
FLASHATTN_EXT_CPU_INLINE void store(V v, void* to) {
  std::memcpy(to, &v, sizeof v);
}

// x in every lane.
template <int kFloats>
FLASHATTN_EXT_CPU_INLINE typename Vec<kFloats>::Float splat(float x) {
  return x - typename Vec<kFloats>::Float{};  // (x - 0 is x, -0 too)
}

// The lanes of v, in order.
template <typename V>
FLASHATTN_EXT_CPU_INLINE std::array<float, kFloatsOf<V>> lanes_of(V v) {
  return reinterpret<std::array<float, kFloatsOf<V>>>(v);
}

// The larger of a and b, a where b is NaN (as std::max(a, b) keeps a): a
// row's max passes over NaN scores, which the exp then carries into the sum.
template <typename V>
FLASHATTN_EXT_CPU_INLINE V max_keeping(V a, V b) {
  return a < b ? b : a;
}

// The sum and the max of n values, in kLanes independent chains: one chain is
// a serial dependency the compiler may not reorder (and at 128 x 128 tiles it
// cost as much as a tile product); independent lanes vectorize. (float: the
// vector loops below.)
constexpr int kLanes = 8;

template <typename A>
FLASHATTN_EXT_CPU_INLINE A sum_of(const A* x, int64_t n) {
  A lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  }
  for (; i < n; ++i) lanes[0] += x[i];
  A total = 0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

template <typename A>
FLASHATTN_EXT_CPU_INLINE A max_of(const A* x, int64_t n) {
  A lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kNegInf<A>);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[i + l]);
  }
  for (; i < n; ++i) lanes[0] = std::max(lanes[0], x[i]);
  return *std::max_element(lanes, lanes + kLanes);
}

// x[i] *= factor over n values.
template <typename A>
FLASHATTN_EXT_CPU_INLINE void scale_in_place(A* x, int64_t n, A factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}
template <int kFloats>
FLASHATTN_EXT_CPU_INLINE void scale_in_place_vec(float* x, int64_t n, float factor) {
  int64_t i = 0;
  for (; i + kFloats <= n; i += kFloats) store(load<kFloats>(x + i) * factor, x + i);
  for (; i < n; ++i) x[i] *= factor;
}
FLASHATTN_EXT_CPU_VERSIONS(void, scale_in_place, (float* x, int64_t n, float factor), scale_in_place_vec,
                           (x, n, factor))

// The float loops keep kChains vectors of partial sums or maxima: a vector
// add waits for the one before it in its chain.
constexpr int kChains = 4;

// The sum of the lanes of kChains vectors.
template <typename V>
FLASHATTN_EXT_CPU_INLINE float lane_sum(V (&chains)[kChains]) {
  for (int c = 1; c < kChains; ++c) chains[0] += chains[c];
  float total = 0;
  for (float lane : lanes_of(chains[0])) total += lane;
  return total;
}

template <int kFloats>
FLASHATTN_EXT_CPU_INLINE float sum_of_vec(const float* x, int64_t n) {
  typename Vec<kFloats>::Float chains[kChains] = {};
  int64_t i = 0;
  for (; i + kChains * kFloats <= n; i += kChains * kFloats) {
    for (int c = 0; c < kChains; ++c) chains[c] += load<kFloats>(x + i + c * kFloats);
  }
  for (; i + kFloats <= n; i += kFloats) chains[0] += load<kFloats>(x + i);
  float total = 0;
  for (; i < n; ++i) total += x[i];
  return total + lane_sum(chains);
}
FLASHATTN_EXT_CPU_VERSIONS(float, sum_of, (const float* x, int64_t n), sum_of_vec, (x, n))

// kFloats values from x, times factor where kScale (and stored so).
template <int kFloats, bool kScale>
FLASHATTN_EXT_CPU_INLINE typename Vec<kFloats>::Float load_scaling(float* x, float factor) {
  auto v = load<kFloats>(x);
  if constexpr (kScale) {
    v *= factor;
    store(v, x);
  }
  return v;
}

// The max of n values (NaN ones passed over, see max_keeping), each times
// factor first where kScale.
template <int kFloats, bool kScale>
FLASHATTN_EXT_CPU_INLINE float max_scaling(float* x, int64_t n, float factor) {
  typename Vec<kFloats>::Float chains[kChains];
  std::fill(chains, chains + kChains, splat<kFloats>(kNegInf<float>));
  int64_t i = 0;
  for (; i + kChains * kFloats <= n; i += kChains * kFloats) {
    for (int c = 0; c < kChains; ++c) {
      chains[c] = max_keeping(chains[c], load_scaling<kFloats, kScale>(x + i + c * kFloats, factor));
    }
  }
  for (; i + kFloats <= n; i += kFloats) {
    chains[0] = max_keeping(chains[0], load_scaling<kFloats, kScale>(x + i, factor));
  }
  float max = kNegInf<float>;
  for (; i < n; ++i) max = max_keeping(max, load_scaling<1, kScale>(x + i, factor));
  for (int c = 1; c < kChains; ++c) chains[0] = max_keeping(chains[0], chains[c]);
  for (float lane : lanes_of(chains[0])) max = max_keeping(max, lane);
  return max;
}

// For each of rows rows of cols values (dense), x[i] *= factor, and the row's
// max into maxima: the scale pass and the row max in one sweep (factor 1: the
// max alone), one call a tile (a row of 128 keys is 8 vectors: a call a row
// spent about as many instructions on the call, the chains' setup and their
// reduction as on the row).
template <typename A>
FLASHATTN_EXT_CPU_INLINE void scale_max_rows(A* x, int64_t rows, int64_t cols, A factor, A* maxima) {
  if (factor != A(1)) scale_in_place(x, rows * cols, factor);
  for (int64_t r = 0; r < rows; ++r) maxima[r] = max_of(x + r * cols, cols);
}
template <int kFloats>
FLASHATTN_EXT_CPU_INLINE void scale_max_rows_vec(float* x, int64_t rows, int64_t cols, float factor, float* maxima) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * cols;
    maxima[r] = factor == 1.f ? max_scaling<kFloats, false>(row, cols, factor)
                              : max_scaling<kFloats, true>(row, cols, factor);
  }
}
FLASHATTN_EXT_CPU_VERSIONS(void, scale_max_rows, (float* x, int64_t rows, int64_t cols, float factor, float* maxima),
                           scale_max_rows_vec, (x, rows, cols, factor, maxima))

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
int64_t key_tiles_size(int64_t len, int64_t cols) { return ceil_div(len, kBlockK) * kBlockK * cols; }

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
void matmul(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
            int64_t ldc, bool accumulate = false) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c);
}

void matmul(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
            int64_t ldc, bool accumulate = false) {
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

// n values converted from one type to another (a loop the compiler vectorizes).
template <typename From, typename To>
FLASHATTN_EXT_CPU_INLINE void convert(const From* from, int64_t n, To* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<To>(from[i]);
}

// 32-bit lanes cut to their low 16 bits.
template <typename Bits>
FLASHATTN_EXT_CPU_INLINE auto low_halves(Bits x) {
  if constexpr (std::is_same_v<Bits, uint32_t>) {
    return static_cast<uint16_t>(x);
  } else {
    return __builtin_convertvector(x, typename Vec<sizeof(Bits) / 4>::Bits16);
  }
}

// The bits of x rounded to bfloat16 and to half, as c10's conversions round
// (to nearest, ties to even; NaN to a quiet NaN), step for step.
template <typename V>
FLASHATTN_EXT_CPU_INLINE auto bfloat16_bits(V x) {
  using Bits = typename VecOf<V>::Bits;
  const Bits bits = reinterpret<Bits>(x);
  const Bits rounded = (bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16;
  return low_halves(x != x ? 0x7FC0u : rounded);
}

template <typename V>
FLASHATTN_EXT_CPU_INLINE auto half_bits(V x) {  // (c10's fp16_ieee_from_fp32_value)
  using Bits = typename VecOf<V>::Bits;
  constexpr float kScaleToInf = 0x1.0p+112f, kScaleToZero = 0x1.0p-110f;
  const Bits w = reinterpret<Bits>(x);
  const Bits twice = w + w;  // (the sign shifted out)
  const Bits sign = w & 0x80000000u;
  V base = reinterpret<V>(w & 0x7FFFFFFFu) * kScaleToInf * kScaleToZero;  // |x|, rounded to half's precision
  Bits bias = twice & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = reinterpret<V>((bias >> 1) + 0x07800000u) + base;
  const Bits bits = reinterpret<Bits>(base);
  const Bits nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return low_halves((sign >> 16) | (twice > 0xFF000000u ? 0x7E00u : nonsign));
}

// x rounded to R (c10::BFloat16 or c10::Half), as bits.
template <typename R, typename V>
FLASHATTN_EXT_CPU_INLINE auto bits_rounded_to(V x) {
  static_assert(std::is_same_v<R, c10::BFloat16> || std::is_same_v<R, c10::Half>);
  if constexpr (std::is_same_v<R, c10::BFloat16>) {
    return bfloat16_bits(x);
  } else {
    return half_bits(x);
  }
}

// float tiles rounded to 16 bits (P for its product), in the vector code of the CPU at hand.
template <int kFloats, typename R>
FLASHATTN_EXT_CPU_INLINE void convert_vec(const float* from, int64_t n, R* to) {
  int64_t i = 0;
  for (; i + kFloats <= n; i += kFloats) store(bits_rounded_to<R>(load<kFloats>(from + i)), to + i);
  for (; i < n; ++i) store(bits_rounded_to<R>(from[i]), to + i);
}
FLASHATTN_EXT_CPU_VERSIONS(void, convert, (const float* from, int64_t n, c10::BFloat16* to), convert_vec,
                           (from, n, to))
FLASHATTN_EXT_CPU_VERSIONS(void, convert, (const float* from, int64_t n, c10::Half* to), convert_vec, (from, n, to))

// n dense values as a tensor, for ATen's elementwise functions, which run the
// vector code of the CPU they find (at 128 x 128 tiles the per-call cost is small).
template <typename A>
at::Tensor tile_tensor(A* x, int64_t n) {
  return at::from_blob(x, {n}, at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value));
}

// The softmax's float exp, compiled for AVX-512, AVX2 + FMA and the baseline
// (FLASHATTN_EXT_CPU_VERSIONS): plain arithmetic and selects, on a float or a
// vector of floats (V) (-fno-trapping-math, setup.py, lets the compiler keep
// the selects in vector code). The baseline's gives the bits of the scalar
// code before it, over all 2^32 floats; the others fuse multiplies and adds.
// e^x, within about 1 ulp of the exact value (torch's CPU kernel: 1 ulp; at::exp_
// here, through MKL's accurate mode: 2.5x the time), with e^x below 2^-126
// flushed to 0 and inf and NaN kept: x = n ln 2 + r (ln 2 in two parts, so r is
// exact), e^r by its Taylor series to r^7 (|r| <= ln 2 / 2: 5e-9 left off),
// times 2^n made from the exponent bits.
constexpr float kExpMin = -87.5f, kExpMax = 88.7228f;  // e^kExpMin is below 2^-126; e^x overflows past kExpMax

// The steps for kExpMin <= x <= kExpMax.
template <typename V>
FLASHATTN_EXT_CPU_INLINE V exp_steps(V x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860676533018708e-06f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, left in the low mantissa bits
  const V t = (x > 88.0f ? 88.0f : x) * kLog2e + kRound;  // n <= 127: 2^n finite (then r <= 0.75)
  const V n = t - kRound;
  using Int = typename VecOf<V>::Int;
  const V scale = reinterpret<V>((reinterpret<Int>(t) - 0x4B400000 + 127) << 23);  // (n + 127) << 23: 2^n
  const V r = (x - n * kLn2Hi) - n * kLn2Lo;
  V e = 1.f / 5040 * r + 1.f / 720;
  e = e * r + 1.f / 120;
  e = e * r + 1.f / 24;
  e = e * r + 1.f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  return e * scale;
}

template <typename V>
FLASHATTN_EXT_CPU_INLINE V exp_float(V x) {
  V xr = x < kExpMin ? kExpMin : x;
  xr = xr > kExpMax ? kExpMax : xr;
  V y = exp_steps(xr);
  y = x < kExpMin ? 0.f : y;
  y = x > kExpMax ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;
}

// The same for x <= 0 (and NaN, kept: it passes through the arithmetic), to the
// bit (checked over every float from 0 to -87.5, baseline), without the overflow's
// selects: the softmax's exps, of scores less their row's max. 3.7x faster
// (AVX2, as GCC vectorized the scalar code), where for exp_float GCC computed
// the polynomial twice, once for each side of a select.
template <typename V>
FLASHATTN_EXT_CPU_INLINE V exp_nonpositive(V x) {
  const V y = exp_steps(x < kExpMin ? kExpMin : x);
  return x < kExpMin ? 0.f : y;
}

template <int kFloats>
FLASHATTN_EXT_CPU_INLINE void exp_in_place_vec(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kFloats <= n; i += kFloats) store(exp_float(load<kFloats>(x + i)), x + i);
  for (; i < n; ++i) x[i] = exp_float(x[i]);
}
FLASHATTN_EXT_CPU_VERSIONS(void, exp_in_place, (float* x, int64_t n), exp_in_place_vec, (x, n))

#ifdef FLASHATTN_EXT_CPU_AVX512BF16
// 16 floats rounded to bfloat16 by AVX512-BF16's vcvtneps2bf16: to nearest,
// ties to even, as bfloat16_bits rounds, in one instruction where that takes
// nine (NaN stays NaN, with its own payload; the instruction flushes denormals,
// which the softmax's exp does not make). (Not always_inline: the template
// that calls it is built for the baseline too, where it cannot be inlined;
// the compiler inlines it into exp_shifted_sum_bf16_instruction.)
__attribute__((target("arch=x86-64-v4,avx512bf16"))) inline Vec<16>::Bits16 bfloat16_bits_by_instruction(
    Vec<16>::Float x) {
  return reinterpret<Vec<16>::Bits16>(_mm512_cvtneps_pbh(reinterpret<__m512>(x)));
}
#endif

// e^(x - shift) for the kFloats values at x, stored at out as Out (float, or
// rounded to 16 bits, see bits_rounded_to; with kBf16Instruction, to bfloat16
// by the instruction above), and returned in float.
template <int kFloats, typename Out, bool kBf16Instruction = false>
FLASHATTN_EXT_CPU_INLINE typename Vec<kFloats>::Float store_shifted_exp(const float* x, float shift, Out* out) {
  const auto e = exp_nonpositive(load<kFloats>(x) - shift);
  if constexpr (std::is_same_v<Out, float>) {
    store(e, out);
  } else if constexpr (kBf16Instruction && kFloats == 16) {
#ifdef FLASHATTN_EXT_CPU_AVX512BF16
    store(bfloat16_bits_by_instruction(e), out);
#endif
  } else {
    store(bits_rounded_to<Out>(e), out);
  }
  return e;
}

// out[i] = e^(x[i] - shift) over n values, returning their sum (in float, in
// kChains vectors of partial sums): the forward's softmax of a row in one
// sweep. The values are at most shift (their row's max), or NaN. Out: float
// (out may be x), or 16 bits: P rounded for the reduced products in the same sweep.
template <int kFloats, typename Out, bool kBf16Instruction = false>
FLASHATTN_EXT_CPU_INLINE float exp_shifted_sum_vec(const float* x, int64_t n, float shift, Out* out) {
  typename Vec<kFloats>::Float chains[kChains] = {};
  int64_t i = 0;
  for (; i + kChains * kFloats <= n; i += kChains * kFloats) {
    for (int c = 0; c < kChains; ++c) {
      const int64_t at = i + c * kFloats;
      chains[c] += store_shifted_exp<kFloats, Out, kBf16Instruction>(x + at, shift, out + at);
    }
  }
  for (; i + kFloats <= n; i += kFloats) {
    chains[0] += store_shifted_exp<kFloats, Out, kBf16Instruction>(x + i, shift, out + i);
  }
  float total = 0;
  for (; i < n; ++i) total += store_shifted_exp<1>(x + i, shift, out + i);
  return total + lane_sum(chains);
}
// The same for each of rows rows of cols values (dense; out's rows ld_out
// apart), less their own shifts[r], their sums into sums: one call a tile (see
// scale_max_rows).
template <int kFloats, typename Out, bool kBf16Instruction = false>
FLASHATTN_EXT_CPU_INLINE void exp_shifted_sum_rows_vec(const float* x, int64_t rows, int64_t cols, const float* shifts,
                                                       Out* out, int64_t ld_out, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    sums[r] = exp_shifted_sum_vec<kFloats, Out, kBf16Instruction>(x + r * cols, cols, shifts[r], out + r * ld_out);
  }
}
FLASHATTN_EXT_CPU_VERSIONS(void, exp_shifted_sum_rows,
                           (float* x, int64_t rows, int64_t cols, const float* shifts, float* sums),
                           exp_shifted_sum_rows_vec, (x, rows, cols, shifts, x, cols, sums))
FLASHATTN_EXT_CPU_VERSIONS(void, exp_shifted_sum_rows_portable,
                           (const float* x, int64_t rows, int64_t cols, const float* shifts, c10::BFloat16* out,
                            int64_t ld_out, float* sums),
                           exp_shifted_sum_rows_vec, (x, rows, cols, shifts, out, ld_out, sums))
#ifdef FLASHATTN_EXT_CPU_AVX512BF16
__attribute__((target("arch=x86-64-v4,avx512bf16"))) void exp_shifted_sum_rows_bf16_instruction(
    const float* x, int64_t rows, int64_t cols, const float* shifts, c10::BFloat16* out, int64_t ld_out,
    float* sums) {
  exp_shifted_sum_rows_vec<16, c10::BFloat16, /*kBf16Instruction=*/true>(x, rows, cols, shifts, out, ld_out, sums);
}
#endif
// P in bfloat16 by the conversion instruction where the CPU has it (Sapphire
// Rapids, Zen 4 on, where the reduced products run on AMX): the rounding took
// nine of the sweep's 31 instructions a vector.
void exp_shifted_sum_rows(const float* x, int64_t rows, int64_t cols, const float* shifts, c10::BFloat16* out,
                          int64_t ld_out, float* sums) {
#ifdef FLASHATTN_EXT_CPU_AVX512BF16
  static const bool has_instruction = __builtin_cpu_supports("avx512bf16");
  if (has_instruction) return exp_shifted_sum_rows_bf16_instruction(x, rows, cols, shifts, out, ld_out, sums);
#endif
  exp_shifted_sum_rows_portable(x, rows, cols, shifts, out, ld_out, sums);
}
FLASHATTN_EXT_CPU_VERSIONS(void, exp_shifted_sum_rows,
                           (const float* x, int64_t rows, int64_t cols, const float* shifts, c10::Half* out,
                            int64_t ld_out, float* sums),
                           exp_shifted_sum_rows_vec, (x, rows, cols, shifts, out, ld_out, sums))

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

// Logit softcapping of n scaled scores: s = softcap * tanh(s / softcap); with
// grad, also d(capped)/d(scaled) = 1 - tanh^2 there, for the backward.
template <typename A>
void apply_softcap(A* scores, int64_t n, A softcap, A* grad) {
  for (int64_t i = 0; i < n; ++i) scores[i] /= softcap;
  at::Tensor t = tile_tensor(scores, n);
  at::tanh_(t);
  for (int64_t i = 0; i < n; ++i) {
    if (grad != nullptr) grad[i] = A(1) - scores[i] * scores[i];
    scores[i] *= softcap;
  }
}

// The attn_mask of one (batch, head): applied to the scaled score of query i and key j.
template <typename T, typename A>
struct HeadMask {
  MaskKind kind = MaskKind::kNone;
  const char* base = nullptr;
  int64_t stride_row = 0, stride_col = 0;

  HeadMask(MaskKind kind_, const TensorView4d& mask, int64_t b, int64_t h) : kind(kind_) {
    if (kind == MaskKind::kNone) return;
    const int64_t elem_size = kind == MaskKind::kBool ? sizeof(bool) : sizeof(T);
    base = static_cast<const char*>(mask.data) + (b * mask.stride_batch + h * mask.stride_head) * elem_size;
    stride_row = mask.stride_row;
    stride_col = mask.stride_col;
  }

  A apply(A score, int64_t i, int64_t j) const {
    const int64_t offset = i * stride_row + j * stride_col;
    switch (kind) {
      case MaskKind::kBool:
        return reinterpret_cast<const bool*>(base)[offset] ? score : kNegInf<A>;
      case MaskKind::kAdditive:
        return score + static_cast<A>(reinterpret_cast<const T*>(base)[offset]);
      default:
        return score;
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

// The scaled scores of queries row0 on and keys col0 on (rows x cols, dense),
// softcapped (softcap > 0; its derivative into softcap_grad where given), less
// ALiBi's alibi_slope times the distance from the diagonal (slope 0: none),
// with the mask applied, or -inf where query row0 + r may not see key col0 + c.
template <typename T, typename A>
void adjust_scores(A* scores, int64_t rows, int64_t cols, A softcap, A alibi_slope, const Visibility& vis,
                   const HeadMask<T, A>& mask, int64_t row0, int64_t col0, A* softcap_grad = nullptr) {
  if (softcap > A(0)) apply_softcap(scores, rows * cols, softcap, softcap_grad);
  const bool partial = vis.tile_is_partial(row0, rows, col0, cols);
  if (!partial && mask.kind == MaskKind::kNone && alibi_slope == A(0)) return;  // the common tile
  if (mask.kind == MaskKind::kNone && alibi_slope == A(0)) {
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
      const A biased = score - alibi_slope * static_cast<A>(vis.distance(i, j));
      score = partial && !vis.visible(i, j) ? kNegInf<A> : mask.apply(biased, i, j);
    }
  }
}

// Whether adjust_scores changes any score of the tile (most tiles it leaves as they are).
template <typename T, typename A>
bool adjusts_scores(A softcap, A alibi_slope, const Visibility& vis, const HeadMask<T, A>& mask, int64_t row0,
                    int64_t rows, int64_t col0, int64_t cols) {
  return softcap > A(0) || alibi_slope != A(0) || mask.kind != MaskKind::kNone ||
         vis.tile_is_partial(row0, rows, col0, cols);
}

// scores[r][c] = <q_r, k_c> (in A; q_r already times the softmax scale, see
// load_scaled_queries; k transposed: key c is column c of k_t, whose rows lie
// ld_k apart), adjusted (see adjust_scores).
template <typename T, typename A, typename G>
void compute_scores(const G* q, const G* k_t, int64_t ld_k, int64_t rows, int64_t cols, int64_t dim, A softcap,
                    A alibi_slope, const Visibility& vis, const HeadMask<T, A>& mask, int64_t row0, int64_t col0,
                    DualTile<A, G>& score_tile, A* softcap_grad = nullptr) {
  matmul(rows, cols, dim, q, dim, k_t, ld_k, score_tile.gemm(), cols);
  adjust_scores(score_tile.from_gemm(rows * cols), rows, cols, softcap, alibi_slope, vis, mask, row0, col0,
                softcap_grad);
}

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
constexpr bool kIs16Bit = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// FLASHATTN_EXT_CPU_REDUCED_GEMM (read once): 1 makes the 16-bit forward take
// ReducedProducts on every CPU, unpacked where oneDNN has no VNNI kernels for
// the type (brgemm then falls back to torch's gemm), for testing that path on
// CPUs without AMX; 0 keeps the float products everywhere, for comparisons;
// unset (or anything else), the CPU decides.
enum class ReducedProductsSetting { kAuto, kOn, kOff };
ReducedProductsSetting reduced_products_setting() {
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
constexpr int64_t kPackedCols = 64;

int64_t round_up(int64_t n, int64_t multiple) { return ceil_div(n, multiple) * multiple; }

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

// The i-th of n query blocks in the order 0, n - 1, 1, n - 2, ...: causal
// blocks grow longer down the rows, so that the few consecutive tasks a thread
// takes at small shapes (blocks of one head) are as long in all as another
// thread's (at 1 x 4 x 512 x 64 on 16 threads, four blocks of 32 rows a
// thread: the busiest thread took twice the mean's time in order, 1.5x so;
// the bfloat16 forward 250 to 188 us).
int64_t longest_and_shortest_in_turn(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

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
  const A softcap = static_cast<A>(p.softcap);

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

      const HeadMask<T, A> mask(params.mask_kind, params.mask, b, h);
      const HeadDropout<A> dropout(params.dropout, p, b, h);
      const A slope = static_cast<A>(alibi_slope(p, b, h));
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
        const bool adjusting = adjusts_scores(softcap, slope, vis, mask, row0, rows, col0, cols);
        if (adjusting) {
          if (raw_scale != A(1)) scale_in_place(scores, rows * cols, raw_scale);
          adjust_scores(scores, rows, cols, softcap, slope, vis, mask, row0, col0);
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

// For one (query tile, key tile) pair: recomputes P = exp(S - lse) into
// prob_tile and dP = dO V^T into dscore_tile (both halves of each); k_t and
// v_t hold the tile's keys and values as columns, rows ld_kv apart.
// Rows with lse = -inf see no key. With softcapping, softcap_grad receives the
// cap's derivative, for the caller to carry dS through it (see
// raw_score_gradient). (b, h): the head, for ALiBi's slope. With
// same_as_forward (the forward's products, holding the head's keys and these
// rows' queries), S comes from the products the forward's came from, to the
// same bits: P = exp(S - lse) is then as exact as with the float products (1
// where a row sees one key). With dout_values (such products holding the
// head's values as their keys and these rows' dO as their queries), dP comes
// from them: dO and V are in T already, so in T the product loses nothing.
template <typename T, typename A, typename G>
void recompute_probabilities(const G* q, const G* k_t, const G* v_t, int64_t ld_kv, const G* dout, const A* lse,
                             int64_t rows, int64_t cols, const AttentionProblem& p, int64_t b, int64_t h,
                             const Visibility& vis, const HeadMask<T, A>& mask, int64_t row0, int64_t col0,
                             DualTile<A, G>& prob_tile, DualTile<A, G>& dscore_tile, A* softcap_grad,
                             ReducedProducts<T>* same_as_forward, ReducedProducts<T>* dout_values) {
  const A softcap = static_cast<A>(p.softcap), slope = static_cast<A>(alibi_slope(p, b, h));
  if constexpr (kIs16Bit<T>) {
    if (same_as_forward != nullptr) {
      same_as_forward->scores(rows, cols, col0 / kBlockK, prob_tile);
      adjust_scores(prob_tile.acc(), rows, cols, softcap, slope, vis, mask, row0, col0, softcap_grad);
    }
  }
  if (same_as_forward == nullptr) {
    compute_scores(q, k_t, ld_kv, rows, cols, p.head_dim, softcap, slope, vis, mask, row0, col0, prob_tile,
                   softcap_grad);
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
        const HeadMask<T, A> mask(params.mask_kind, params.mask, b, h);
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
                                  lse, rows, cols, p, b, h, vis, mask, row0, col0, prob_tile, dscore_tile,
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
void attention_forward(const FwdParams& params) {
  auto* lse = static_cast<Lse<T>*>(params.lse);
  if constexpr (kIs16Bit<T>) {
    if (takes_reduced_products<T>()) {
      forward_tiles<T, /*kWithOutput=*/true, Lse<T>, ReducedProducts<T>>(params, lse);
      return;
    }
  }
  forward_tiles<T>(params, lse);
}

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

namespace {

// Row j of head h of sequence b's cache (see DecodeParams).
template <typename T>
T* cache_row(const DecodeParams& params, const TensorView4d& cache, int64_t b, int64_t h, int64_t j) {
  int64_t outer = b, row = j;
  if (params.block_table.data != nullptr) {
    outer = params.block_table.at(b, j / params.block_size);
    row = j % params.block_size;
  }
  return static_cast<T*>(cache.data) + outer * cache.stride_batch + h * cache.stride_head + row * cache.stride_row;
}

// Writes key_new and value_new into the caches.
template <typename T>
void append_to_cache(const DecodeParams& params) {
  const AttentionProblem& p = params.problem;
  at::parallel_for(0, p.batch * p.heads_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.heads_kv, h = task % p.heads_kv;
      for (int64_t i = 0; i < params.len_new; ++i) {
        const int64_t j = params.cache_seqlens.at(0, b) + i;
        for (const auto& [src, dst, dim] : {std::tuple{&params.k_new, &params.k_cache, p.head_dim},
                                            std::tuple{&params.v_new, &params.v_cache, p.head_dim_v}}) {
          const T* from = static_cast<const T*>(src->data) + b * src->stride_batch + h * src->stride_head +
                          i * src->stride_row;
          T* to = cache_row<T>(params, *dst, b, h, j);
          for (int64_t c = 0; c < dim; ++c) to[c * dst->stride_col] = from[c * src->stride_col];
        }
      }
    }
  });
}

}  // namespace

template <typename T>
void decode_attention(const DecodeParams& params) {
  using A = Acc<T>;
  const AttentionProblem& p = params.problem;
  if (params.len_new > 0) append_to_cache<T>(params);
  if (p.heads_kv == 0) return;  // then no query heads either
  const int64_t group = p.heads_q / p.heads_kv, dim = p.head_dim, dim_v = p.head_dim_v;
  const A scale = static_cast<A>(p.scale), softcap = static_cast<A>(p.softcap);
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
      const A slope = static_cast<A>(alibi_slope(p, b, h));
      load_tile<T>(params.q, b, h, i, 1, dim, q.data());
      scores.resize(key_end - key_begin);
      A row_max = kNegInf<A>;
      for (int64_t j = key_begin; j < key_end; ++j) {
        const T* k = cache_row<T>(params, params.k_cache, b, h / group, j);
        A dot = 0;
        for (int64_t c = 0; c < dim; ++c) dot += q[c] * static_cast<A>(k[c * params.k_cache.stride_col]);
        A& score = scores[j - key_begin];
        score = dot * scale;
        if (softcap > A(0)) score = softcap * std::tanh(score / softcap);
        score -= slope * static_cast<A>(vis.distance(i, j));
        row_max = std::max(row_max, score);
      }
      std::fill(acc.begin(), acc.end(), A(0));
      A row_sum = 0;
      for (int64_t j = key_begin; j < key_end; ++j) {
        const A weight = std::exp(scores[j - key_begin] - row_max);
        row_sum += weight;
        const T* v = cache_row<T>(params, params.v_cache, b, h / group, j);
        for (int64_t c = 0; c < dim_v; ++c) acc[c] += weight * static_cast<A>(v[c * params.v_cache.stride_col]);
      }
      // A row that sees no key gets out = 0 and lse = -inf, as in the attention ops.
      const bool seen = key_end > key_begin;
      for (A& value : acc) value = seen ? value / row_sum : A(0);
      store_tile<T>(params.out, b, h, i, 1, dim_v, acc.data());
      lse[task] = static_cast<Lse<T>>(seen ? row_max + std::log(row_sum) : kNegInf<A>);
    }
  });
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

#define FLASHATTN_EXT_INSTANTIATE(T)                          \
  template void attention_forward<T>(const FwdParams&); \
  template void attention_backward<T>(const BwdParams&); \
  template void decode_attention<T>(const DecodeParams&);
FLASHATTN_EXT_INSTANTIATE(double)
FLASHATTN_EXT_INSTANTIATE(float)
FLASHATTN_EXT_INSTANTIATE(c10::Half)
FLASHATTN_EXT_INSTANTIATE(c10::BFloat16)
#undef FLASHATTN_EXT_INSTANTIATE

}  // namespace flashattn_ext::cpu
