// The Hopper forward's online softmax, of a consumer thread's two query rows
// (r and r + 8 of its warp's 16) over the key tiles of a query tile, in
// registers: a tile's max, the running max and sum, the probabilities, and
// the rows' log-sum-exp at the end.
#pragma once

#include <cmath>

#include "cuda/ptx.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// Rescales (with the row's factor) and adds: the two rows of a thread are
// e / 2 == 0 and e / 2 == 1 of each 4-register accumulator tile.
template <int kRegs>
__device__ __forceinline__ void scale_rows(float (&acc)[kRegs], const float (&factor)[2]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] *= factor[(i / 2) % 2];
}

// The max of each of a thread's two rows of a score tile (registers 4 j +
// 2 half and 4 j + 2 half + 1), over four independent chains of fmaxf each.
template <int kRegs>
__device__ __forceinline__ void rows_max(const float (&s)[kRegs], float (&row_max)[2]) {
  static_assert(kRegs % 8 == 0, "two 4-register tiles a chain to start from");
  float chain[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int c = 0; c < 4; ++c) chain[half][c] = s[4 * (c / 2) + 2 * half + c % 2];
  }
#pragma unroll
  for (int j = 2; j < kRegs / 4; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& c = chain[half][(j % 2) * 2 + e];
        c = fmaxf(c, s[4 * j + 2 * half + e]);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_max[half] = fmaxf(fmaxf(chain[half][0], chain[half][1]), fmaxf(chain[half][2], chain[half][3]));
  }
}

// The online softmax of one tile (step): turns s into unnormalized
// probabilities and returns whether any row of the warp moved its running max
// (only then does the output so far need its rows' rescale factors). It is
// lazy about the max: a row's running max moves only where the tile's exceeds
// it by more than kMaxGrowth (log2 units), and the exps are taken against it
// as it stands otherwise. The probabilities then stay below 2^kMaxGrowth (the
// same sums and output, against another reference), and most tiles leave the
// output unscaled: measured 1-3% faster than moving it every tile (H100).
// Probabilities rounded to e4m3 (kE4M3) are taken against the exact max and
// 2^8 larger: a row's largest is then exactly 256 (e4m3 holds it; a lagging
// max would round it by up to 2^-4, and with it an output that one key
// dominates), and e4m3's 3 mantissa bits, which it keeps only from 2^-6 up,
// reach keys down to 2^-14 of the max. The sums carry the same factor, so
// 1 / sum cancels it, and the lse takes it out.
// The tile's max comes first, from independent chains (rows_max): the
// compiler keeps the order of fmaxf and of float adds as written, and one
// chain through a row's scores is latency the exps wait for.
// Scores come in log2 units, times softmax_scale (1 where they come scaled).
template <bool kE4M3 = false>
struct FwdOnlineSoftmax {
  static constexpr float kMaxGrowth = kE4M3 ? 0.f : 8.f;
  static constexpr float kProbShift = kE4M3 ? 8.f : 0.f;
  float softmax_scale;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  template <int kRegs>
  __device__ __forceinline__ bool step(float (&s)[kRegs], float (&rescale)[2]) {
    float tile_max[2];
    rows_max(s, tile_max);
#pragma unroll
    for (int lanes = 1; lanes <= 2; lanes *= 2) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffff, tile_max[half], lanes));
      }
    }
    bool moved = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float new_max = tile_max[half] * softmax_scale;
      rescale[half] = 1.f;
      if (new_max > row_max[half] + kMaxGrowth) {  // (from -inf, a row's first visible key)
        rescale[half] = ptx::exp2_approx(row_max[half] - new_max);
        row_max[half] = new_max;
        moved = true;
      }
      // A row with nothing visible yet keeps max -inf; subtract 0 instead so
      // that exp2(-inf - max) stays 0 rather than NaN.
      const float max_used = row_max[half] == -INFINITY ? 0.f : row_max[half] - kProbShift;
      float tile_sum[2] = {0.f, 0.f};  // two chains, as for the max
#pragma unroll
      for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[4 * j + e] = ptx::exp2_approx(fmaf(s[4 * j + e], softmax_scale, -max_used));
          tile_sum[j % 2] += s[4 * j + e];
        }
      }
      row_sum[half] = row_sum[half] * rescale[half] + (tile_sum[0] + tile_sum[1]);
    }
    return __any_sync(0xffffffff, moved);
  }

  // The rows' final sums: writes the log-sum-exp of rows row and row + 8 to
  // lse_rows (those before len_q) and sets inv_sum to keep_scale / sum
  // (dropout's 1 / (1 - p), else 1; rows that saw no key: -inf and 0).
  __device__ __forceinline__ void finish(float (&inv_sum)[2], float keep_scale, float* lse_rows, int64_t row,
                                         int64_t len_q, int lane) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[half];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      inv_sum[half] = sum > 0.f ? keep_scale / sum : 0.f;
      if (lane % 4 == 0 && row + half * 8 < len_q) {
        const float log2_sum_exp = row_max[half] - kProbShift + log2f(sum);
        lse_rows[row + half * 8] = sum > 0.f ? log2_sum_exp * float(M_LN2) : -INFINITY;
      }
    }
  }
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
