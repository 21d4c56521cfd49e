// The Hopper decode kernel's operands (decode_sm90_kernel.cuh): where a
// lane's ldmatrix row lies in a stage, and how an FP8 (e4m3) cache's stages
// become float16 mma fragments (the queries scaled into float16's range), with
// the queries' rows or (up to 8 of them) the keys as the mma's rows.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/launch.cuh"
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

// Of the ldmatrix.trans registers v8 of an FP8 cache's V (pv_fp8), matrix
// pair m's bytes regrouped: (pair, column) (0, 0) (0, 1) (1, 0) (1, 1) ->
// (0, 0) (1, 0) (0, 1) (1, 1), for pairs 0-7 and 8-15, each pair's bytes kept
// only within the keys (v_keep).
struct ValueBytes {
  uint32_t low_pairs, high_pairs;
};
__device__ __forceinline__ ValueBytes regrouped_values(const uint32_t (&v8)[4], int m, const uint32_t (&v_keep)[2]) {
  return {ptx::prmt(v8[2 * m] & v_keep[0], 0, 0x3120), ptx::prmt(v8[2 * m + 1] & v_keep[1], 0, 0x3120)};
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
      const auto [low_pairs, high_pairs] = regrouped_values(v8, m, v_keep);
      const int piece = 2 * dp + m;
      ptx::mma_16x8x16<__half>(acc[2 * piece], p_frag, ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs)),
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs)));
      ptx::mma_16x8x16<__half>(acc[2 * piece + 1], p_frag,
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs >> 16)),
                               ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs >> 16)));
    }
  }
}


// The keys as the mma's rows (Cfg::kKeysAsRows): S^T += K Q^T over a warp's
// 16 pairs of an FP8 cache's stage. K's fragments are qk_fp8's, now the A
// operand (pairs lane / 4 and + 8); q_frag[ks][0] and [2] hold query row
// lane / 4's columns in qk_fp8's order, the B operand. st: pairs lane / 4
// (st[0], st[1]) and + 8 (st[2], st[3]) by query rows 2 (lane % 4) and + 1.
template <int kHeadDim>
__device__ __forceinline__ void qk_fp8_keys_as_rows(float (&st)[4], const uint32_t (&q_frag)[kHeadDim / 16][4],
                                                    uint32_t k_base, int k_line, int k_piece) {
  float odd[4] = {};
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 32; ++kk) {
    uint32_t k8[4];  // pairs 0-7 and pieces 2 kk, 2 kk + 1; then pairs 8-15
    ptx::ldmatrix_x4(k8, swizzled(k_base, k_line, 2 * kk + k_piece));
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const uint32_t a[4] = {ptx::e4m3x2_to_half2(static_cast<uint16_t>(k8[m])),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(k8[2 + m])),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(k8[m] >> 16)),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(k8[2 + m] >> 16))};
      ptx::mma_16x8x16<__half>(m == 0 ? st : odd, a, q_frag[2 * kk + m][0], q_frag[2 * kk + m][2]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) st[e] += odd[e];
}

// The online softmax over S^T's 16 pairs (qk_fp8_keys_as_rows): a query row
// (a column) lives in the 8 lanes of a lane % 4; acc (O^T, pv_fp8_keys_as_rows)
// has row 2 (lane % 4) in [0] and [2], the next in [1] and [3].
template <int kPieces>
__device__ __forceinline__ void online_softmax_keys_as_rows(float (&st)[4], float (&row_max)[2], float (&row_sum)[2],
                                                            float (&acc)[kPieces][4]) {
  float rescales[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = fmaxf(st[half], st[half + 2]);
#pragma unroll
    for (int lanes = 4; lanes < kWarpSize; lanes *= 2) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, lanes));
    }
    const float new_max = fmaxf(row_max[half], tile_max);
    const float max_used = new_max == -INFINITY ? 0.f : new_max;  // (as online_softmax)
    rescales[half] = ptx::exp2_approx(row_max[half] - max_used);
    row_max[half] = new_max;
    st[half] = ptx::exp2_approx(st[half] - max_used);
    st[half + 2] = ptx::exp2_approx(st[half + 2] - max_used);
    row_sum[half] = row_sum[half] * rescales[half] + st[half] + st[half + 2];  // this lane's partial sum
  }
  if (__any_sync(0xffffffff, rescales[0] != 1.f || rescales[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] *= rescales[e % 2];
    }
  }
}

// O^T += V^T P^T over a warp's 16 pairs of an FP8 cache's stage (the keys as
// the mma's rows). V's bytes as pv_fp8 reads and regroups them, now the A
// operand: of each 16 columns the even ones its rows 0-7, the odd ones 8-15.
// p_b: P^T's B fragments (P's rows for query row lane / 4: movmatrix of S^T).
// acc[i]: columns 16 i + 2 (lane / 4) ([0], [1]) and the next ([2], [3]), for
// query rows 2 (lane % 4) ([0], [2]) and + 1 ([1], [3]).
template <int kHeadDim>
__device__ __forceinline__ void pv_fp8_keys_as_rows(float (&acc)[kHeadDim / 16][4], const uint32_t (&p_b)[2],
                                                    uint32_t v_base, int v_line, int v_piece,
                                                    const uint32_t (&v_keep)[2]) {
#pragma unroll
  for (int dp = 0; dp < kHeadDim / 32; ++dp) {
    uint32_t v8[4];  // pairs 0-7 and 8-15 of piece 2 dp; then of piece 2 dp + 1
    ptx::ldmatrix_x4_trans(v8, swizzled(v_base, v_line, 2 * dp + v_piece));
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const auto [low_pairs, high_pairs] = regrouped_values(v8, m, v_keep);
      const uint32_t a[4] = {ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs)),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(low_pairs >> 16)),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs)),
                             ptx::e4m3x2_to_half2(static_cast<uint16_t>(high_pairs >> 16))};
      ptx::mma_16x8x16<__half>(acc[2 * dp + m], a, p_b[0], p_b[1]);
    }
  }
}

}  // namespace flashattn_ext::cuda::sm90::decode_kernel_code
