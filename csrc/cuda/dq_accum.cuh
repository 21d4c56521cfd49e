// The layouts of the backwards' float32 dQ accumulator (dq_accum): rows with
// permuted columns for the mma.sync atomic backward, wgmma register order for
// the Hopper backward, and a packed batch's rows. Included by dq_accum.cu (its
// size and conversion into dq), the backwards that accumulate dQ atomically
// (sm80/flash_bwd_atomic.cu, the Hopper backward) and both tile configs.
#pragma once

#include <cstdint>

#include "dropout.h"  // FLASHATTN_EXT_HOST_DEVICE

namespace flashattn_ext::cuda {

// The float32 dQ accumulator of the atomic backwards (both families): shaped
// (batch, heads_q, len_q rounded up to kDqAccumRowMultiple, dq_accum_cols of
// the specialized head dim), zero-filled, and scaled and rounded into dq by
// convert_dq_accum. The columns of each group of 16 are permuted so that a
// lane's values of two adjacent n8 accumulator tiles lie side by side: one
// red.global.add.v4 adds them, half the atomic instructions of pairs (which
// crowd the memory queue). Column nt * 8 + q * 2 + e of a group (nt < 2, q < 4,
// e < 2) is kept at q * 4 + nt * 2 + e.
constexpr int kDqAccumRowMultiple = 64;
// dq_accum's floats a row for a head dim that dispatch_head_dim specializes:
// whole 64-column slices (the Hopper backward runs head dims 65 to 96 in its
// 128 kernel), so both families' layouts have one shape.
__host__ __device__ constexpr int dq_accum_cols(int specialized_head_dim) {
  return (specialized_head_dim + 63) / 64 * 64;
}
__host__ __device__ constexpr int dq_accum_column(int col) {
  return col / 16 * 16 + (col / 2) % 4 * 4 + (col / 8) % 2 * 2 + col % 2;
}

// The Hopper backward's dq_accum (DqAccumLayout::kWgmmaTiles) has the same
// shape, but within each kDqAccumRowMultiple-row tile the floats follow the
// register order of wgmma's accumulator, so that its shared-memory stores of
// dQ are conflict-free and the copy engine adds them as they lie. A tile is
// slices of kDqAccumSliceCols columns one after the other (each the 64 x 64
// dQ block of one consumer warpgroup); in a slice, thread t of the warpgroup
// keeps its registers 4j .. 4j + 3 (rows r and r + 8, columns 8j + c and
// 8j + c + 1 of its accumulator) at floats 4 (128 j + t) .. 4 (128 j + t) + 3.
// dq_accum_quad: where quad q of a tile (its floats 4q .. 4q + 3) lies: rows
// row and row + 8, columns col and col + 1.
constexpr int kDqAccumSliceCols = 64;
struct DqAccumQuad {
  int row, col;
};
__host__ __device__ constexpr DqAccumQuad dq_accum_quad(int quad) {
  constexpr int kSliceQuads = kDqAccumRowMultiple * kDqAccumSliceCols / 4;
  const int slice = quad / kSliceQuads, j = quad % kSliceQuads / 128, t = quad % 128;
  return {(t / 32) * 16 + (t % 32) / 4, slice * kDqAccumSliceCols + j * 8 + (t % 4) * 2};
}

// A packed batch's dq_accum (the atomic backwards' float32 dQ): each query
// head's rows as a dense call's of one batch element and
// packed_dq_accum_start(total_q, sequences) rows, sequence b's from
// packed_dq_accum_start(its first row, b) on. Each sequence's rows then start
// a tile, and its tiles end before the next sequence's start (the 64 rows a
// sequence adds cover its last tile's padding).
FLASHATTN_EXT_HOST_DEVICE int64_t packed_dq_accum_start(int64_t q_start, int64_t b) {
  return (q_start + kDqAccumRowMultiple - 1) / kDqAccumRowMultiple * kDqAccumRowMultiple + b * kDqAccumRowMultiple;
}

}  // namespace flashattn_ext::cuda
