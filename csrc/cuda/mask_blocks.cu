// The key-block map of an attn_mask that repeats over queries (a key-padding
// mask): for each (batch, head) of the mask and each block of kKeyBlockKeys
// keys, whether the mask hides all of its keys, none, or some
// (KeyBlockVisibility). The Hopper kernels skip hidden blocks (no loads, no
// GEMMs) and run the unmasked code on visible ones; one pass over the mask's
// B x H x S elements at most, before the forward and again before the backward.
#include <cstdint>

#include "cuda/flash_cuda.h"

namespace flashattn_ext::cuda {
namespace {

// The map's extent: the mask's batches and heads where it has its own (else 1), and the key blocks.
struct MapShape {
  int64_t batches, heads, blocks;
};

MapShape map_shape(const TensorView4d& mask, const AttentionProblem& p) {
  const MaskDims own = mask_dims(mask, p);
  return {own.batch ? p.batch : 1, own.heads ? p.heads_q : 1, (p.len_k + kKeyBlockKeys - 1) / kKeyBlockKeys};
}

// One block of kKeyBlockKeys threads a key block, a key a thread. A bool mask
// hides a key where it is false; an additive one (16-bit float) where it is
// -inf, and leaves it as it is where it is +-0. Keys past len_k count neither way.
__global__ void classify_key_blocks_kernel(TensorView4d mask, bool additive, uint16_t minus_infinity, int64_t len_k,
                                           uint8_t* map) {
  const int64_t key = int64_t(blockIdx.x) * kKeyBlockKeys + threadIdx.x;
  bool hidden = true, visible = true;
  if (key < len_k) {
    const int64_t offset = blockIdx.z * mask.stride_batch + blockIdx.y * mask.stride_head + key * mask.stride_col;
    if (additive) {
      const uint16_t bits = static_cast<const uint16_t*>(mask.data)[offset];
      hidden = bits == minus_infinity;
      visible = (bits & 0x7fff) == 0;
    } else {
      hidden = static_cast<const uint8_t*>(mask.data)[offset] == 0;
      visible = !hidden;
    }
  }
  const bool all_hidden = __syncthreads_and(hidden), all_visible = __syncthreads_and(visible);
  if (threadIdx.x == 0) {
    const KeyBlockVisibility visibility = all_hidden    ? KeyBlockVisibility::kHidden
                                          : all_visible ? KeyBlockVisibility::kVisible
                                                        : KeyBlockVisibility::kPartial;
    map[(int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = static_cast<uint8_t>(visibility);
  }
}

}  // namespace

int64_t key_block_map_bytes(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p) {
  // Only a mask that repeats over queries has one: the Hopper kernels read the
  // map beside such a mask's one-row tiles (encode_mask_tiles).
  if (kind == MaskKind::kNone || mask_dims(mask, p).rows) return 0;
  const MapShape shape = map_shape(mask, p);
  constexpr int64_t kMaxGridDim = 65535;  // the classifying grid's y (heads) and z (batches)
  if (shape.batches > kMaxGridDim || shape.heads > kMaxGridDim) return 0;
  return shape.batches * shape.heads * shape.blocks;
}

KeyBlockMap classify_key_blocks(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p, ElementType type,
                                uint8_t* map, cudaStream_t stream) {
  const MapShape shape = map_shape(mask, p);
  TensorView4d repeated = mask;
  if (shape.batches == 1) repeated.stride_batch = 0;
  if (shape.heads == 1) repeated.stride_head = 0;
  const bool additive = kind == MaskKind::kAdditive;
  const uint16_t minus_infinity = type == ElementType::kBFloat16 ? 0xff80 : 0xfc00;
  const dim3 grid(static_cast<unsigned>(shape.blocks), static_cast<unsigned>(shape.heads),
                  static_cast<unsigned>(shape.batches));
  classify_key_blocks_kernel<<<grid, kKeyBlockKeys, 0, stream>>>(repeated, additive, minus_infinity, p.len_k, map);
  KeyBlockMap blocks;
  blocks.visibility = map;
  blocks.stride_batch = shape.batches > 1 ? shape.heads * shape.blocks : 0;
  blocks.stride_head = shape.heads > 1 ? shape.blocks : 0;
  return blocks;
}

}  // namespace flashattn_ext::cuda
