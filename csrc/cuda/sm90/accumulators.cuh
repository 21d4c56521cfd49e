// A thread's registers of a wgmma accumulator, and the helpers both Hopper
// kernels use on them. A warpgroup's 64 x N float accumulator gives each
// thread N / 2 registers, laid out as mma.sync's 16 x 8 tiles over its warp's
// 16 rows: register i is row lane / 4 + accumulator_row_offset(i) and column
// accumulator_column(i, lane).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda::sm90 {

__device__ __forceinline__ int accumulator_column(int i, int lane) { return (i / 4) * 8 + (lane % 4) * 2 + i % 2; }
__device__ __forceinline__ int accumulator_row_offset(int i) { return ((i / 2) % 2) * 8; }

// Keep the compiler from moving reads or writes of these registers across the
// asynchronous wgmma that own them (no instruction).
template <int kRegs>
__device__ __forceinline__ void fence_registers(float (&regs)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) ptx::fence_register(regs[i]);
}
template <int kSteps>
__device__ __forceinline__ void fence_registers(uint32_t (&frags)[kSteps][4]) {
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) ptx::fence_register(frags[i][r]);
  }
}

// An accumulator (kRegs floats) rounded to Elem as wgmma A fragments: two
// adjacent 8-column tiles are one k16 step.
template <typename Elem, int kRegs>
__device__ __forceinline__ void to_fragments(const float (&x)[kRegs], uint32_t (&frag)[kRegs / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kRegs / 8; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) frag[kk][r] = ptx::pack2<Elem>(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);
  }
}

// Element i of an accumulator that to_fragments rounded into frag, as a float.
template <typename Elem, int kSteps>
__device__ __forceinline__ float from_fragments(const uint32_t (&frag)[kSteps][4], int i) {
  const uint32_t pair = frag[i / 8][(i % 8) / 2];
  const auto bits = static_cast<uint16_t>(i % 2 ? pair >> 16 : pair & 0xffffu);
  return ptx::to_float(*reinterpret_cast<const Elem*>(&bits));
}

// attn_mask on one raw score s (Q K^T, not yet scaled), as both kernels apply
// it before their exp2: where a bool mask hides the pair, s becomes -inf (the
// other scores stay as they are, for the softmax to scale); an additive
// mask's value is added to the scaled score (natural-log units, one fma), and
// the softmax's own scale then only turns s into log2 units
// (masked_scores_scale).
__device__ __forceinline__ void mask_score(float& s, bool keep) {
  if (!keep) s = -INFINITY;
}
__device__ __forceinline__ void mask_score(float& s, float bias, float scale) { s = fmaf(s, scale, bias); }
// The scale (to log2 units) the softmax applies to scores that mask_score saw.
__device__ __forceinline__ float masked_scores_scale(MaskKind kind, float scale_log2) {
  return kind == MaskKind::kAdditive ? float(M_LOG2E) : scale_log2;
}

}  // namespace flashattn_ext::cuda::sm90
