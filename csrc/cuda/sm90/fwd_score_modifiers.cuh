// What the Hopper forward does to a tile's scores between Q K^T and the
// softmax, in a consumer thread's registers (the wgmma accumulator layout:
// register i of a thread is row accumulator_row_offset(i) of its two,
// column accumulator_column(i, lane)):
//  - FwdScoreModifiers, built once a consumer thread: the scale, softcapping,
//    and an attn_mask's tile of each stage;
//  - FwdTileModifiers, built once a query tile: ALiBi's bias and the keys past
//    the end, the causal diagonal and a sliding window's edges.
// Scores are kept in log2 units: exp(x * scale) = exp2(x * scale * log2(e)).
// The kernel takes positive scales only, so the max of the unscaled scores
// times the scale is the max of the scaled ones: scaling and subtracting the
// max fold into one fma (the softmax's softmax_scale), where no modifier
// scales them first (softcap, ALiBi, an additive mask).
#pragma once

#include <cmath>

#include "cuda/score_modifiers.cuh"
#include "cuda/sm90/accumulators.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

template <typename Elem, typename Cfg, MaskKind kMask, bool kSoftcap>
struct FwdScoreModifiers {
  const float scale, scale_log2;
  // Softcapping: the scores capped as they come in (SoftcapLog2::capped_approx);
  // the softmax then takes them as they are.
  const SoftcapLog2 softcap;
  // attn_mask: this thread's values in a stage's mask tile are those of its
  // two rows (r and r + 8; in a one-row tile, both row 0) at its columns 8 j
  // + 2 (lane % 4) and the next (as its score registers 4 j + 2 half and the
  // next), in 128-byte rows whose 16-byte chunk c lies at chunk c ^ (row % 8).
  // Each column block of a one-row tile starts a 1024-byte swizzle period.
  const MaskTileShape& mask;
  const unsigned char* const mask_thread;
  const int mask_half_bytes, mask_swizzle_row;

  __device__ __forceinline__ FwdScoreModifiers(const FwdKernelParams& kp, const unsigned char* s_mask, int tile_row,
                                               int lane)
      : scale(static_cast<float>(kp.call.problem.scale)),
        scale_log2(score_scale_log2(kp.call.problem)),
        softcap(kSoftcap ? SoftcapLog2(kp.call.problem) : SoftcapLog2()),
        mask(kp.mask),
        mask_thread(s_mask + (kp.mask.rows_full ? tile_row * kSwizzleRowBytes : 0) +
                    (lane % 4) * 2 * Cfg::Mask::kElemBytes),
        mask_half_bytes(kp.mask.rows_full ? 8 * kSwizzleRowBytes : 0),
        mask_swizzle_row(kp.mask.rows_full ? lane / 4 : 0) {}

  // The softmax's factor on the scores (1 where they come scaled).
  __device__ __forceinline__ float softmax_scale(bool scaled) const {
    return scaled ? 1.f : masked_scores_scale(kMask, scale_log2);
  }

  template <int kRegs>
  __device__ __forceinline__ void cap(float (&s)[kRegs]) const {
    if constexpr (kSoftcap) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) s[i] = softcap.capped_approx(s[i]);
    }
  }

  // Applies the mask tile of the kv-th K/V tile to s, in log2 units: a bool
  // mask sets the hidden scores to -inf; an additive one's scaled scores plus
  // its values.
  template <int kRegs>
  __device__ __forceinline__ void apply_attn_mask(float (&s)[kRegs], int kv) const {
    constexpr int kEb = Cfg::Mask::kElemBytes;
    const unsigned char* stage_mask = mask_thread + (kv % Cfg::kStages) * Cfg::Mask::kBytes;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      const int col_byte = 8 * j * kEb;  // the 8-key group's first byte
      const int block = col_byte / kSwizzleRowBytes, chunk = col_byte % kSwizzleRowBytes / 16;
      const int pair_offset = block * mask.block_bytes + (chunk ^ mask_swizzle_row) * 16 + col_byte % 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float& s0 = s[4 * j + 2 * half];
        float& s1 = s[4 * j + 2 * half + 1];
        const unsigned char* pair = stage_mask + pair_offset + half * mask_half_bytes;
        if constexpr (kMask == MaskKind::kBool) {
          const uint32_t keep = *reinterpret_cast<const uint16_t*>(pair);
          mask_score(s0, (keep & 0xff) != 0);
          mask_score(s1, (keep >> 8) != 0);
        } else {
          const float2 bias = ptx::unpack2<Elem>(*reinterpret_cast<const uint32_t*>(pair));
          mask_score(s0, bias.x, scale);
          mask_score(s1, bias.y, scale);
        }
      }
    }
  }

  // The attn_mask of the kv-th K/V tile on its scores, not read where it hides
  // none of the block's keys (an additive mask's values there are all 0).
  template <int kRegs>
  __device__ __forceinline__ void apply_stage_mask(float (&s)[kRegs], int kv, const StageBlock& block) const {
    if constexpr (Cfg::Mask::kPresent) {
      if (!block.unmasked) {
        apply_attn_mask(s, kv);
      } else if constexpr (kMask == MaskKind::kAdditive) {
#pragma unroll
        for (int i = 0; i < kRegs; ++i) mask_score(s[i], 0.f, scale);
      }
    }
  }
};

// A query tile's modifiers: its rows from row0 (this thread's tile_row and
// tile_row + 8 among them), the keys its queries see (seen), len_k keys.
template <typename Cfg, bool kWindow, bool kAlibi>
struct FwdTileModifiers {
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  const AttentionProblem& p;
  const Visibility& seen;
  const int64_t row0, len_k;
  const int tile_row, lane;
  const float scale_log2;
  // ALiBi: the scores scaled, less slope * |i + offset - j| (log2 units), as
  // they come in; the softmax then takes them as they are.
  const float alibi_log2;

  template <int kRegs>
  __device__ __forceinline__ void add_alibi(float (&s)[kRegs], int n_block) const {
    if constexpr (kAlibi) {
      // i + offset - j at the tile's (0, 0): 32 bits, as the tile coordinates.
      const int corner = static_cast<int>(row0 + seen.offset - int64_t(n_block) * kBlockN);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const int c = accumulator_column(i, lane), r = tile_row + accumulator_row_offset(i);
        s[i] = fmaf(s[i], scale_log2, alibi_bias(alibi_log2, fabsf(static_cast<float>(corner + r - c))));
      }
    }
  }

  // Masks keys past the end, right of the causal diagonal or of the window's
  // right edge, and left of its left edge (to -inf): only the tiles for which
  // needs_mask holds have any.
  __device__ __forceinline__ bool needs_mask(int n_block) const {
    const int64_t col0 = int64_t(n_block) * kBlockN;
    const bool crosses_edge = kWindow ? seen.tile_is_partial(row0, kBlockM, col0, kBlockN)
                                      : p.is_causal && col0 + kBlockN - 1 > row0 + seen.offset;
    return col0 + kBlockN > len_k || crosses_edge;
  }
  // In 32-bit tile coordinates: key c of the tile is past the end when c >=
  // keys_left; right of the edge (col0 + c > row0 + r + offset + right) when
  // c - r > right_edge, left of it (col0 + c < row0 + r + offset - left)
  // when c - r < left_edge.
  template <int kRegs>
  __device__ __forceinline__ void mask(float (&s)[kRegs], int n_block) const {
    const int64_t col0 = int64_t(n_block) * kBlockN;
    const int keys_left = static_cast<int>(min(len_k - col0, int64_t(kBlockN)));
    auto in_tile = [](int64_t d) { return static_cast<int>(clamp_index(d, -kBlockM, kBlockN)); };
    const int right_edge = seen.right < 0 ? kBlockN : in_tile(row0 + seen.offset + seen.right - col0);
    const int left_edge = kWindow && seen.left >= 0 ? in_tile(row0 + seen.offset - seen.left - col0) : -kBlockM;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int c = accumulator_column(i, lane), r = tile_row + accumulator_row_offset(i);
      if (c >= keys_left || c - r > right_edge || (kWindow && c - r < left_edge)) s[i] = -INFINITY;
    }
  }
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
