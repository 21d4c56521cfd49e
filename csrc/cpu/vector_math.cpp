// The float loops that vector_math.h declares, each defined once here for
// AVX-512, AVX2 + FMA and the baseline (FLASHATTN_EXT_CPU_VERSIONS): the
// vectors they run on and the helpers on them, the scale passes, sums and row
// maxima, the roundings of float to bfloat16 and half (c10's, step for step, and
// AVX512-BF16's instruction where the CPU has it), the softmax's exp and its
// sweep of a tile. Every helper here is inlined into the loop that calls it.
#include "cpu/vector_math.h"

#include <array>
#include <cstring>
#include <type_traits>

namespace flashattn_ext::cpu {
namespace detail FLASHATTN_EXT_CPU_HIDDEN {

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

// scale_in_place (see vector_math.h) of floats.
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

// scale_max_rows (see vector_math.h) of floats.
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

}  // namespace detail
}  // namespace flashattn_ext::cpu
