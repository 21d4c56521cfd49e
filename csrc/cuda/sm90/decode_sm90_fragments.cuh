// The Hopper decode kernel's operands (decode_sm90_kernel.cuh): where a
// lane's ldmatrix row lies in a stage, and how an FP8 (e4m3) cache's stages
// become float16 mma fragments (the queries scaled into float16's range).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ptx.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90::decode_kernel_code {

// Where a lane's ldmatrix row lies in a stage's K or V: 16-byte piece `piece`
// of the head dim (8 columns) of the pair whose first line is `line`
// (StageLayout), in the copy engine's 128-byte swizzle (a line's pieces
// permuted by the line's place in its 8).
__device__ __forceinline__ uint32_t swizzled(uint32_t base, int line, int piece) {
  line += piece / 8;
  return base + line * kSwizzleRowBytes + (((piece % 8) ^ (line % 8)) << 4);
}

// 2^k that brings `largest` (a query row's largest magnitude) to [2^14, 2^15):
// in float16's range (65504 at most) with its precision, which holds bfloat16's
// values exactly down to about 2^-31 of the largest. (Clamped to float's normal
// powers; infinity or NaN give 2^-114.)
__device__ __forceinline__ float power_of_two_into_half_range(float largest) {
  const int exponent = largest > 0.f || largest != largest ? int(__float_as_uint(largest) >> 23 & 0xff) - 127 : 0;
  const int shift = min(max(14 - exponent, -126), 127);
  return __uint_as_float(uint32_t(shift + 127) << 23);
}

// S += Q K^T over a warp's 16 pairs of an FP8 cache's stage. ldmatrix reads
// the e4m3 bytes as it reads 16-bit elements: of 8 pairs and 16 columns, a
// lane gets pair lane / 4's columns 4 (lane % 4) to + 3, converted into the B
// fragment's column pairs 2 (lane % 4) (the first two) and 2 (lane % 4) + 8:
// q_frag holds Q's columns in that order. (Lines and pieces as the 16-bit
// cache's, a 16-byte piece 16 columns.)
// The even and odd 16-column steps add into separate accumulators, summed at
// the end: chains of half the length of dependent mma's.
template <int kHeadDim>
__device__ __forceinline__ void qk_fp8(float (&s)[2][4], const uint32_t (&q_frag)[kHeadDim / 16][4],
                                       uint32_t k_base, int k_line, int k_piece) {
  float odd[2][4] = {};
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 32; ++kk) {
    uint32_t k8[4];  // pairs 0-7 and pieces 2 kk, 2 kk + 1; then pairs 8-15
    ptx::ldmatrix_x4(k8, swizzled(k_base, k_line, 2 * kk + k_piece));
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t x = k8[2 * nt + m];
        ptx::mma_16x8x16<__half>(m == 0 ? s[nt] : odd[nt], q_frag[2 * kk + m],
                                 ptx::e4m3x2_to_half2(static_cast<uint16_t>(x)),
                                 ptx::e4m3x2_to_half2(static_cast<uint16_t>(x >> 16)));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i / 4][i % 4] += odd[i / 4][i % 4];
}

// O += P V over a warp's 16 pairs of an FP8 cache's stage. ldmatrix.trans
// reads the e4m3 bytes as 16-bit elements, two columns each: of 8 pairs and
// 16 columns, a lane gets columns 2 (lane / 4) and the next of pairs
// 2 (lane % 4) and the next, which a byte permutation regroups into the even
// column's two pairs and the odd one's. So each 16 columns' first n tile
// (acc[2 i]) holds its even columns, the second its odd ones: a lane's
// columns 4 (lane % 4) to + 3 of each 16 in the order acc[2 i][0],
// acc[2 i + 1][0], acc[2 i][1], acc[2 i + 1][1] (rows + 8: [2], [3]).
// v_keep: as for the 16-bit cache's fragments (a pair's two bytes where it had
// its 16-bit element).
template <int kHeadDim>
__device__ __forceinline__ void pv_fp8(float (&acc)[kHeadDim / 8][4], const uint32_t (&p_frag)[4], uint32_t v_base,
                                       int v_line, int v_piece, const uint32_t (&v_keep)[2]) {
#pragma unroll
  for (int dp = 0; dp < kHeadDim / 32; ++dp) {
    uint32_t v8[4];  // pairs 0-7 and 8-15 of piece 2 dp; then of piece 2 dp + 1
    ptx::ldmatrix_x4_trans(v8, swizzled(v_base, v_line, 2 * dp + v_piece));
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      // bytes (pair, column) (0, 0) (0, 1) (1, 0) (1, 1) -> (0, 0) (1, 0) (0, 1) (1, 1)
      const uint32_t low_pairs = ptx::prmt(v8[2 * m] & v_keep[0], 0, 0x3120);
      const uint32_t high_pairs = ptx::prmt(v8[2 * m + 1] & v_keep[1], 0, 0x3120);
      const int piece = 2 * dp + m;
      ptx::mma_16x8x16<__half>(acc[2 * piece], p_frag, ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs)),
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs)));
      ptx::mma_16x8x16<__half>(acc[2 * piece + 1], p_frag,
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs >> 16)),
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs >> 16)));
    }
  }
}

}  // namespace flashattn_ext::cuda::sm90::decode_kernel_code
