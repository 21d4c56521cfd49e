// The CPU kernels' loops over every score: the macros that compile the float
// loops once for each instruction set (FLASHATTN_EXT_CPU_VERSIONS, below), the
// loops' templates for any accumulation type (sum_of, max_of, scale_in_place,
// scale_max_rows, convert), and the declarations of the float loops, which
// overload them, and of the softmax's exp sweeps (exp_in_place,
// exp_shifted_sum_rows). vector_math.cpp defines the float loops, once, with
// their vectors, the exp and the roundings to 16 bits; nothing declared here
// takes or returns a vector.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <limits>

// The float loops over every score, compiled for AVX-512, AVX2 + FMA and the
// baseline, one picked at load time for the CPU at hand (GCC's function
// multiversioning, where the C library resolves such functions; the rest of
// the kernels is built for the baseline, whose vectors are a quarter of
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
// Each is defined once, in vector_math.cpp; FLASHATTN_EXT_CPU_DECLARE_VERSIONS(ret,
// name, params) declares every version of it here, for the files that call it:
// GCC dispatches a call (through the resolver it emits beside the call) only
// where it sees all the versions declared; a plain declaration would call the
// baseline's version on every CPU.
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args)                    \
  __attribute__((target("arch=x86-64-v4"))) ret name params { return impl<16> args; } \
  __attribute__((target("arch=x86-64-v3"))) ret name params { return impl<8> args; }  \
  __attribute__((target("default"))) ret name params { return impl<4> args; }
#define FLASHATTN_EXT_CPU_DECLARE_VERSIONS(ret, name, params) \
  __attribute__((target("arch=x86-64-v4"))) ret name params;  \
  __attribute__((target("arch=x86-64-v3"))) ret name params;  \
  __attribute__((target("default"))) ret name params;
#define FLASHATTN_EXT_CPU_INLINE inline __attribute__((always_inline))
// (Every function that takes or returns a vector is inlined: no call passes one.)
#pragma GCC diagnostic ignored "-Wpsabi"
// And AVX512-BF16's conversion to bfloat16, for CPUs that have it (see exp_shifted_sum).
#define FLASHATTN_EXT_CPU_AVX512BF16 1
#include <immintrin.h>
#elif defined(__GNUC__)
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args) \
  ret name params { return impl<4> args; }
#define FLASHATTN_EXT_CPU_DECLARE_VERSIONS(ret, name, params) ret name params;
#define FLASHATTN_EXT_CPU_INLINE inline
#else
#define FLASHATTN_EXT_CPU_VERSIONS(ret, name, params, impl, args) \
  ret name params { return impl<1> args; }
#define FLASHATTN_EXT_CPU_DECLARE_VERSIONS(ret, name, params) ret name params;
#define FLASHATTN_EXT_CPU_INLINE inline
#endif

// The kernels' parts (namespace detail, in these files) stay inside the library,
// as when they were one file's anonymous namespace: none exported, and calls
// between them direct. (Each block of detail needs the attribute.)
#if defined(__GNUC__)
#define FLASHATTN_EXT_CPU_HIDDEN __attribute__((visibility("hidden")))
#else
#define FLASHATTN_EXT_CPU_HIDDEN
#endif

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

template <typename A>
inline constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// The sum and the max of n values, in kLanes independent chains: one chain is
// a serial dependency the compiler may not reorder (and at 128 x 128 tiles it
// cost as much as a tile product); independent lanes vectorize. (float: the
// vector loops, vector_math.cpp.)
inline constexpr int kLanes = 8;

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
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, scale_in_place, (float* x, int64_t n, float factor))

// The sum of n floats (see sum_of_vec, vector_math.cpp).
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(float, sum_of, (const float* x, int64_t n))

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
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, scale_max_rows,
                                   (float* x, int64_t rows, int64_t cols, float factor, float* maxima))

// n values converted from one type to another (a loop the compiler vectorizes).
template <typename From, typename To>
FLASHATTN_EXT_CPU_INLINE void convert(const From* from, int64_t n, To* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<To>(from[i]);
}
// float tiles rounded to 16 bits, as c10's conversions round (see convert_vec, vector_math.cpp).
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, convert, (const float* from, int64_t n, c10::BFloat16* to))
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, convert, (const float* from, int64_t n, c10::Half* to))

// x[i] = e^x[i] over n floats (see exp_float, vector_math.cpp).
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, exp_in_place, (float* x, int64_t n))

// The softmax's sweep of a tile (see exp_shifted_sum_rows_vec, vector_math.cpp):
// for each of rows rows of cols values, e^(x - shifts[r]) and its row's sum
// into sums, in place, or rounded to 16 bits into out (rows ld_out apart).
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, exp_shifted_sum_rows,
                                   (float* x, int64_t rows, int64_t cols, const float* shifts, float* sums))
// (bfloat16: one function, which takes AVX512-BF16's instruction where the CPU has it.)
void exp_shifted_sum_rows(const float* x, int64_t rows, int64_t cols, const float* shifts, c10::BFloat16* out,
                          int64_t ld_out, float* sums);
FLASHATTN_EXT_CPU_DECLARE_VERSIONS(void, exp_shifted_sum_rows,
                                   (const float* x, int64_t rows, int64_t cols, const float* shifts, c10::Half* out,
                                    int64_t ld_out, float* sums))

}  // namespace detail
}  // namespace flashattn_ext::cpu
