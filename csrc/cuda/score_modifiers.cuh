// The score modifiers (score_modifiers.h) as the CUDA kernels take them: in
// log2 units (their softmax takes exp2: exp(x) = exp2(x * log2(e))), with the
// tanh of each kind of kernel. Each family applies them in its own register
// layout: the Hopper forward (sm90/fwd_score_modifiers.cuh), the Hopper
// backward (sm90/bwd_mainloop.cuh), sm80 (sm80/*.cu) and the decode kernels
// (decode_common.cuh). Which keys a query sees is flash_params.h's Visibility.
#pragma once

#include <cmath>

#include "cuda/ptx.cuh"
#include "flash_params.h"
#include "score_modifiers.h"

namespace flashattn_ext {

// An additive mask's 16-bit elements, converted by the PTX wrappers (torch's
// builds turn the types' conversion operators off).
template <>
struct ElementTo<__nv_bfloat16> {
  template <typename A>
  __device__ __forceinline__ static A convert(__nv_bfloat16 x) {
    return static_cast<A>(cuda::ptx::to_float(x));
  }
};
template <>
struct ElementTo<__half> {
  template <typename A>
  __device__ __forceinline__ static A convert(__half x) {
    return static_cast<A>(cuda::ptx::to_float(x));
  }
};

namespace cuda {

// Raw scores x become x * score_scale_log2(p).
__device__ __forceinline__ float score_scale_log2(const AttentionProblem& p) {
  return static_cast<float>(p.scale * kLog2Units);
}

// Logit softcapping of raw scores, in log2 units. Built by the decode kernels
// always (its values then infinite and unused), by the others only with
// softcapping.
struct SoftcapLog2 : Softcap<float> {
  SoftcapLog2() = default;
  __device__ __forceinline__ explicit SoftcapLog2(const AttentionProblem& p) : Softcap<float>(p, p.scale, kLog2Units) {}

  // With tanh.approx (FlashAttention's choice, the Hopper kernels'): a logit of
  // 10 moves by up to 0.005, one of 50 by 0.025, against probabilities rounded
  // to 16 bits anyway; tanhf ran the Hopper forward at 0.47x the speed of no
  // softcap, tanh.approx at 0.72x (H200, bf16, D=128, N=8192).
  __device__ __forceinline__ float capped_approx(float x) const {
    return apply(x, [](float y) { return ptx::tanh_approx(y); });
  }
  // With tanhf (the decode kernels, bound by memory).
  __device__ __forceinline__ float capped(float x) const {
    return apply(x, [](float y) { return tanhf(y); });
  }
};

// ALiBi's slope of (batch b, query head h) in log2 units; 0 without ALiBi.
__device__ __forceinline__ float alibi_slope_log2(const AttentionProblem& p, int64_t b, int64_t h) {
  return alibi_slope(p, b, h, static_cast<float>(kLog2Units));
}

// The attn_mask of one (batch, query head) in log2 units (the sm80 kernels'
// element test).
template <typename Elem>
struct HeadMaskLog2 : HeadMask<Elem, float> {
  __device__ __forceinline__ HeadMaskLog2(MaskKind kind, const TensorView4d& mask, int64_t b, int64_t h)
      : HeadMask<Elem, float>(kind, mask, b, h, kLog2Units) {}
};

}  // namespace cuda
}  // namespace flashattn_ext
