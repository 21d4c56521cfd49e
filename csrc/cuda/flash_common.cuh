// Pieces shared by the forward and backward kernels: tile loads into padded
// shared memory and the index arithmetic of a flattened grid.
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda {

constexpr int kWarpSize = 32;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared-memory rows hold kHeadDim elements plus 8 of padding: the 16-byte
// shift per row puts the 8 rows that one ldmatrix phase reads in 8 different
// bank groups, so the reads are free of bank conflicts for any head dim.
template <int kHeadDim>
__host__ __device__ constexpr int smem_stride() {
  return kHeadDim + 8;
}

// Start an asynchronous copy of rows [row0, row0 + kRows) of one head into
// shared memory; rows at or past len, and columns at or past dim, read as 0.
template <int kRows, int kHeadDim, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* head, int64_t stride_row, int64_t row0,
                                                int64_t len, int dim) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    const bool valid = row0 + r < len && c < dim;
    const Elem* src = valid ? head + (row0 + r) * stride_row + c : head;
    ptx::cp_async_16(smem + r * smem_stride<kHeadDim>() + c, src, valid);
  }
}

// The first element of head (b, h) of a tensor.
template <typename Elem>
__device__ __forceinline__ Elem* head_ptr(const TensorView4d& t, int64_t b, int64_t h) {
  return static_cast<Elem*>(t.data) + b * t.stride_batch + h * t.stride_head;
}

// Causal visibility: query i sees key j iff j <= i + offset (offset 0 for
// top-left alignment, len_k - len_q for bottom-right).
__device__ __forceinline__ int64_t causal_offset(const AttentionProblem& p) {
  return p.causal_lower_right ? p.len_k - p.len_q : 0;
}

}  // namespace flashattn_ext::cuda
