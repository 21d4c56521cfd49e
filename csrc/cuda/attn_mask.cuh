// The attn_mask in the kernels: a tile's visibility from the mask's block map,
// one head's mask read element by element, and the additive mask's gradient.
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

// The attn_mask of one (batch, query head), read in place through its strides
// (0 where it broadcasts), one element at a time: rare enough a path that the
// reads need no layout of their own.
template <typename Elem>
struct HeadMask {
  MaskKind kind;
  const char* base;
  int64_t stride_row, stride_col;

  __device__ __forceinline__ HeadMask(MaskKind kind_, const TensorView4d& mask, int64_t b, int64_t h)
      : kind(kind_), stride_row(mask.stride_row), stride_col(mask.stride_col) {
    const int64_t elem_size = kind == MaskKind::kBool ? sizeof(bool) : sizeof(Elem);
    base = static_cast<const char*>(mask.data) + (b * mask.stride_batch + h * mask.stride_head) * elem_size;
  }

  // A score of query row i and key j in log2 units, with the mask applied: -inf
  // where a bool mask is false; plus the additive mask, times log2(e).
  __device__ __forceinline__ float apply(float score, int64_t i, int64_t j) const {
    const int64_t offset = i * stride_row + j * stride_col;
    if (kind == MaskKind::kBool) return reinterpret_cast<const bool*>(base)[offset] ? score : -INFINITY;
    return score + ptx::to_float(reinterpret_cast<const Elem*>(base)[offset]) * float(M_LOG2E);
  }
};

// Writes the gradient of an additive mask for query row i and key j (dS there).
template <typename Elem>
__device__ __forceinline__ void store_mask_grad(const TensorView4d& dmask, int64_t b, int64_t h, int64_t i, int64_t j,
                                                float ds) {
  static_cast<Elem*>(dmask.data)[b * dmask.stride_batch + h * dmask.stride_head + i * dmask.stride_row +
                                 j * dmask.stride_col] = ptx::from_float<Elem>(ds);
}

}  // namespace flashattn_ext::cuda
