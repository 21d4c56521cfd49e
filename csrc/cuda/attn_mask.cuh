// The attn_mask in the kernels: a tile's visibility from the mask's block map,
// and the additive mask's gradient (its element test: HeadMaskLog2,
// score_modifiers.cuh).
// Included by the forwards and backwards of both families.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/flash_cuda.h"
#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda {

// What the attn_mask does to the tile of `rows` queries from row0 (a multiple
// of kMaskBlockRows; rows past len_q do not count) and key block key_block of
// (batch b, query head): the map's blocks combined, hidden or visible where
// they all are, else partial.
__device__ __forceinline__ BlockVisibility tile_visibility(const MaskBlockMap& map, int64_t b, int64_t head,
                                                           int64_t row0, int rows, int64_t len_q,
                                                           int64_t key_block) {
  if (map.visibility == nullptr) return BlockVisibility::kPartial;
  const uint8_t* blocks = map.visibility + b * map.stride_batch + head * map.stride_head + key_block;
  const uint8_t first = blocks[row0 / kMaskBlockRows * map.stride_rows];
  if (map.stride_rows != 0) {
    const int64_t end = (min(row0 + rows, len_q) - 1) / kMaskBlockRows;
    for (int64_t r = row0 / kMaskBlockRows + 1; r <= end; ++r) {
      if (blocks[r * map.stride_rows] != first) return BlockVisibility::kPartial;
    }
  }
  return static_cast<BlockVisibility>(first);
}

// Writes the gradient of an additive mask for query row i and key j (dS there).
template <typename Elem>
__device__ __forceinline__ void store_mask_grad(const TensorView4d& dmask, int64_t b, int64_t h, int64_t i, int64_t j,
                                                float ds) {
  static_cast<Elem*>(dmask.data)[b * dmask.stride_batch + h * dmask.stride_head + i * dmask.stride_row +
                                 j * dmask.stride_col] = ptx::from_float<Elem>(ds);
}

}  // namespace flashattn_ext::cuda
