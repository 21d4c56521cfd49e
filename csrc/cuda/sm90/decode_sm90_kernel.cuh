// Decoding on Hopper, the kernel (decode_sm90.cu plans and launches it):
// sm80/decode.cu's chunk and merge steps in one kernel, fed by the
// copy engine. Reading the cache is the whole cost, and the mma.sync kernel
// spent its time computing where each row of a tile lies (a block-table lookup
// a row for paged caches) and starting blocks, not waiting for memory: on an
// H200 it read a contiguous cache at 0.64-0.68 of a device-to-device copy's
// rate and a paged one at 0.47-0.50, random or sequential block tables alike.
//
// Here one producer warp walks the block's work items (a sequence's keys, or
// a chunk of them, for one or more key/value heads whose query rows fit 16:
// prepare_launch) and their tiles of 64 (key, head) pairs, and has the copy
// engine load each tile's K and V into a ring of stages: one copy a box of
// whole rows of all the item's heads (in vLLM's paged layout a block's rows
// hold the heads side by side, so a block of 16 keys is one copy, not 16 pieces
// of 256 bytes a head), the block table read 32 boxes at a time; a copy of
// whole rows streams faster than copies of each row's 64-column halves
// (StageLayout). Four consumer warps each take 16 pairs of every tile: Q K^T,
// the online softmax and P V on the tensor cores (mma.sync m16n8k16 from the
// 128-byte swizzled stages), for the item's query rows (the heads' GQA groups
// times the query tokens: one mma tile, or two with a second row group of
// four warps), the scores of pairs of another head than a row's masked. Blocks are persistent, so the ring runs on from one item
// into the next. The consumers' results of an item (each one's softmax over its
// own pairs) merge in shared memory: into the rows' out and lse where the item
// is a sequence's keys, else into the chunk's partial result, and the last of a
// sequence's chunks to finish merges them (no merge kernel: one took 10 us of
// 0.72 ms at 8k keys, B = 64, H100). Where every item has a block of its own,
// all resident at once (small batches: a cooperative launch), the chunks
// instead meet at a grid barrier and each merges a share of its unit's rows:
// one block reading all 16 chunks' partials of 8 query tokens took 6 us.
// A sequence whose length does not fit its cache gets NaN (decode_poison's
// part for contiguous caches). The kernel's parameters and work items:
// decode_sm90_items.cuh; its stages' addressing and FP8 fragments:
// decode_sm90_fragments.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <type_traits>

#include "cuda/decode_common.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/sm90/decode_sm90_fragments.cuh"
#include "cuda/sm90/decode_sm90_items.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90::decode_kernel_code {

using decoding::LaneRows;
using decoding::QueryRow;

struct DecodeBarriers {
  uint64_t* full;   // [kStages]: a tile's K and V have landed
  uint64_t* empty;  // [kStages]: every consumer is done with the stage
};

// The producer warp: the block's items' tiles into the ring, in order, the
// copies issued by lane 0. Boxes whose first key is past the item's keys are
// not loaded (a paged cache's block table may end before them); the consumers
// zero what those rows hold. A paged cache's blocks are looked up 32 boxes at
// a time, one a lane (a lookup is a load from memory: one after another, they
// would leave the copy engine idle).
template <typename Cfg>
__device__ __forceinline__ void load_tiles(const DecodeKernelParams& kp, unsigned char* stages, DecodeBarriers bars,
                                           int lane) {
  const DecodeParams& params = kp.call;
  const bool paged = params.block_table.data != nullptr;
  const int block_size = static_cast<int>(params.block_size), box_rows = kp.box_rows;
  // The cache is read once: its lines leave L2 first, not the call's other
  // data (q, cache_seqlens, the partial results) or the kernel's code.
  const uint64_t streaming = ptx::evict_first_policy();
  int stage = 0;
  uint32_t phase = 0;
  for (int index = blockIdx.x; index < kp.items; index += gridDim.x) {
    const DecodeItem item = decode_item<Cfg>(kp, index);
    // Box `box` of the item holds keys from tile0 + box * box_rows; lane i
    // holds the cache block of box first_looked_up + i.
    int box = 0, first_looked_up = 0, lane_block = 0;
    for (int t = 0; t < item.tiles; ++t) {
      const int64_t key0 = item.tile0 + int64_t(t) * item.tile_keys;
      const int keys = static_cast<int>(min(item.key_end - key0, int64_t{item.tile_keys}));
      const int boxes = (keys + box_rows - 1) / box_rows;
      const int box_bytes = (box_rows << kp.heads_log2) * Cfg::kColBlocks * kSwizzleRowBytes;
      if (lane == 0) {
        ptx::mbarrier_wait(&bars.empty[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&bars.full[stage], boxes * box_bytes * 2);
      }
      unsigned char* k_stage = stages + stage * 2 * Cfg::kTileBytes;
      unsigned char* v_stage = k_stage + Cfg::kTileBytes;
      for (int i = 0; i < boxes; ++i, ++box) {
        const int key = static_cast<int>(item.tile0) + box * box_rows;
        int outer = static_cast<int>(item.b), row = key;
        if (paged) {
          if (box == 0 || box - first_looked_up == kWarpSize) {  // (uniform across the warp)
            first_looked_up = box;
            const int64_t lane_key = item.tile0 + int64_t(box + lane) * box_rows;
            // (The same clamp as decode_common.cuh's cache_position.)
            const int64_t block =
                lane_key < item.key_end ? params.block_table.at(item.b, static_cast<int>(lane_key) / block_size) : 0;
            lane_block = static_cast<int>(min(max(block, int64_t{0}), params.num_blocks - 1));
          }
          outer = __shfl_sync(0xffffffff, lane_block, box - first_looked_up);
          row = key % block_size;
        }
        if (lane != 0) continue;
        const int offset = i * box_bytes, head = static_cast<int>(item.h_kv);
        const int c2 = kp.heads_inner ? head : row, c3 = kp.heads_inner ? row : head;
        ptx::tma_load_5d(k_stage + offset, &kp.k_map, &bars.full[stage], 0, 0, c2, c3, outer, streaming);
        ptx::tma_load_5d(v_stage + offset, &kp.v_map, &bars.full[stage], 0, 0, c2, c3, outer, streaming);
      }
      if (++stage == Cfg::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

// Four columns of an out row, from float.
template <typename Elem>
__device__ __forceinline__ void store_out4(Elem* out, float4 value) {
  *reinterpret_cast<uint2*>(out) = make_uint2(ptx::pack2<Elem>(value.x, value.y), ptx::pack2<Elem>(value.z, value.w));
}

// Where chunk `chunk`'s partial result of row r of split unit `split` lies
// (in lse_partial; times the head dim in out_partial).
__device__ __forceinline__ int64_t partial_index(const DecodeKernelParams& kp, int split, int r, int chunk) {
  return (int64_t{split} * kp.rows + r) * kp.chunks + chunk;
}

// Pieces [piece_begin, piece_end) of a split unit's out and lse (its rows'
// 4-column pieces, row-major) from its chunks' partial results (written by
// other blocks: read from L2), dealt out over `threads` threads from
// threadIdx.x 0. Each reads its piece of 16 chunks at once, merging them as
// the online softmax does. (Read a chunk after another, each read's wait for
// L2 in turn, the merge of 16 chunks took 10 of the 26 us a call of B = 1, 8
// key heads, 8k keys.)
template <typename Elem, typename Cfg>
__device__ __forceinline__ void merge_chunks(const DecodeKernelParams& kp, const DecodeItem& item, int piece_begin,
                                             int piece_end, int threads) {
  constexpr int kHeadDim = Cfg::kHeadDim, kPieces = kHeadDim / 4, kBatch = 16;
  const DecodeParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  const bool fits = params.length_fits(item.b);
  for (int piece = piece_begin + threadIdx.x; piece < piece_end; piece += threads) {
    const int r = piece / kPieces, col0 = piece % kPieces * 4;
    const int64_t first = partial_index(kp, item.split, r, 0);
    const float* lse = kp.lse_partial + first;
    const float* partial = kp.out_partial + first * kHeadDim + col0;
    float lse_max = -INFINITY, total = 0.f;
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = 0; c0 < kp.chunks; c0 += kBatch) {
      float chunk_lse[kBatch];
      float4 x[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const bool valid = c0 + i < kp.chunks;  // (a chunk without keys: lse -inf, zeros)
        chunk_lse[i] = valid ? __ldcg(lse + c0 + i) : -INFINITY;
        x[i] = valid ? __ldcg(reinterpret_cast<const float4*>(partial + (c0 + i) * kHeadDim))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float new_max = lse_max;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) new_max = fmaxf(new_max, chunk_lse[i]);
      if (new_max == -INFINITY) continue;
      const float rescale = __expf(lse_max - new_max);
      total *= rescale;
      value = make_float4(value.x * rescale, value.y * rescale, value.z * rescale, value.w * rescale);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const float weight = __expf(chunk_lse[i] - new_max);
        total += weight;
        value = make_float4(value.x + weight * x[i].x, value.y + weight * x[i].y, value.z + weight * x[i].z,
                            value.w + weight * x[i].w);
      }
      lse_max = new_max;
    }
    const float inverse = !fits ? NAN : total > 0.f ? 1.f / total : 0.f;
    const QueryRow row = decoding::query_row(item.h_kv, static_cast<int>(p.heads_q / p.heads_kv),
                                             static_cast<int>(p.len_q), r);
    Elem* out_row = static_cast<Elem*>(params.out.data) + item.b * params.out.stride_batch +
                    row.head * params.out.stride_head + row.token * params.out.stride_row + col0;
    store_out4(out_row, make_float4(value.x * inverse, value.y * inverse, value.z * inverse, value.w * inverse));
    if (col0 == 0) {
      const int64_t row_index = (item.b * p.heads_q + row.head) * p.len_q + row.token;
      static_cast<float*>(params.lse)[row_index] = !fits ? NAN : total > 0.f ? lse_max + logf(total) : -INFINITY;
    }
  }
}

// The consumer warps: each item's tiles from the ring (Q K^T, the online
// softmax, P V), then the item's result: its rows' out and lse, or its
// chunk's partial result (and, unless one_wave, the merge of its unit's
// chunks by the last to finish).
template <typename Elem, typename Cfg, decoding::ScoreTerm kTerm>
__device__ __forceinline__ void consume_items(const DecodeKernelParams& kp, unsigned char* stages, DecodeBarriers bars,
                                              float* merge_out, float* merge_lse, int* unit_arrival, int warp,
                                              int lane) {
  constexpr int kHeadDim = Cfg::kHeadDim, kStages = Cfg::kStages, kDimTiles = kHeadDim / 8;
  // (an FP8 cache's tiles meet the tensor cores as float16)
  using MmaElem = std::conditional_t<Cfg::kFp8Cache, __half, Elem>;
  const DecodeParams& params = kp.call;
  const AttentionProblem& p = params.problem;
  const int group = static_cast<int>(p.heads_q / p.heads_kv), len_q = static_cast<int>(p.len_q);
  const int heads_log2 = kp.heads_log2;
  const int rows = kp.rows;  // (at most Cfg::kRows)
  // This warp's 16 pairs of every tile, for 16 query rows from row0 (or the
  // keys as the mma's rows: 8 query rows).
  const int key_warp = warp % Cfg::kKeyWarps, row0 = warp / Cfg::kKeyWarps * decoding::kRows;
  // This lane's two query rows of the scores and the output (half 0 and 1);
  // acc[t][e] holds row lane_row(half_of(e)), column acc_column(t, e).
  constexpr int kAccTiles = Cfg::kKeysAsRows ? kHeadDim / 16 : kDimTiles;
  auto lane_row = [&](int half) { return Cfg::kKeysAsRows ? 2 * (lane % 4) + half : row0 + lane / 4 + half * 8; };
  auto half_of = [](int e) { return Cfg::kKeysAsRows ? e % 2 : e / 2; };
  auto acc_column = [&](int t, int e) {
    if (Cfg::kKeysAsRows) return t * 16 + 2 * (lane / 4) + e / 2;                 // (pv_fp8_keys_as_rows)
    if (Cfg::kFp8Cache) return t / 2 * 16 + (lane % 4) * 4 + t % 2 + 2 * (e % 2);  // (pv_fp8)
    return t * 8 + (lane % 4) * 2 + e % 2;
  };
  const decoding::ScoreScale score_scale(p);
  const uint32_t stages_addr = ptx::smem_addr(stages);
  // This lane's ldmatrix rows among the warp's 16 pairs: K's for Q K^T (pairs
  // 0-7 for matrices 0 and 1, 8-15 for 2 and 3; pieces alternate), V's for
  // P V (transposed: pairs alternate, pieces 0 for matrices 0 and 1).
  const int matrix = lane / 8, pair0 = key_warp * 16;
  const StageLayout<Cfg> layout{heads_log2, kp.box_rows, kp.heads_inner};
  const int k_line = layout.line(pair0 + (matrix / 2) * 8 + lane % 8), k_piece = matrix % 2;
  const int v_line = layout.line(pair0 + (matrix % 2) * 8 + lane % 8), v_piece = matrix / 2;
  int stage = 0;
  uint32_t phase = 0;
  for (int index = blockIdx.x; index < kp.items; index += gridDim.x) {
    const DecodeItem item = decode_item<Cfg>(kp, index);
    const Visibility vis(p, p.len_q, item.length);
    const LaneRows<kTerm> lane_rows(params, vis, item.b, item.h_kv, row0, rows - row0, item.key_end,
                                    lane_row(0) - row0, lane_row(1) - lane_row(0));

    // Q as mma A fragments: rows row0 + lane / 4 (registers 0, 2) and + 8 (1,
    // 3), columns 2 (lane % 4) and the next, + 8 (registers 2, 3) of each 16
    // (of an FP8 cache: columns 4 (lane % 4) and the next, + 2, in the order
    // qk_fp8 gives K's); rows past the item's are zeros. With the keys as the
    // mma's rows, registers 0 and 2 hold row lane / 4 as the B operand.
    uint32_t q_frag[kHeadDim / 16][4];
    constexpr int kQRowsALane = Cfg::kKeysAsRows ? 1 : 2;
#pragma unroll
    for (int i = 0; i < kQRowsALane; ++i) {
      const int r = row0 + lane / 4 + i * 8;
      const QueryRow row = decoding::query_row(item.h_kv, group, len_q, r);
      const Elem* q_row = static_cast<const Elem*>(params.q.data) + item.b * params.q.stride_batch +
                          row.head * params.q.stride_head + row.token * params.q.stride_row;
      // (a column pair a load where the row allows: half the loads)
      const bool pairs = params.q.stride_col == 1 && reinterpret_cast<uintptr_t>(q_row) % 4 == 0;
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t col = Cfg::kFp8Cache ? ks * 16 + (lane % 4) * 4 + half * 2 : ks * 16 + half * 8 + (lane % 4) * 2;
          uint32_t pair = 0;
          if (r < rows && pairs) {
            pair = *reinterpret_cast<const uint32_t*>(q_row + col);
          } else if (r < rows) {
            pair = ptx::pack2<Elem>(ptx::to_float(q_row[col * params.q.stride_col]),
                                    ptx::to_float(q_row[(col + 1) * params.q.stride_col]));
          }
          q_frag[ks][i + 2 * half] = pair;
        }
      }
    }
    // An FP8 cache's tiles meet the tensor cores as float16 (e4m3 converts to
    // it exactly): Q too, each row times a power of two that brings its
    // largest value near float16's range, and the scores times what undoes
    // that and dequantizes the keys (key_dequant); the output times the
    // values' scale (value_scale).
    float key_dequant[2] = {1.f, 1.f}, value_scale[2] = {1.f, 1.f};
    if constexpr (Cfg::kFp8Cache) {
      float to_half[2];  // of the lane's Q rows
#pragma unroll
      for (int i = 0; i < kQRowsALane; ++i) {
        float largest = 0.f;
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          const float2 x = ptx::unpack2<Elem>(q_frag[j / 2][i + 2 * (j % 2)]);
          largest = fmaxf(largest, fmaxf(fabsf(x.x), fabsf(x.y)));
        }
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffff, largest, 1));
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffff, largest, 2));
        to_half[i] = power_of_two_into_half_range(largest);
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          uint32_t& pair = q_frag[j / 2][i + 2 * (j % 2)];
          const float2 x = ptx::unpack2<Elem>(pair);
          pair = ptx::pack2<__half>(x.x * to_half[i], x.y * to_half[i]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // (keys as rows: the scores' rows 2 (lane % 4) + half are other lanes' Q rows)
        const float row_to_half =
            Cfg::kKeysAsRows ? __shfl_sync(0xffffffff, to_half[0], 4 * lane_row(half)) : to_half[half];
        if (lane_row(half) < rows) {
          const int64_t scale_index = (item.h_kv + lane_rows.head[half]) * params.scale_stride_head;
          key_dequant[half] = params.k_scale[scale_index] / row_to_half;
          value_scale[half] = params.v_scale[scale_index];
        }
      }
    }

    float acc[kAccTiles][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    for (int t = 0; t < item.tiles; ++t) {
      const int64_t key0 = item.tile0 + int64_t(t) * item.tile_keys;
      const uint32_t visible = decoding::mask_bits(lane_rows, key0, pair0, heads_log2, lane);
      ptx::mbarrier_wait(&bars.full[stage], phase);
      // This warp's keys: [key0 + first_key, key0 + last_key].
      const int first_key = pair0 >> heads_log2, last_key = (pair0 + 15) >> heads_log2;
      if (key0 + first_key < item.key_end && key0 + last_key >= item.key_begin) {
        const uint32_t k_base = stages_addr + stage * 2 * Cfg::kTileBytes, v_base = k_base + Cfg::kTileBytes;
        // V's rows of pairs past the keys hold whatever the cache or an earlier
        // tile left, and 0 * NaN would poison P V: this lane's V fragments keep
        // only the halves of pairs within the keys (its pairs (lane % 4) * 2 and
        // the next in registers 0 and 2, those 8 on in 1 and 3). (Zeroing the
        // rows in shared memory instead raced with the other row group's reads.)
        uint32_t v_keep[2] = {~0u, ~0u};
        if (key0 + last_key >= item.key_end) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int pair = pair0 + (i / 2) * 8 + (lane % 4) * 2 + i % 2;
            if (key0 + (pair >> heads_log2) >= item.key_end) v_keep[i / 2] &= i % 2 ? 0x0000ffffu : 0xffff0000u;
          }
        }
        if constexpr (Cfg::kKeysAsRows) {
          // S^T = K Q^T, its online softmax, O^T += V^T P^T (P^T by movmatrix
          // from S^T's accumulators, pairs 0-7 then 8-15).
          float st[4] = {};
          qk_fp8_keys_as_rows<kHeadDim>(st, q_frag, k_base, k_line, k_piece);
#pragma unroll
          for (int e = 0; e < 4; ++e) st[e] *= key_dequant[e % 2];
          decoding::finish_scores_each<kTerm, 4>(
              [&](int i) -> float& { return st[i]; }, score_scale, lane_rows, vis, key0, heads_log2, visible,
              [&](int i) { return make_int2(pair0 + lane / 4 + 8 * (i / 2), i % 2); });
          online_softmax_keys_as_rows(st, row_max, row_sum, acc);
          const uint32_t p_b[2] = {ptx::movmatrix_trans(ptx::pack2<__half>(st[0], st[1])),
                                   ptx::movmatrix_trans(ptx::pack2<__half>(st[2], st[3]))};
          pv_fp8_keys_as_rows<kHeadDim>(acc, p_b, v_base, v_line, v_piece, v_keep);
        } else {
        // S = Q K^T over the warp's 16 pairs.
        float s[2][4] = {};
        if constexpr (Cfg::kFp8Cache) {
          qk_fp8<kHeadDim>(s, q_frag, k_base, k_line, k_piece);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[0][e] *= key_dequant[e / 2];
            s[1][e] *= key_dequant[e / 2];
          }
        } else {
#pragma unroll
          for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            uint32_t k_frag[4];
            ptx::ldmatrix_x4(k_frag, swizzled(k_base, k_line, 2 * ks + k_piece));
            ptx::mma_16x8x16<Elem>(s[0], q_frag[ks], k_frag[0], k_frag[1]);
            ptx::mma_16x8x16<Elem>(s[1], q_frag[ks], k_frag[2], k_frag[3]);
          }
        }
        decoding::finish_scores(s, score_scale, lane_rows, vis, key0, pair0, heads_log2, lane, visible);
        decoding::online_softmax(s, row_max, row_sum, acc);
        // O += P V: P as A fragments straight from the scores' accumulators.
        const uint32_t p_frag[4] = {ptx::pack2<MmaElem>(s[0][0], s[0][1]), ptx::pack2<MmaElem>(s[0][2], s[0][3]),
                                    ptx::pack2<MmaElem>(s[1][0], s[1][1]), ptx::pack2<MmaElem>(s[1][2], s[1][3])};
        if constexpr (Cfg::kFp8Cache) {
          pv_fp8<kHeadDim>(acc, p_frag, v_base, v_line, v_piece, v_keep);
        } else {
#pragma unroll
          for (int dp = 0; dp < kHeadDim / 16; ++dp) {
            uint32_t v_frag[4];
            ptx::ldmatrix_x4_trans(v_frag, swizzled(v_base, v_line, 2 * dp + v_piece));
#pragma unroll
            for (int i = 0; i < 4; ++i) v_frag[i] &= v_keep[i % 2];
            ptx::mma_16x8x16<Elem>(acc[2 * dp], p_frag, v_frag[0], v_frag[1]);
            ptx::mma_16x8x16<Elem>(acc[2 * dp + 1], p_frag, v_frag[2], v_frag[3]);
          }
        }
        }
      }
      __syncwarp();  // every lane's reads of the stage are done
      if (lane == 0) ptx::mbarrier_arrive(&bars.empty[stage]);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }

    // This warp's result of the item's rows: out normalized (in acc), the
    // log-sum-exp in log2 units (-inf and zeros where a row saw no key).
    float row_lse[2], inverse[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // (a row's lanes: a quad, or with the keys as rows the 8 lanes of a lane % 4)
      float sum = row_sum[half];
#pragma unroll
      for (int lanes = Cfg::kKeysAsRows ? 4 : 1; lanes < (Cfg::kKeysAsRows ? kWarpSize : 4); lanes *= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, lanes);
      }
      inverse[half] = sum > 0.f ? value_scale[half] / sum : 0.f;
      row_lse[half] = sum > 0.f ? row_max[half] + log2f(sum) : -INFINITY;
    }
#pragma unroll
    for (int t = 0; t < kAccTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][e] *= inverse[half_of(e)];
    }
    // ... to the merge's slot of key warp `slot_warp` (the columns acc_column
    // says, 2 or 4 at a time).
    auto store_result = [&](int slot_warp) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int slot = Cfg::merge_slot(slot_warp, lane_row(half));
        float* out = merge_out + slot * Cfg::kMergeRowFloats;
        if constexpr (Cfg::kKeysAsRows) {
#pragma unroll
          for (int t = 0; t < kAccTiles; ++t) {
            *reinterpret_cast<float2*>(out + acc_column(t, half)) = make_float2(acc[t][half], acc[t][half + 2]);
          }
        } else if constexpr (Cfg::kFp8Cache) {
#pragma unroll
          for (int t = 0; t < kAccTiles; t += 2) {
            *reinterpret_cast<float4*>(out + acc_column(t, 2 * half)) =
                make_float4(acc[t][2 * half], acc[t + 1][2 * half], acc[t][2 * half + 1], acc[t + 1][2 * half + 1]);
          }
        } else {
#pragma unroll
          for (int t = 0; t < kAccTiles; ++t) {
            *reinterpret_cast<float2*>(out + acc_column(t, 2 * half)) = make_float2(acc[t][2 * half], acc[t][2 * half + 1]);
          }
        }
        const bool row_leader = Cfg::kKeysAsRows ? lane / 4 == 0 : lane % 4 == 0;
        if (row_leader) merge_lse[slot] = row_lse[half];
      }
    };
    constexpr int kConsumerThreads = Cfg::kConsumers * kWarpSize;
    if constexpr (Cfg::kKeyWarps > Cfg::kMergeKeyWarps) {
      // The upper key warps hand their results to the lower ones (the same
      // places as the lane's own), which merge them into theirs.
      const bool upper = key_warp >= Cfg::kMergeKeyWarps;
      if (upper) store_result(key_warp - Cfg::kMergeKeyWarps);
      ptx::named_barrier_sync(1, kConsumerThreads);
      if (!upper) {
        float own[2], other[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float other_lse = merge_lse[Cfg::merge_slot(key_warp, lane_row(half))];
          const float lse_max = fmaxf(row_lse[half], other_lse);
          own[half] = row_lse[half] == -INFINITY ? 0.f : ptx::exp2_approx(row_lse[half] - lse_max);
          other[half] = other_lse == -INFINITY ? 0.f : ptx::exp2_approx(other_lse - lse_max);
          const float total = own[half] + other[half], scale = total > 0.f ? 1.f / total : 0.f;
          own[half] *= scale;
          other[half] *= scale;
          row_lse[half] = total > 0.f ? lse_max + log2f(total) : -INFINITY;
        }
#pragma unroll
        for (int t = 0; t < kAccTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int half = half_of(e);
            const float* other_out = merge_out + Cfg::merge_slot(key_warp, lane_row(half)) * Cfg::kMergeRowFloats;
            acc[t][e] = acc[t][e] * own[half] + other_out[acc_column(t, e)] * other[half];
          }
        }
      }
      ptx::named_barrier_sync(1, kConsumerThreads);  // (the upper warps' results read before these replace them)
    }
    if (key_warp < Cfg::kMergeKeyWarps) store_result(key_warp);
    ptx::named_barrier_sync(1, kConsumerThreads);
    // The key warps' results merged: each thread 4 columns of a row at a time,
    // a row's threads side by side. With one chunk they are the row's out and
    // lse (rows of out contiguous and 8-byte aligned: prepare_launch); else
    // the chunk's partial.
    constexpr int kThreadsPerRow = kConsumerThreads / Cfg::kRows, kRowStep = 4 * kThreadsPerRow;
    const int r = threadIdx.x / kThreadsPerRow, col0 = threadIdx.x % kThreadsPerRow * 4;
    if (r < rows) {
      float weight[Cfg::kMergeKeyWarps], lse_max = -INFINITY, total = 0.f;
#pragma unroll
      for (int w = 0; w < Cfg::kMergeKeyWarps; ++w) lse_max = fmaxf(lse_max, merge_lse[Cfg::merge_slot(w, r)]);
#pragma unroll
      for (int w = 0; w < Cfg::kMergeKeyWarps; ++w) {
        const float lse = merge_lse[Cfg::merge_slot(w, r)];
        weight[w] = lse == -INFINITY ? 0.f : ptx::exp2_approx(lse - lse_max);
        total += weight[w];
      }
      const bool whole = item.split < 0, poison = whole && !params.length_fits(item.b);
      const float inverse = poison ? NAN : total > 0.f ? 1.f / total : 0.f;
      const QueryRow row = decoding::query_row(item.h_kv, group, len_q, r);
      const int64_t row_index = (item.b * p.heads_q + row.head) * p.len_q + row.token;
      Elem* out_row = static_cast<Elem*>(params.out.data) + item.b * params.out.stride_batch +
                      row.head * params.out.stride_head + row.token * params.out.stride_row;
      const int64_t partial = whole ? 0 : partial_index(kp, item.split, r, item.chunk);
      float* partial_row = kp.out_partial + partial * kHeadDim;
#pragma unroll
      for (int c = col0; c < kHeadDim; c += kRowStep) {
        float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < Cfg::kMergeKeyWarps; ++w) {
          const float4 x =
              *reinterpret_cast<const float4*>(merge_out + Cfg::merge_slot(w, r) * Cfg::kMergeRowFloats + c);
          value.x += weight[w] * x.x;
          value.y += weight[w] * x.y;
          value.z += weight[w] * x.z;
          value.w += weight[w] * x.w;
        }
        value = make_float4(value.x * inverse, value.y * inverse, value.z * inverse, value.w * inverse);
        if (whole) {
          store_out4(out_row + c, value);
        } else {
          *reinterpret_cast<float4*>(partial_row + c) = value;
        }
      }
      if (col0 == 0) {
        const float lse = poison ? NAN : total > 0.f ? (lse_max + log2f(total)) * float(M_LN2) : -INFINITY;
        if (whole) {
          static_cast<float*>(params.lse)[row_index] = lse;
        } else {
          kp.lse_partial[partial] = lse;
        }
      }
    }
    if (item.split >= 0 && !kp.one_wave) {
      // The unit's last chunk to finish merges its chunks' partial results
      // (the others' are in memory before their arrivals: the fences).
      __threadfence();
      ptx::named_barrier_sync(1, kConsumerThreads);
      if (threadIdx.x == 0) {
        *unit_arrival = atomicAdd(kp.arrivals + item.split, 1);
        __threadfence();
      }
      ptx::named_barrier_sync(1, kConsumerThreads);
      if (*unit_arrival == kp.chunks - 1) {
        merge_chunks<Elem, Cfg>(kp, item, 0, kp.rows * (kHeadDim / 4), kConsumerThreads);
      }
    }
    ptx::named_barrier_sync(1, kConsumerThreads);  // (the buffers are the next item's)
  }
}

// One wave: once every block's partial result is written (the grid's
// barrier, which every thread of every block reaches), this block merges its
// share of its split unit's rows.
template <typename Elem, typename Cfg>
__device__ __forceinline__ void merge_share(const DecodeKernelParams& kp) {
  const bool split = blockIdx.x >= kp.whole_units && blockIdx.x < kp.items;
  DecodeItem item;
  if (split) item = decode_item<Cfg>(kp, blockIdx.x);  // (its length's load before the wait, not after)
  cooperative_groups::this_grid().sync();
  if (!split) return;
  const int pieces = kp.rows * (Cfg::kHeadDim / 4);
  merge_chunks<Elem, Cfg>(kp, item, pieces * item.chunk / kp.chunks, pieces * (item.chunk + 1) / kp.chunks,
                          Cfg::kThreads);
}

// (One block an SM. Nine warps put three on one of the SM's four register
// files of 16K, so 168 registers a thread at most: __maxnreg__(224) failed to
// launch.)
template <typename Elem, typename Cfg, decoding::ScoreTerm kTerm>
__global__ void __launch_bounds__(Cfg::kThreads, 1) decode_kernel(const __grid_constant__ DecodeKernelParams kp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kStages = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* stages = swizzle_aligned(smem_raw);
  uint64_t* barrier_words = reinterpret_cast<uint64_t*>(stages + kStages * 2 * Cfg::kTileBytes);
  const DecodeBarriers bars{barrier_words, barrier_words + kStages};
  // [merge slot][row][col] and [merge slot][row] (tile_config.h's merge_slot)
  float* merge_out = reinterpret_cast<float*>(barrier_words + 2 * kStages);
  float* merge_lse = merge_out + Cfg::kMergeSlots * decoding::kRows * Cfg::kMergeRowFloats;
  int* unit_arrival = reinterpret_cast<int*>(merge_lse + Cfg::kMergeSlots * decoding::kRows);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (warp == Cfg::kConsumers && lane == 0) {  // (the copies' first wait is for the maps)
    ptx::prefetch_tensor_map(&kp.k_map);
    ptx::prefetch_tensor_map(&kp.v_map);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&bars.full[s], 1);
      ptx::mbarrier_init(&bars.empty[s], Cfg::kConsumers);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (warp == Cfg::kConsumers) {
    load_tiles<Cfg>(kp, stages, bars, lane);
  } else {
    consume_items<Elem, Cfg, kTerm>(kp, stages, bars, merge_out, merge_lse, unit_arrival, warp, lane);
  }
  if (kp.one_wave) merge_share<Elem, Cfg>(kp);
#endif
}

}  // namespace flashattn_ext::cuda::sm90::decode_kernel_code
