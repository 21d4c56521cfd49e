// The order in which the tiles of a flattened grid run: a tile's (block, head,
// batch) from its index, blocks first, heads first or heaviest first, and how
// many chunks the heaviest-first orders make. Included by the mma.sync
// backwards (sm80/) and the Hopper forward and backward (sm90/).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/launch.cuh"

namespace flashattn_ext::cuda {

// The place of tile `index` in a flattened grid ordered (block, head, batch),
// blocks fastest: blocks_per_head blocks for each of heads heads of each batch.
// (A non-persistent kernel's tile is its thread block: index blockIdx.x.)
struct GridPosition {
  int64_t block, head, batch;
};
__device__ __forceinline__ GridPosition grid_position(int64_t index, int64_t blocks_per_head, int64_t heads) {
  return {index % blocks_per_head, (index / blocks_per_head) % heads, index / (blocks_per_head * heads)};
}
// The same grid ordered (head, block, batch), heads fastest: the tiles that
// run together are the same few blocks of every head (they share an attn_mask
// that repeats over heads, read once from memory and then from L2).
__device__ __forceinline__ GridPosition grid_position_heads_first(int64_t index, int64_t blocks_per_head,
                                                                  int64_t heads) {
  return {(index / heads) % blocks_per_head, index % heads, index / (blocks_per_head * heads)};
}

// The same grid in the order for causal calls, whose block 0 of a head has the
// most work: the (batch, head) pairs in `chunks` chunks of consecutive pairs,
// their sizes differing by at most one, and within a chunk block 0 of every
// pair first, then block 1, ... So the tiles that run together read the same
// few heads from L2, and each chunk ends with light tiles. The counts fit in
// 32 bits (the launches check): a 32-bit division is a few instructions, a
// 64-bit one a call.
__device__ __forceinline__ GridPosition heaviest_first_position(int index, int blocks_per_head, int heads, int pairs,
                                                                int chunks) {
  const int small = pairs / chunks, big = pairs % chunks;  // `big` chunks of small + 1 pairs come first
  const int big_tiles = big * (small + 1) * blocks_per_head;
  const bool in_big = index < big_tiles;
  const int size = in_big ? small + 1 : small;
  const int local = in_big ? index : index - big_tiles;
  const int chunk = local / (size * blocks_per_head), rest = local - chunk * size * blocks_per_head;
  const int pair = (in_big ? 0 : big * (small + 1)) + chunk * size + rest % size;
  return {rest / size, pair % heads, pair / heads};
}

// How many chunks the forward's heaviest_first_position makes of `pairs`
// pairs, whose streamed tensors (K and V) take bytes_per_head each. A chunk
// holds enough pairs to fill about kL2ChunkBytes of L2, and enough that its
// work keeps all `sms` SMs busy for four times its heaviest tile: a pair's
// blocks get lighter linearly, so its work is about blocks_per_head / 2
// heaviest tiles. With fewer, the heavy tiles of the last chunk start late and
// run on alone.
constexpr int64_t kL2ChunkBytes = int64_t{24} << 20;  // about half the H100's L2
inline int heaviest_first_chunks(int64_t pairs, int64_t blocks_per_head, int64_t bytes_per_head, int sms) {
  const int64_t for_l2 = std::max<int64_t>(1, kL2ChunkBytes / std::max<int64_t>(bytes_per_head, 1));
  const int64_t for_balance = ceil_div(4 * int64_t{sms}, std::max<int64_t>(blocks_per_head, 1));
  const int64_t per_chunk = std::max<int64_t>(1, std::min(pairs, std::max(for_l2, for_balance)));
  return static_cast<int>(ceil_div(pairs, per_chunk));
}

// The same for the Hopper backward, whose blocks are not persistent: chunks of
// about one wave of blocks (sms / blocks_per_head pairs, rounded). Measured on
// the H100 against the forward's rule (bf16, causal, head dims 64 and 128, N
// 1024 to 16384, GQA 1:1 and 4:1): 1.28x faster at N = 2048 with GQA 4:1
// (the forward's rule made one chunk there, and the blocks that ran together
// were 4 key blocks of each of 32 head groups), 1.2x at N = 1024, 1.14x at
// N = 4096 with GQA 4:1, elsewhere the same within the run's noise.
inline int one_wave_chunks(int64_t pairs, int64_t blocks_per_head, int sms) {
  blocks_per_head = std::max<int64_t>(blocks_per_head, 1);
  const int64_t per_chunk = (2 * int64_t{sms} + blocks_per_head) / (2 * blocks_per_head);
  return static_cast<int>(ceil_div(pairs, std::clamp<int64_t>(per_chunk, 1, std::max<int64_t>(pairs, 1))));
}

}  // namespace flashattn_ext::cuda
