// What the Hopper forward's roles share (flash_fwd_sm90.cuh puts them
// together): the kernel's params, the tile the producer hands the consumers,
// and the block's shared-memory state and buffers.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "cuda/dropout_flags.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/sm90/descriptors.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// What the kernel reads: the call, and tensor maps of q, k, v, out and the
// attn_mask. Passed as a __grid_constant__ parameter: the copy engine reads
// the maps in place.
struct FwdKernelParams {
  FwdParams call;
  CUtensorMap q_map, k_map, v_map, out_map, mask_map;
  CUtensorMap v_tail_map;  // e4m3 at 192-key tiles: the transposed values' last 64 keys of a tile
  int tiles;         // (block of query rows, head, batch) tiles (a packed batch: at most)
  int order_chunks;  // causal: heaviest_first_position's chunks
  MaskTileShape mask;
  // Not causal: the tiles in grid_position_heads_first's order (an attn_mask
  // with rows of its own that every head shares, such as an (L, S) mask),
  // else in grid_position's.
  bool heads_first;
  // e4m3 operands (attention_forward_fp8): their descales, (batch, heads_kv)
  // contiguous; null for 16-bit ones.
  const float *q_descale = nullptr, *k_descale = nullptr, *v_descale = nullptr;
};

// The output's element: the inputs', or bfloat16 for e4m3 inputs.
template <typename Elem>
using FwdOutElem = std::conditional_t<std::is_same_v<Elem, __nv_fp8_e4m3>, __nv_bfloat16, Elem>;

// Where a tile of the forward lies, and which key tiles its consumers run:
// n_blocks of them from key block first_block on (those its rows see, through
// the causal diagonal and a sliding window, less the blocks an attn_mask's
// block map hides); n_blocks == kNoTileLeft: no tile is left. The producer works it out
// (integer divisions) and hands it to the consumers. row0 and the key blocks
// count from the tile's sequence's first row and key: in a packed batch
// (varlen) those are rows q_start and k_start of the packed tensors, and the
// sequence has len_q queries and len_k keys (a dense call: 0 and the call's).
struct FwdTile {
  int row0, head, kv_head, batch, first_block, n_blocks;
  int q_start, k_start, len_q, len_k;
};
constexpr int kNoTileLeft = -1;

// The mbarriers of one block and the tile the producer hands the consumers, in shared memory.
template <int kStages>
struct FwdSharedState {
  uint64_t q_full, q_empty;
  uint64_t k_full[kStages], v_full[kStages];    // the copy engine filled the stage
  uint64_t k_empty[kStages], v_empty[kStages];  // every consumer thread is done reading it
  uint64_t out_free[kStages];  // the copy engine has read the output in the stage's K buffer (one arrival a consumer)
  uint64_t tile_full[2], tile_empty[2];         // tile[slot] was written / read by every consumer thread
  FwdTile tile[2];  // the producer runs at most one tile ahead: two slots
  // With an attn_mask: the key block whose K the stage holds, times 2, plus 1
  // where the mask hides none of its keys (written before k_full's arrival).
  int stage_block[kStages];
  // With dropout: its seed, offset and threshold, read from rng_state once
  // (device memory: a load in each tile would hold up the tile's Philox calls,
  // and registers are short).
  DropoutState dropout;
};

// The key block of a stage's K/V tile (the index-th of its query tile's): with
// an attn_mask the producer says which in the stage's stage_block (the blocks
// its block map hides are skipped) and whether the mask hides none of its
// pairs.
struct StageBlock {
  int n_block;
  bool unmasked;
};

// The block's shared-memory buffers: Q, the ring's K and V stages and, with an
// attn_mask, its tile of each stage (FwdTileConfig's sizes, in that order).
struct FwdBuffers {
  unsigned char *q, *k, *v, *mask;
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
