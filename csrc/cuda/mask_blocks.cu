// Two passes over an attn_mask, before the kernels that read it:
//  - The block map: for each (batch, head) of the mask, each block of
//    kMaskBlockRows query rows (one block of all of them where the mask
//    repeats over queries, such as a key-padding mask) and each block of
//    kKeyBlockKeys keys, whether the mask hides all of its pairs, none, or some
//    (BlockVisibility). The Hopper kernels skip hidden tiles (no loads, no
//    GEMMs) and run the unmasked code on visible ones: FlexAttention's
//    BlockMask, built without the user's help. One pass over the mask's own
//    elements, before the forward and again before the backward.
//  - Before a decoding step's forward that the decode kernels take (a dense
//    call with a bool mask, cuda/route.cpp), each sequence's key extent: one
//    past the last key that the mask leaves visible to any of its rows, so
//    that the kernels read no further (a static cache's unused slots).
//  - Before the backward, the query rows that the mask leaves exactly one key:
//    their delta becomes kOneKeyRowDelta (visibility.cuh), which the masked
//    backward kernels read as dS = 0.
#include <algorithm>
#include <cstdint>

#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda {
namespace {

// The map's extent: the mask's batches, heads and query blocks where it has
// its own (else 1), and the key blocks.
struct MapShape {
  int64_t batches, heads, row_blocks, key_blocks;
  int64_t bytes() const { return batches * heads * row_blocks * key_blocks; }
};

MapShape map_shape(const TensorView4d& mask, const AttentionProblem& p) {
  const MaskDims own = mask_dims(mask, p);
  return {own.batch ? p.batch : 1, own.heads ? p.heads_q : 1,
          own.rows ? (p.len_q + kMaskBlockRows - 1) / kMaskBlockRows : 1,
          (p.len_k + kKeyBlockKeys - 1) / kKeyBlockKeys};
}

// The 16-bit additive values that hide a key wherever they stand: -inf, and
// bfloat16's lowest finite value (torch.finfo(torch.bfloat16).min, as some
// transformers versions build masks). A score plus that value, scaled into
// log2 units, overflows to -inf in the kernels, as in SDPA's GPU kernels (the
// same output measured on an H200: 0 in a row of it alone, where float64
// would average the values). float16's lowest (-65504) does not hide in a row
// of it alone (the softmax of the row's scores, in SDPA too), so it is not one.
struct HidingValues {
  uint16_t minus_infinity, lowest;
};
HidingValues hiding_values(ElementType type) {
  return type == ElementType::kBFloat16 ? HidingValues{0xff80, 0xff7f} : HidingValues{0xfc00, 0xfc00};
}

// Whether the mask's element at offset (elements) hides its key: a bool mask
// where it is false, an additive one (16-bit float) where it is one of `hiding`.
__device__ __forceinline__ bool hides_key(const TensorView4d& mask, bool additive, HidingValues hiding,
                                          int64_t offset) {
  if (!additive) return static_cast<const uint8_t*>(mask.data)[offset] == 0;
  const uint16_t bits = static_cast<const uint16_t*>(mask.data)[offset];
  return bits == hiding.minus_infinity || bits == hiding.lowest;
}

// One thread block of kKeyBlockKeys threads a block of the map (grid: key
// blocks, query blocks, batches x heads), a key a thread, down the block's
// rows (the mask's first row alone where it repeats over queries: `rows` 1,
// its row stride unused). Keys and rows past the ends count neither way.
__global__ void __launch_bounds__(kKeyBlockKeys)
    classify_mask_blocks_kernel(TensorView4d mask, bool additive, HidingValues hiding, int64_t len_k,
                                int64_t rows, int64_t heads, uint8_t* map) {
  const int64_t key = int64_t(blockIdx.x) * kKeyBlockKeys + threadIdx.x;
  const int64_t row0 = int64_t(blockIdx.y) * kMaskBlockRows, row_end = min(row0 + kMaskBlockRows, rows);
  const int64_t head = blockIdx.z % heads, batch = blockIdx.z / heads;
  bool hidden = true, visible = true;
  if (key < len_k) {
    const int64_t base = batch * mask.stride_batch + head * mask.stride_head + key * mask.stride_col;
#pragma unroll 8
    for (int64_t row = row0; row < row_end; ++row) {
      const int64_t offset = base + row * mask.stride_row;
      const bool hides = hides_key(mask, additive, hiding, offset);
      hidden &= hides;
      // (An additive value leaves the score as it is only where it is +-0.)
      visible &= additive ? (static_cast<const uint16_t*>(mask.data)[offset] & 0x7fff) == 0 : !hides;
    }
  }
  const bool all_hidden = __syncthreads_and(hidden), all_visible = __syncthreads_and(visible);
  if (threadIdx.x == 0) {
    const BlockVisibility visibility = all_hidden    ? BlockVisibility::kHidden
                                       : all_visible ? BlockVisibility::kVisible
                                                     : BlockVisibility::kPartial;
    map[(int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = static_cast<uint8_t>(visibility);
  }
}

// One thread block per row of the mask that has its own values (one (batch,
// head, query) where the mask has all three; a single row for all queries of a
// key-padding mask: MaskDims), counting the keys it leaves visible,
// kOneKeyThreads at a time, until it has seen two (most rows do in the first
// sweep). Where it saw exactly one, every query row that the mask row applies
// to gets delta = kOneKeyRowDelta.
constexpr int kOneKeyThreads = 256;

__global__ void __launch_bounds__(kOneKeyThreads)
    mark_rows_seeing_one_key_kernel(TensorView4d mask, bool additive, HidingValues hiding, AttentionProblem p,
                                    MaskDims own, float* delta) {
  const int64_t batches = own.batch ? p.batch : 1, heads = own.heads ? p.heads_q : 1, rows = own.rows ? p.len_q : 1;
  for (int64_t index = blockIdx.x; index < batches * heads * rows; index += gridDim.x) {
    const int64_t row = index % rows, head = index / rows % heads, batch = index / (rows * heads);
    const int64_t base = batch * mask.stride_batch + head * mask.stride_head + row * mask.stride_row;
    int visible = 0;  // the same in every thread: the loop ends for all alike
    for (int64_t key0 = 0; key0 < p.len_k && visible < 2; key0 += kOneKeyThreads) {
      const int64_t key = key0 + threadIdx.x;
      visible += __syncthreads_count(key < p.len_k &&
                                     !hides_key(mask, additive, hiding, base + key * mask.stride_col));
    }
    if (visible != 1) continue;
    // The query rows it applies to: its own batch, head and row, or all of those it repeats over.
    const int64_t batch_count = own.batch ? 1 : p.batch, head_count = own.heads ? 1 : p.heads_q;
    const int64_t row_count = own.rows ? 1 : p.len_q;
    for (int64_t t = threadIdx.x; t < batch_count * head_count * row_count; t += kOneKeyThreads) {
      const int64_t i = own.rows ? row : t % row_count;
      const int64_t h = own.heads ? head : t / row_count % head_count;
      const int64_t b = own.batch ? batch : t / (row_count * head_count);
      delta[(b * p.heads_q + h) * p.len_q + i] = __uint_as_float(kOneKeyRowDelta);
    }
  }
}

// A thread takes kExtentKeys consecutive keys of every row of its batch that
// the mask has values of (a bool mask, its columns contiguous), from the last
// down to the first visible one; the block's largest extent goes into
// extents[batch] (zeros beforehand) with an atomic max. Grid: key blocks,
// batches (a loop where they outnumber the grid's y).
constexpr int kExtentThreads = 256, kExtentKeys = 16;

__global__ void __launch_bounds__(kExtentThreads)
    mask_key_extent_kernel(TensorView4d mask, int64_t batches, int64_t heads, int64_t rows, int64_t len_k,
                           int32_t* extents) {
  __shared__ int32_t block_extent;
  const int64_t key0 = (int64_t(blockIdx.x) * kExtentThreads + threadIdx.x) * kExtentKeys;
  for (int64_t batch = blockIdx.y; batch < batches; batch += gridDim.y) {
    if (threadIdx.x == 0) block_extent = 0;
    __syncthreads();
    int32_t extent = 0;
    for (int64_t row = 0; row < heads * rows && key0 < len_k; ++row) {
      const uint8_t* keys = static_cast<const uint8_t*>(mask.data) + batch * mask.stride_batch +
                            row / rows * mask.stride_head + row % rows * mask.stride_row;
      // (Keys below the extent found so far cannot raise it.)
      for (int64_t key = min(key0 + kExtentKeys, len_k) - 1; key >= max(key0, int64_t{extent}); --key) {
        if (keys[key] != 0) {
          extent = max(extent, static_cast<int32_t>(key + 1));
          break;
        }
      }
    }
    extent = static_cast<int32_t>(__reduce_max_sync(0xffffffff, static_cast<unsigned>(extent)));
    if (threadIdx.x % kWarpSize == 0 && extent > 0) atomicMax(&block_extent, extent);
    __syncthreads();
    if (threadIdx.x == 0 && block_extent > 0) atomicMax(&extents[batch], block_extent);
  }
}

}  // namespace

int64_t mask_key_extent_batches(const TensorView4d& mask, const AttentionProblem& p) {
  return mask_dims(mask, p).batch ? p.batch : 1;
}

void mask_key_extents(const TensorView4d& mask, const AttentionProblem& p, int32_t* extents, cudaStream_t stream) {
  const MaskDims own = mask_dims(mask, p);
  const int64_t batches = mask_key_extent_batches(mask, p);
  if (p.len_k == 0 || batches == 0) return;
  constexpr int64_t kKeysPerBlock = int64_t{kExtentThreads} * kExtentKeys, kMaxGridY = 65535;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.len_k, kKeysPerBlock)),
                  static_cast<unsigned>(std::min(batches, kMaxGridY)));
  mask_key_extent_kernel<<<grid, kExtentThreads, 0, stream>>>(mask, batches, own.heads ? p.heads_q : 1,
                                                               own.rows ? p.len_q : 1, p.len_k, extents);
}

int64_t mask_block_map_bytes(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p) {
  if (kind == MaskKind::kNone) return 0;
  const MapShape shape = map_shape(mask, p);
  constexpr int64_t kMaxGridDim = 65535;  // the classifying grid's y (query blocks) and z (batches x heads)
  if (shape.row_blocks > kMaxGridDim || shape.batches * shape.heads > kMaxGridDim) return 0;
  return shape.bytes();
}

MaskBlockMap classify_mask_blocks(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p,
                                  ElementType type, uint8_t* map, cudaStream_t stream) {
  const MapShape shape = map_shape(mask, p);
  const MaskDims dims = mask_dims(mask, p);
  TensorView4d own = mask;  // (strides of 0 where the mask repeats)
  if (!dims.batch) own.stride_batch = 0;
  if (!dims.heads) own.stride_head = 0;
  if (!dims.rows) own.stride_row = 0;
  const dim3 grid(static_cast<unsigned>(shape.key_blocks), static_cast<unsigned>(shape.row_blocks),
                  static_cast<unsigned>(shape.batches * shape.heads));
  classify_mask_blocks_kernel<<<grid, kKeyBlockKeys, 0, stream>>>(own, kind == MaskKind::kAdditive,
                                                                  hiding_values(type), p.len_k,
                                                                  dims.rows ? p.len_q : 1, shape.heads, map);
  MaskBlockMap blocks;
  blocks.visibility = map;
  blocks.stride_rows = dims.rows ? shape.key_blocks : 0;
  blocks.stride_head = dims.heads ? shape.row_blocks * shape.key_blocks : 0;
  blocks.stride_batch = dims.batch ? shape.heads * shape.row_blocks * shape.key_blocks : 0;
  return blocks;
}

void mark_rows_seeing_one_key(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  // (With attention sinks such a row's dS is not 0.)
  if (params.mask_kind == MaskKind::kNone || params.sinks != nullptr || p.batch * p.heads_q * p.len_q == 0) return;
  const MaskDims own = mask_dims(params.mask, p);
  const int64_t mask_rows = (own.batch ? p.batch : 1) * (own.heads ? p.heads_q : 1) * (own.rows ? p.len_q : 1);
  constexpr int64_t kMaxBlocks = 1 << 16;  // enough to fill the GPU; the blocks loop over the rest
  mark_rows_seeing_one_key_kernel<<<static_cast<unsigned>(std::min(mask_rows, kMaxBlocks)), kOneKeyThreads, 0,
                                    stream>>>(params.mask, params.mask_kind == MaskKind::kAdditive,
                                              hiding_values(type), p, own, static_cast<float*>(params.delta));
}

}  // namespace flashattn_ext::cuda
