// The two descriptors of Hopper's asynchronous units: the shared-memory matrix
// descriptor a wgmma reads its operands through, and the tensor map (built on
// the host) through which the copy engine (TMA) loads tiles.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/ptx.cuh"
#include "cuda/sm90/tile_config.h"
#include "flash_params.h"

namespace flashattn_ext::cuda::sm90 {

// A wgmma shared-memory matrix descriptor for a tile stored in 128-byte
// swizzled rows (the layout the copy engine writes with
// CU_TENSOR_MAP_SWIZZLE_128B): start address (bits 0-13), leading byte offset
// (16-29), stride byte offset (32-45), all in 16-byte units, and the 128-byte
// swizzle mode (bits 62-63 = 1). For a K-major operand (Q, K: the reduction
// dim along the row) the stride byte offset steps between groups of 8 rows
// (one swizzle atom, 1024 bytes) and the leading one is unused; a k16 step
// inside a 64-column block moves the start address by 32 bytes. For an
// N-major operand (V in P V) the leading byte offset steps between 64-column
// blocks and the stride byte offset between groups of 8 rows (keys).
__device__ __forceinline__ uint64_t smem_matrix_desc(uint32_t smem_addr, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t(1) << 62;
}

// The same descriptor for an operand `bytes` further on in shared memory.
// Shared addresses stay below 256 KiB, so the start address field never
// overflows into the next: one add, where building the descriptor anew costs
// a mask, a shift and an or for every wgmma. Kernels build a tile's descriptor
// once and step it with this. (A 64-bit add: ptxas then steps both halves of
// a wgmma's descriptor with one UIADD3.64; adding to the low half alone, it
// moved the constant high half in again for every wgmma.)
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Where k16 step kk of a K-major operand starts, from its tile's start, the
// tile stored as 64-column blocks col_block_bytes apart.
__host__ __device__ constexpr uint32_t k_major_step_bytes(uint32_t col_block_bytes, int kk) {
  constexpr int kStepsPerBlock = kSwizzleCols / 16, kStepBytes = 16 * 2;
  return (kk / kStepsPerBlock) * col_block_bytes + (kk % kStepsPerBlock) * kStepBytes;
}
// And k16 step kk (16 rows) of an N-major operand.
__host__ __device__ constexpr uint32_t n_major_step_bytes(int kk) { return kk * 16 * kSwizzleRowBytes; }

// The descriptor of a K-major tile (at its first k16 step) starting at tile_addr.
__device__ __forceinline__ uint64_t k_major_desc(uint32_t tile_addr) {
  return smem_matrix_desc(tile_addr, 16, kSwizzleAtomBytes);
}
// A K-major descriptor (of a tile in 128-byte swizzled rows) turned to the
// same tile stored in 64-byte swizzled rows (CU_TENSOR_MAP_SWIZZLE_64B):
// swizzle mode 2 and 8-row groups of 512 bytes. The e4m3 forward's transposed
// values keep a key tile's last 64 keys so (its 192-key tiles).
__device__ __forceinline__ uint64_t as_swizzle64_k_major(uint64_t desc) {
  constexpr uint64_t kStrideAndMode = uint64_t{0x3FFF} << 32 | uint64_t{3} << 62;
  return (desc & ~kStrideAndMode) | uint64_t{8 * 64 >> 4} << 32 | uint64_t{2} << 62;
}
// The descriptor of an N-major tile stored as 64-column blocks col_block_bytes apart.
__device__ __forceinline__ uint64_t n_major_desc(uint32_t tile_addr, uint32_t col_block_bytes) {
  return smem_matrix_desc(tile_addr, col_block_bytes, kSwizzleAtomBytes);
}

// The dynamic shared memory rounded up to the swizzle pattern's period (the
// pattern is applied to absolute addresses, so tiles start 1024-byte aligned).
// Pointer arithmetic on the __shared__ array, not a round trip through an
// integer: the compiler then still knows the result is shared memory and
// emits LDS / STS rather than generic loads and stores.
__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* smem_raw) {
  return smem_raw + (kSwizzleAtomBytes - ptx::smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
}

// The element of a tensor the copy engine loads into swizzled tiles.
enum class MapElement { kFloat16, kBFloat16, kE4M3 };
template <typename Elem>
constexpr MapElement map_element() {
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) return MapElement::kBFloat16;
  if constexpr (std::is_same_v<Elem, __nv_fp8_e4m3>) return MapElement::kE4M3;
  return MapElement::kFloat16;
}

// Encodes a tensor map of one of the call's tensors (q, k, v, dout or out; V
// transposed for e4m3) seen as 4-d (col, row, head, batch): `cols` columns
// (its head dim), `rows` rows, `heads` heads, `batches` batches, t's strides,
// its columns contiguous. Its boxes are one 128-byte row of columns (64 16-bit
// elements, 128 e4m3) x box_rows rows of one (head, batch), 128-byte swizzled
// (box_row_bytes 64: 64-byte rows, 64-byte swizzled), out-of-range elements
// read as zero. Returns false where the copy engine
// cannot take the tensor (a stride not a multiple of 16 bytes or zero, a
// misaligned base, sizes past its limits, or no driver entry point); the
// caller then runs another kernel.
bool encode_tensor_map(CUtensorMap* map, const TensorView4d& t, int64_t cols, int64_t rows, int64_t heads,
                       int64_t batches, MapElement element, int box_rows, int box_row_bytes = kSwizzleRowBytes);

// A decoding step's cache element: the queries' dtype, or float8 e4m3.
enum class CacheElement { kFloat16, kBFloat16, kE4M3 };

// Encodes a tensor map of a decoding step's key or value cache (a
// TensorView4d of (sequence or block, head, row, col), rows of whole 128-byte
// lines: head_dim a multiple of 64, or of 128 for e4m3) seen as 5-d (col,
// line, head, row, sequence or block), or with heads_inner false (col, line,
// row, head, sequence or block): boxes of whole rows (every line) x box_heads
// heads x box_rows rows, stored in that order, 128-byte swizzled, without L2
// promotion (the cache is read once). A copy then reads whole rows: on an
// H100, 3.06-3.08 TB/s streamed where copies of 64-column halves read
// 2.99-3.01. False as encode_tensor_map.
bool encode_cache_tensor_map(CUtensorMap* map, const TensorView4d& cache, CacheElement element, int64_t head_dim,
                             int64_t rows, int64_t heads, int64_t outer, int box_heads, int box_rows,
                             bool heads_inner);

// The shape whose tensor maps encode_tensor_map makes: a dense call's, or a
// packed batch's one batch element of all its rows (rows_q: total_q, rows_k:
// total_k). fits: false where a packed batch's rows are past the 32-bit row
// coordinates of the blocks (box_rows at most).
struct MappedShape {
  AttentionProblem tensors;
  int64_t rows_q, rows_k;
  bool fits;
};
inline MappedShape mapped_shape(const AttentionProblem& p, const PackedSequences& packed, int box_rows) {
  if (!packed.present()) return {p, p.len_q, p.len_k, true};
  AttentionProblem tensors = p;
  tensors.batch = 1;
  const int64_t rows = std::max(packed.total_q, packed.total_k);
  return {tensors, packed.total_q, packed.total_k, rows < (int64_t{1} << 31) - box_rows};
}

// Which tile of an attn_mask goes with a tile of queries (tile_rows of them
// from row0, of one head and batch): the mask's rows of those queries
// (rows_full) or only its first row (a mask that repeats over queries, such
// as a key-padding mask); its head and batch, or the first where it repeats
// over those (step 0). In shared memory the tile is stored as blocks of
// 128-byte rows (128 / element size keys), 128-byte swizzled, block_bytes
// apart: a one-row tile's blocks each start a swizzle period.
struct MaskTileShape {
  bool rows_full = true;
  int head_step = 1, batch_step = 1;
  int box_rows = 0;     // rows of the tile: tile_rows, or 1
  int block_bytes = 0;  // from one block of the tile to the next

  // The bytes the copy engine writes for a tile of col_blocks blocks (0 without a mask).
  __host__ __device__ int tile_bytes(int col_blocks) const { return box_rows * kSwizzleRowBytes * col_blocks; }
};

// Encodes a tensor map of an attn_mask (elem_bytes 1: bool; 2: additive, 16
// bits) for tiles of tile_rows queries, seen as 4-d (key, row, head, batch)
// with one row, head or batch where it repeats over that dimension (stride 0,
// or a dimension of one), and sets *shape to match. Out-of-range elements read
// as zero (for a bool mask: hidden). Returns false as encode_tensor_map does,
// and where the mask's last dim is not contiguous.
bool encode_mask_tiles(CUtensorMap* map, MaskTileShape* shape, const TensorView4d& mask, int elem_bytes,
                       const AttentionProblem& p, int tile_rows);

}  // namespace flashattn_ext::cuda::sm90
