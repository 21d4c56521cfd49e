// The mma.sync kernels' tile work: loads of tiles into padded shared memory
// (cp.async) and the warp-level mma loops over them, with their ldmatrix lane
// offsets. Included by the sm80/ kernels (forward, backwards, decode) and their
// tile configs.
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"

namespace flashattn_ext::cuda {

// Shared-memory rows hold kHeadDim elements plus 8 of padding: the 16-byte
// shift per row puts the 8 rows that one ldmatrix phase reads in 8 different
// bank groups, so the reads are free of bank conflicts for any head dim.
template <int kHeadDim>
__host__ __device__ constexpr int smem_stride() {
  return kHeadDim + 8;
}

// Start an asynchronous copy of rows [row0, row0 + kRows) of one head into
// shared memory; rows at or past len, and columns at or past dim, read as 0.
// Each thread copies one fixed 16-byte column chunk of every kRowsPerPass-th
// row, so that a row step is one pointer increment: the index arithmetic of a
// flat loop over all chunks took more instructions than the copies themselves.
template <int kRows, int kHeadDim, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* head, int64_t stride_row, int64_t row0,
                                                int64_t len, int dim) {
  constexpr int kChunks = kHeadDim / 8;                                      // 16-byte chunks per row
  constexpr int kChunkSlots = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;  // threads per row, a power of two
  constexpr int kRowsPerPass = kThreads / kChunkSlots;
  static_assert(kChunks <= 32 && kThreads % kChunkSlots == 0 && kRows % kRowsPerPass == 0,
                "the tile must split into whole passes of the block's threads");
  const int r = threadIdx.x / kChunkSlots;
  const int c = (threadIdx.x % kChunkSlots) * 8;
  if (c >= kHeadDim) return;  // a slot past the row (head dim 96)
  // This thread's rows it * kRowsPerPass < rows_left exist.
  const int rows_left = static_cast<int>(min(len - row0 - r, int64_t(kRows)));
  const Elem* src = head + (row0 + r) * stride_row + c;
  Elem* dst = smem + r * smem_stride<kHeadDim>() + c;
  // Unrolled by up to 4: the hoisted addresses of 8 passes made the head-dim-128 forward spill.
  constexpr int kPasses = kRows / kRowsPerPass;
#pragma unroll(kPasses <= 4 ? kPasses : 4)
  for (int it = 0; it < kPasses; ++it) {
    const bool valid = it * kRowsPerPass < rows_left && c < dim;
    ptx::cp_async_16(dst + it * kRowsPerPass * smem_stride<kHeadDim>(), valid ? src : head, valid);
    src += kRowsPerPass * stride_row;
  }
}

// Lane offsets (in elements) of ldmatrix row addresses in a row-major tile of
// row stride kStride. For A fragments and for B read transposed: lanes 0-15
// give rows 0-15 at column 0, lanes 16-31 the same rows at column 8. For B read
// as is: lanes 0-7 and 16-23 give rows 0-7 and 8-15 at column 0, lanes 8-15
// and 24-31 the same rows at column 8.
template <int kStride>
__device__ __forceinline__ int a_lane_offset(int lane) {
  return (lane % 16) * kStride + (lane / 16) * 8;
}
template <int kStride>
__device__ __forceinline__ int b_lane_offset(int lane) {
  return (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
}

// How an mma operand tile sits in shared memory: kRowMajor keeps its M (for A)
// or N (for B) index along the rows and K along each row; kKMajor keeps K
// along the rows, so ldmatrix reads it transposed.
enum class Operand { kRowMajor, kKMajor };

// This lane's ldmatrix offset (elements) in an A or B operand tile of the given layout.
template <Operand kLayout, int kStride, bool kIsA>
__device__ __forceinline__ int operand_lane_offset(int lane) {
  return (kLayout == Operand::kRowMajor) == kIsA ? a_lane_offset<kStride>(lane) : b_lane_offset<kStride>(lane);
}

// acc += A B for a warp, A (kMTiles x 16 by kK) and B (kK by kNTiles x 8)
// both in shared memory, in the layouts kA and kB with row strides kStrideA
// and kStrideB (elements). a_frag and b_frag are this lane's ldmatrix
// addresses of their (0, 0) elements: the tiles' shared-space addresses plus
// operand_lane_offset, which callers in a loop compute once.
template <typename Elem, int kMTiles, int kNTiles, int kK, Operand kA, int kStrideA, Operand kB, int kStrideB>
__device__ __forceinline__ void mma_smem_fragments(float (&acc)[kMTiles][kNTiles][4], uint32_t a_frag,
                                                   uint32_t b_frag) {
  constexpr int kElemBytes = sizeof(Elem);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if constexpr (kA == Operand::kRowMajor) {
        ptx::ldmatrix_x4(a[mt], a_frag + (mt * 16 * kStrideA + kk * 16) * kElemBytes);
      } else {
        ptx::ldmatrix_x4_trans(a[mt], a_frag + (kk * 16 * kStrideA + mt * 16) * kElemBytes);
      }
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      if constexpr (kB == Operand::kRowMajor) {
        ptx::ldmatrix_x4(b, b_frag + (np * 16 * kStrideB + kk * 16) * kElemBytes);
      } else {
        ptx::ldmatrix_x4_trans(b, b_frag + (kk * 16 * kStrideB + np * 16) * kElemBytes);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The same from the tiles' shared-space addresses a_tile and b_tile.
template <typename Elem, int kMTiles, int kNTiles, int kK, Operand kA, int kStrideA, Operand kB, int kStrideB>
__device__ __forceinline__ void mma_smem_by_smem(float (&acc)[kMTiles][kNTiles][4], uint32_t a_tile,
                                                 uint32_t b_tile, int lane) {
  constexpr int kElemBytes = sizeof(Elem);
  mma_smem_fragments<Elem, kMTiles, kNTiles, kK, kA, kStrideA, kB, kStrideB>(
      acc, a_tile + operand_lane_offset<kA, kStrideA, true>(lane) * kElemBytes,
      b_tile + operand_lane_offset<kB, kStrideB, false>(lane) * kElemBytes);
}

// acc += A B^T with A and B both row-major (kMTiles x 16 and kNTiles x 8 rows
// of kK columns): the pattern of S = Q K^T. a_frag, b_frag as for mma_smem_fragments.
template <typename Elem, int kMTiles, int kNTiles, int kK, int kStride>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kMTiles][kNTiles][4], uint32_t a_frag,
                                                 uint32_t b_frag) {
  mma_smem_fragments<Elem, kMTiles, kNTiles, kK, Operand::kRowMajor, kStride, Operand::kRowMajor, kStride>(acc, a_frag,
                                                                                                         b_frag);
}

// acc += X B for a warp: X is kMTiles x 16 rows of kK columns held as float
// accumulators in registers (rounded to Elem on the way), B is kK rows of kN
// columns, row-major in shared memory and read transposed (b_frag from
// a_lane_offset). The pattern of O += P V: two adjacent n8 accumulator tiles
// are exactly the A fragment of one k16 step.
template <typename Elem, int kMTiles, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_regs_by_rows(float (&acc)[kMTiles][kN / 8][4],
                                                 const float (&x)[kMTiles][kK / 8][4], uint32_t b_frag) {
  constexpr int kElemBytes = sizeof(Elem);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      a[mt][0] = ptx::pack2<Elem>(x[mt][2 * kk][0], x[mt][2 * kk][1]);
      a[mt][1] = ptx::pack2<Elem>(x[mt][2 * kk][2], x[mt][2 * kk][3]);
      a[mt][2] = ptx::pack2<Elem>(x[mt][2 * kk + 1][0], x[mt][2 * kk + 1][1]);
      a[mt][3] = ptx::pack2<Elem>(x[mt][2 * kk + 1][2], x[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, b_frag + (kk * 16 * kStride + np * 16) * kElemBytes);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

}  // namespace flashattn_ext::cuda
