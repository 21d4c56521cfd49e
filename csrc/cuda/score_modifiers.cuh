// The score modifiers of the CUDA kernels, defined once: the scale, logit
// softcapping and ALiBi's slope, each built from the problem in log2 units
// (the kernels' softmax takes exp2: exp(x) = exp2(x * log2(e))). Each family
// applies them in its own register layout: the Hopper forward
// (sm90/fwd_score_modifiers.cuh), the Hopper backward (sm90/bwd_mainloop.cuh)
// and the decode kernels (decode_common.cuh). Which keys a query sees is
// flash_params.h's Visibility; the attn_mask's element test, attn_mask.cuh.
#pragma once

#include <cmath>

#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda {

// Raw scores x become x * score_scale_log2(p).
__device__ __forceinline__ float score_scale_log2(const AttentionProblem& p) {
  return static_cast<float>(p.scale * M_LOG2E);
}

// Logit softcapping: raw scores x become softcap * tanh(scale * x / softcap)
// (times log2(e)); the backward multiplies dS by the cap's derivative
// 1 - tanh^2. Meaningful only where p.softcap > 0 (without softcapping its
// values are infinite, and the kernels do not use them).
struct SoftcapLog2 {
  float scale_over_cap = 0.f, cap_log2 = 0.f;

  SoftcapLog2() = default;
  __device__ __forceinline__ explicit SoftcapLog2(const AttentionProblem& p)
      : scale_over_cap(static_cast<float>(p.scale / p.softcap)), cap_log2(static_cast<float>(p.softcap * M_LOG2E)) {}

  // With tanh.approx (FlashAttention's choice, the Hopper kernels'): a logit of
  // 10 moves by up to 0.005, one of 50 by 0.025, against probabilities rounded
  // to 16 bits anyway; tanhf ran the Hopper forward at 0.47x the speed of no
  // softcap, tanh.approx at 0.72x (H200, bf16, D=128, N=8192).
  __device__ __forceinline__ float cap_approx(float x) const { return cap_log2 * ptx::tanh_approx(x * scale_over_cap); }
  // With tanhf (the decode kernels, bound by memory).
  __device__ __forceinline__ float cap(float x) const { return cap_log2 * tanhf(x * scale_over_cap); }
};

// ALiBi's slope of (batch b, query head h) in log2 units: the scores less
// slope * |i + offset - j| (Visibility::distance); 0 without ALiBi.
__device__ __forceinline__ float alibi_slope_log2(const AttentionProblem& p, int64_t b, int64_t h) {
  return alibi_slope(p, b, h) * float(M_LOG2E);
}

}  // namespace flashattn_ext::cuda
