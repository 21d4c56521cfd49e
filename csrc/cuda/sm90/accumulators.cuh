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
template <int kBlocks, int kRegs>
__device__ __forceinline__ void fence_registers(float (&regs)[kBlocks][kRegs]) {
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) fence_registers(regs[b]);
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

// The same in float8 e4m3, for 8-bit wgmma's k32 A fragments (a0: row r,
// k 4 (lane % 4) .. + 3; a1: row r + 8; a2, a3: k + 16), from the
// accumulator with no shuffle: a thread holds keys 2 (lane % 4) and the next
// of each 8-column tile, so a register takes two tiles' pairs, and the A
// fragment's k position p of each 32 columns holds column
// e4m3_fragment_column(p). The B operand's rows must be in that order
// (fp8_transpose_values).
template <int kRegs>
__device__ __forceinline__ void to_e4m3_fragments(const float (&x)[kRegs], uint32_t (&frag)[kRegs / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kRegs / 16; ++kk) {
    const float* t = &x[16 * kk];  // four 8-column tiles: registers 4 j .. 4 j + 3 of tile j
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int half = r % 2, tile = 2 * (r / 2);  // a0 / a2: row r (half 0), tiles 0, 1 / 2, 3
      frag[kk][r] = ptx::pack4_e4m3(t[4 * tile + 2 * half], t[4 * tile + 2 * half + 1], t[4 * tile + 4 + 2 * half],
                                    t[4 * tile + 4 + 2 * half + 1]);
    }
  }
}
// The column (key within its group of 32) that k position p of an e4m3 A
// fragment made by to_e4m3_fragments holds: p = 16 h + 4 c + i holds column
// 16 h + 2 c + i (i < 2) or 16 h + 8 + 2 c + i - 2.
__host__ __device__ constexpr int e4m3_fragment_column(int p) {
  return 16 * (p / 16) + 2 * ((p % 16) / 4) + (p % 4 < 2 ? p % 4 : 8 + p % 4 - 2);
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
