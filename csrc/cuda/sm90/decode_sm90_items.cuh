// The Hopper decode kernel's parameters and work items (decode_sm90_kernel.cuh
// runs them, decode_sm90.cu plans them): what an item is (a sequence's keys,
// or a chunk of them, for one or more key/value heads), and where a (key,
// head) pair's row lies in a stage.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/decode_common.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90::decode_kernel_code {

// What the kernel reads: the call, tensor maps of the caches
// (encode_cache_tensor_map), and its split into work items. An item takes
// 2^heads_log2 key/value heads at once (as many as their query rows fit the
// item's rows, prepare_launch): a tile of a paged cache is then a box of rows
// that each hold those heads side by side (vLLM's layout), not one 256-byte
// piece a row.
struct DecodeKernelParams {
  DecodeParams call;
  CUtensorMap k_map, v_map;
  // A unit is a group of key/value heads of a sequence (sequence-major). The
  // first whole_units units are an item each; the other split_units are
  // split into `chunks` items each (chunk-major: the SMs then read different
  // units' chunks at a time, not one unit's, which was 7% faster at 4
  // chunks), which share the keys its queries see (decode_item).
  int items, whole_units, split_units, chunks;
  int rows;            // query rows of an item: its heads' GQA groups times the query tokens
  int heads_log2;      // key/value heads of an item: 2^heads_log2
  int box_rows;        // rows of one copy: a tile's keys, or a paged cache's smaller block size
  bool heads_inner;    // a copy's box holds each row's heads together (else each head's rows)
  // A whole unit's item writes its rows' out and lse. A split unit's chunks
  // write their rows' partial results to out_partial and lse_partial
  // ((split unit, row, chunk)-major), and the last of them to finish (counted
  // in arrivals, one a split unit, zeros at the launch) merges them into out
  // and lse; with one_wave (each block one item, launched cooperatively) they
  // meet at the grid's barrier instead and each merges its share (no
  // arrivals).
  float* out_partial;
  float* lse_partial;
  int* arrivals;
  bool one_wave;
};

// Where a (key, head) pair's row lies in a stage: the copies' boxes follow
// one another, and each holds box_rows keys of the item's heads, row by row
// and within a row head by head (heads_inner: the order in memory of a paged
// cache's blocks, whose rows hold the heads side by side) or head by head and
// within a head row by row (a cache whose heads lie apart), each row as its
// kColBlocks 64-column lines. A copy reads its box in that order, so it reads
// whole rows of the cache.
template <typename Cfg>
struct StageLayout {
  int heads_log2, box_rows;
  bool heads_inner;

  // The stage's first 128-byte line of pair `pair` (key pair >> heads_log2,
  // head pair % 2^heads_log2).
  __device__ __forceinline__ int line(int pair) const {
    if (heads_inner) return pair * Cfg::kColBlocks;
    const int key = pair >> heads_log2, head = pair & ((1 << heads_log2) - 1);
    const int box = key / box_rows, row = key % box_rows;
    return (((box << heads_log2) + head) * box_rows + row) * Cfg::kColBlocks;
  }
};

// One work item: the keys [key_begin, key_end) of sequence b that some query
// row of key/value heads h_kv, h_kv + 1, ... sees in the chunk, in tiles of
// tile_keys keys from tile0 (key_begin rounded down: a paged cache's blocks
// then start a box). split is the unit's place among the split units (-1:
// whole).
// Fewer keys a chunk would spend more on its partial result than on them.
constexpr int kMinKeysPerChunk = 512;

struct DecodeItem {
  int64_t b, h_kv, length, key_begin, key_end, tile0;
  int split, chunk, tiles, tile_keys;
};

template <typename Cfg>
__device__ __forceinline__ DecodeItem decode_item(const DecodeKernelParams& kp, int index) {
  const AttentionProblem& p = kp.call.problem;
  DecodeItem item;
  item.split = -1;
  item.chunk = 0;
  int unit = index;
  if (index >= kp.whole_units) {
    const int split_index = index - kp.whole_units;
    item.split = split_index % kp.split_units;
    item.chunk = split_index / kp.split_units;
    unit = kp.whole_units + item.split;
  }
  const int groups = static_cast<int>(p.heads_kv) >> kp.heads_log2;
  item.h_kv = (unit % groups) << kp.heads_log2;
  item.b = unit / groups;
  item.length = decoding::sequence_length(kp.call, item.b);
  const Visibility vis(p, p.len_q, item.length);
  int64_t chunk_begin = 0, chunk_end = item.length;
  if (item.split >= 0) {
    // The keys its queries see (not the capacity: a cache of which cache_seqlens
    // or a mask's key extent leaves 3/8 in use, or a window, still spreads over
    // all its chunks), in chunks of whole tiles of at least kMinKeysPerChunk
    // keys.
    // (No 64-bit division: it is a long subroutine, and this stands between
    // the block's start and its first copy. Lengths are below 2^31.)
    const int64_t first = vis.key_begin(0) / Cfg::kBlockN * Cfg::kBlockN;
    const int64_t seen = max(min(vis.key_end(p.len_q - 1), item.length) - first, int64_t{0});
    const int seen_tiles = static_cast<int>((seen + Cfg::kBlockN - 1) / Cfg::kBlockN);
    const int keys_per_chunk = max((seen_tiles + kp.chunks - 1) / kp.chunks * Cfg::kBlockN, kMinKeysPerChunk);
    chunk_begin = first + int64_t{item.chunk} * keys_per_chunk;
    chunk_end = chunk_begin + keys_per_chunk;
  }
  item.key_begin = min(max(chunk_begin, vis.key_begin(0)), item.length);
  item.key_end = max(item.key_begin, min(chunk_end, vis.key_end(p.len_q - 1)));
  item.tile_keys = Cfg::kBlockN >> kp.heads_log2;  // (a power of two)
  item.tile0 = item.key_begin & ~int64_t{item.tile_keys - 1};
  const int tile_keys_log2 = 31 - __clz(item.tile_keys);
  item.tiles = item.key_end > item.key_begin
                   ? static_cast<int>((item.key_end - item.tile0 + item.tile_keys - 1) >> tile_keys_log2)
                   : 0;
  return item;
}

}  // namespace flashattn_ext::cuda::sm90::decode_kernel_code
