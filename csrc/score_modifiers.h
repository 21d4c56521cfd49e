// The score modifiers, defined once for every path. A score x = <q_i, k_j> of
// query i and key j becomes the logit the softmax takes through, in order:
//  1. the scale, or logit softcapping: cap * tanh(scale * x / cap) (Softcap);
//  2. ALiBi: less slope * |i + d - j|, d the diagonal's offset (alibi_bias,
//     with Visibility::distance);
//  3. the attn_mask: -inf where a bool mask is false, plus an additive one
//     (HeadMask);
//  4. -inf where the causal diagonal or a window hides key j from query i
//     (Visibility, flash_params.h).
// Each is built from the problem in the units of its path's softmax: 1 (exp:
// the CPU kernels, the ATen fallback) or log2(e) (exp2: the CUDA kernels,
// through cuda/score_modifiers.cuh), and each takes one score (float, double)
// or, where it says so, a tensor of them (the ATen fallback). Each path applies
// them in its own layout: the CPU's tiles (cpu/score_terms.h, cpu/decode.cpp),
// the fallback's tensors (fallback.cpp), and the registers of the Hopper
// forward (sm90/fwd_score_modifiers.cuh) and backward (sm90/bwd_mainloop.cuh),
// of sm80 (sm80/*.cu) and of decode (decode_common.cuh).
//
// A new modifier goes here, with its value in AttentionProblem (flash_params.h)
// and its option in AttentionOptions (ops.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_params.h"

namespace flashattn_ext {

// The units of a path's logits: exp(x) = exp2(x * log2(e)).
constexpr double kNaturalUnits = 1.0;
constexpr double kLog2Units = M_LOG2E;

// Logit softcapping (where p.softcap > 0): a score x becomes cap * tanh(x *
// scale_over_cap), with x_scale the factor x still needs (p.scale for raw
// products, 1 where the queries come scaled) folded into scale_over_cap.
// Without softcapping its values are infinite, and unused.
template <typename A>
struct Softcap {
  A scale_over_cap = 0, cap = 0;

  Softcap() = default;
  FLASHATTN_EXT_HOST_DEVICE Softcap(const AttentionProblem& p, double x_scale, double units)
      : scale_over_cap(static_cast<A>(x_scale / p.softcap)), cap(static_cast<A>(p.softcap * units)) {}

  // The capped score of x; tanh is the path's own (tanh.approx, tanhf,
  // std::tanh, at::tanh). X: A, or a tensor. A path that takes the tanh of a
  // whole tile at once applies tanh_argument, then from_tanh.
  template <typename X, typename Tanh>
  FLASHATTN_EXT_HOST_DEVICE X apply(const X& x, Tanh tanh) const {
    return from_tanh(tanh(tanh_argument(x)));
  }
  template <typename X>
  FLASHATTN_EXT_HOST_DEVICE X tanh_argument(const X& x) const {
    return x * scale_over_cap;
  }
  template <typename X>
  FLASHATTN_EXT_HOST_DEVICE X from_tanh(const X& t) const {
    return cap * t;
  }
  // The tanh that a capped score came from.
  template <typename X>
  FLASHATTN_EXT_HOST_DEVICE X tanh_of(const X& capped) const {
    return capped / cap;
  }
  // The cap's derivative in the scaled score, from its tanh t: 1 - t^2 (the
  // backward multiplies dS by it).
  template <typename X>
  FLASHATTN_EXT_HOST_DEVICE static X derivative(const X& t) {
    return 1 - t * t;
  }
};

// ALiBi's slope of (batch b, query head h) in units; 0 without ALiBi.
template <typename A>
FLASHATTN_EXT_HOST_DEVICE A alibi_slope(const AttentionProblem& p, int64_t b, int64_t h, A units) {
  const float slope = p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[b * p.alibi_stride_batch + h * p.alibi_stride_head];
  return static_cast<A>(slope) * units;
}

// ALiBi's term of a score at `distance` from its diagonal (Visibility::distance):
// -slope * distance. X: A, or a tensor.
template <typename A, typename X>
FLASHATTN_EXT_HOST_DEVICE X alibi_bias(A slope, const X& distance) {
  return -slope * distance;
}

// An additive mask's element as A: a cast, where a path's types do not say
// otherwise (the CUDA kernels' 16-bit types, whose conversion operators torch's
// builds turn off: cuda/score_modifiers.cuh).
template <typename Elem>
struct ElementTo {
  template <typename A>
  FLASHATTN_EXT_HOST_DEVICE static A convert(Elem x) {
    return static_cast<A>(x);
  }
};

// The attn_mask of one (batch b, query head h) (Elem: the inputs' type, of an
// additive mask), read in place through its strides (0 where it broadcasts),
// one element at a time.
template <typename Elem, typename A>
struct HeadMask {
  MaskKind kind = MaskKind::kNone;
  const char* base = nullptr;
  int64_t stride_row = 0, stride_col = 0;
  A units = 1;

  FLASHATTN_EXT_HOST_DEVICE HeadMask(MaskKind kind_, const TensorView4d& mask, int64_t b, int64_t h, double units_)
      : kind(kind_), stride_row(mask.stride_row), stride_col(mask.stride_col), units(static_cast<A>(units_)) {
    // (Without a mask, data is null and the strides 0.)
    const int64_t elem_size = kind == MaskKind::kBool ? sizeof(bool) : sizeof(Elem);
    base = static_cast<const char*>(mask.data) + (b * mask.stride_batch + h * mask.stride_head) * elem_size;
  }

  FLASHATTN_EXT_HOST_DEVICE bool present() const { return kind != MaskKind::kNone; }

  // The score of query i and key j with the mask applied (present() only):
  // -inf where a bool mask is false; plus the additive mask, in units.
  FLASHATTN_EXT_HOST_DEVICE A apply(A score, int64_t i, int64_t j) const {
    const int64_t offset = i * stride_row + j * stride_col;
    if (kind == MaskKind::kBool) return reinterpret_cast<const bool*>(base)[offset] ? score : static_cast<A>(-INFINITY);
    return score + ElementTo<Elem>::template convert<A>(reinterpret_cast<const Elem*>(base)[offset]) * units;
  }
};

}  // namespace flashattn_ext
