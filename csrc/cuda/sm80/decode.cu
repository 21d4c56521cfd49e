// Decoding with the mma.sync kernels (flash-decoding), any GPU from Ampere on:
// each sequence's keys split into chunks, each chunk's softmax-weighted values
// of the query rows (the GQA group's heads times the query tokens, packed, so
// that a key is read once for all of them) written as a partial output and
// log-sum-exp in float; those merged. The chunk kernel: one block per (chunk,
// key/value head and block of query rows, batch), the key and value tiles
// streamed through a cp.async ring, the little arithmetic on the tensor cores.
// Hopper runs sm90/decode_sm90.cu's instead where it takes the call; decode.cu
// holds the steps around both (appending to the caches, the NaN marks).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "cuda/decode_common.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/mma_tiles.cuh"
#include "cuda/sm80/tile_config.h"

namespace flashattn_ext::cuda {
namespace {

using decoding::cache_position;
using decoding::CachePosition;
using decoding::LaneRows;
using decoding::QueryRow;
using decoding::sequence_length;
using sm80::DecodeConfig;
constexpr int kDecodeRows = decoding::kRows;
constexpr int kMergeWarps = 4;   // the merge kernel: one warp a query row
// Chunks hold at least this many keys of the capacity: fewer would spend more
// on the pipeline's start and the partial results than on the keys.
constexpr int kMinKeysPerChunk = 256;

// Where this thread's rows of one key tile lie in the caches: the outer index
// (sequence, or the block of a paged cache) and the row in it; -1 past the chunk.
// 32-bit (the glue checks the sizes): two sets are live at a time.
template <int kPasses>
struct TileRows {
  int outer[kPasses];
  int row[kPasses];
};

// The partial results of one (chunk, key/value head and block of query rows,
// sequence). Each warp runs the online softmax of the block's 16 query rows
// over its 16 keys of every tile of the chunk, with the tensor cores (mma.sync
// m16n8k16, as the sm80 forward); the tiles stream through a cp.async ring;
// the four warps' results merge in shared memory at the end.
// out_partial (batch, heads_q, len_q, chunks, head_dim_v) and lse_partial
// (batch, heads_q, len_q, chunks), float; a chunk that a row sees no key of
// gets lse -inf.
template <typename Elem, typename Cfg, decoding::ScoreTerm kTerm>
__global__ void __launch_bounds__(Cfg::kThreads) decode_chunks_kernel(const DecodeParams params, float* out_partial,
                                                                      float* lse_partial, int keys_per_chunk,
                                                                      int chunks) {
  constexpr int kHeadDim = Cfg::kHeadDim, kRows = Cfg::kRows, kBlockN = Cfg::kBlockN, kStride = Cfg::kStride,
                kStages = Cfg::kStages, kPasses = Cfg::kPasses;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kElemBytes = sizeof(Elem);
  constexpr uint32_t kTileBytes = kBlockN * kStride * kElemBytes;
  extern __shared__ __align__(16) unsigned char smem[];
  Elem* s_q = reinterpret_cast<Elem*>(smem);
  Elem* s_k = s_q + kRows * kStride;
  Elem* s_v = s_k + kStages * kBlockN * kStride;

  const AttentionProblem& p = params.problem;
  // 32-bit index arithmetic: the grid and the rows of a key/value head fit it
  // (64-bit divisions are long instruction sequences).
  const int group = static_cast<int>(p.heads_q / p.heads_kv), len_q = static_cast<int>(p.len_q);
  const int rows_per_head = group * len_q;
  const int row_blocks = static_cast<int>(ceil_div(rows_per_head, kRows));
  const int chunk = static_cast<int>(blockIdx.x % chunks), unit = static_cast<int>(blockIdx.x / chunks);
  const int row0 = unit % row_blocks * kRows;
  const int64_t h_kv = unit / row_blocks % p.heads_kv;
  const int64_t b = unit / row_blocks / p.heads_kv;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int rows = min(kRows, rows_per_head - row0);
  auto row_of = [&](int r) { return decoding::query_row(h_kv, group, len_q, row0 + r); };

  // Token t sees keys [vis.key_begin(t), vis.key_end(t)) of the sequence's:
  // bottom-right aligned, bounded by the causal mask and the sliding window.
  const int64_t length = sequence_length(params, b);
  const Visibility vis(p, p.len_q, length);
  // The chunk's keys that some token sees: chunks outside the window have none.
  const int64_t chunk_begin = int64_t{chunk} * keys_per_chunk;
  const int64_t key_begin = min(max(chunk_begin, vis.key_begin(0)), length);
  const int64_t key_end = max(key_begin, min(chunk_begin + keys_per_chunk, vis.key_end(p.len_q - 1)));
  const int tiles = static_cast<int>(ceil_div(key_end - key_begin, kBlockN));

  // Tile loads: each thread copies one 16-byte piece of every kRowsPerPass-th
  // row. Rows past the chunk and columns past the head dim read as zeros (a
  // value row of garbage would turn 0 * x into NaN). Caches whose rows are not
  // contiguous 16-byte aligned pieces are read element by element.
  const int piece_row = threadIdx.x / Cfg::kPieceSlots, piece_col = threadIdx.x % Cfg::kPieceSlots * 8;
  const TensorView4d& kc = params.k_cache;
  const TensorView4d& vc = params.v_cache;
  const Elem* k_head = static_cast<const Elem*>(kc.data) + h_kv * kc.stride_head;
  const Elem* v_head = static_cast<const Elem*>(vc.data) + h_kv * vc.stride_head;
  auto aligned = [](const TensorView4d& t, int64_t dim) {
    return t.stride_col == 1 && dim % 8 == 0 && t.stride_row % 8 == 0 && t.stride_head % 8 == 0 &&
           t.stride_batch % 8 == 0 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
  };
  const bool vector_loads = aligned(kc, p.head_dim) && aligned(vc, p.head_dim_v);

  // Finds the rows of tile t: for a paged cache, the block table's entries
  // (looked up ahead of the tile's loads, so that those wait on nothing).
  auto locate = [&](int t, TileRows<kPasses>& where) {
#pragma unroll
    for (int it = 0; it < kPasses; ++it) {
      const int64_t j = key_begin + int64_t(t) * kBlockN + piece_row + it * Cfg::kRowsPerPass;
      where.outer[it] = static_cast<int>(b);
      where.row[it] = -1;
      if (j < key_end) {
        const CachePosition at = cache_position(params, b, static_cast<int>(j));
        where.outer[it] = static_cast<int>(at.outer);
        where.row[it] = at.row;
      }
    }
  };
  auto load_row_piece = [&](Elem* dst, const Elem* head, const TensorView4d& cache, int64_t dim,
                            const TileRows<kPasses>& where, int it) {
    const bool valid = where.row[it] >= 0 && piece_col < dim;
    const Elem* src = head + int64_t(where.outer[it]) * cache.stride_batch + int64_t(where.row[it]) * cache.stride_row;
    if (vector_loads) {
      ptx::cp_async_16_l2_prefetch_256(dst, valid ? src + piece_col : head, valid);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int c = piece_col + e;
        dst[e] = valid && c < dim ? src[c * cache.stride_col] : ptx::from_float<Elem>(0.f);
      }
    }
  };
  auto load_tile = [&](int t, const TileRows<kPasses>& where) {
    if (piece_col >= kHeadDim) return;  // a slot past the row (head dim 96)
    const int stage = t % kStages;
    Elem* k_dst = s_k + (stage * kBlockN + piece_row) * kStride + piece_col;
    Elem* v_dst = s_v + (stage * kBlockN + piece_row) * kStride + piece_col;
#pragma unroll
    for (int it = 0; it < kPasses; ++it) {
      load_row_piece(k_dst + it * Cfg::kRowsPerPass * kStride, k_head, kc, p.head_dim, where, it);
      load_row_piece(v_dst + it * Cfg::kRowsPerPass * kStride, v_head, vc, p.head_dim_v, where, it);
    }
  };

  TileRows<kPasses> ahead;
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < tiles) {
      locate(t, ahead);
      load_tile(t, ahead);
    }
    ptx::cp_async_commit();
  }
  if (kStages - 1 < tiles) locate(kStages - 1, ahead);
  // The lookups of a paged cache run one tile further ahead (they get a whole
  // tile's time to land), but not at head dim 256: its tiles take twice the
  // time, and a third set of indices would spill.
  constexpr bool kTwoAhead = kPasses <= 8;
  TileRows<kPasses> after;
  if (kTwoAhead && kStages < tiles) locate(kStages, after);

  // The query rows, zero-padded to kHeadDim columns and kRows rows (their
  // layout in memory is arbitrary, and they are few: plain loads, issued
  // after the first tiles' copies so that their latency hides under those).
  for (int i = threadIdx.x; i < kRows * kHeadDim; i += Cfg::kThreads) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    Elem x = ptx::from_float<Elem>(0.f);
    if (r < rows && c < p.head_dim) {
      const QueryRow row = row_of(r);
      x = static_cast<const Elem*>(params.q.data)[b * params.q.stride_batch + row.head * params.q.stride_head +
                                                  row.token * params.q.stride_row + c * params.q.stride_col];
    }
    s_q[r * kStride + c] = x;
  }

  const LaneRows<kTerm> lane_rows(params, vis, b, h_kv, row0, rows, key_end, lane / 4, 8);

  const uint32_t q_frag = ptx::smem_addr(s_q) + a_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t warp_keys = warp * Cfg::kKeysPerWarp * kStride * kElemBytes;
  const uint32_t k_frag = ptx::smem_addr(s_k) + warp_keys + b_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t v_frag = ptx::smem_addr(s_v) + warp_keys + a_lane_offset<kStride>(lane) * kElemBytes;
  const decoding::ScoreScale score_scale(p);
  float acc[1][kDimTiles][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int t = 0; t < tiles; ++t) {
    const int64_t key0 = key_begin + int64_t(t) * kBlockN + warp * Cfg::kKeysPerWarp;
    const uint32_t visible = decoding::mask_bits(lane_rows, key0, 0, 0, lane);
    ptx::cp_async_wait<kStages - 2>();  // tile t has landed
    __syncthreads();                    // for every thread, and all are done with tile t - 1's stage
    if (t + kStages - 1 < tiles) {
      load_tile(t + kStages - 1, ahead);
      if constexpr (kTwoAhead) {
        ahead = after;
        if (t + kStages + 1 < tiles) locate(t + kStages + 1, after);
      } else if (t + kStages < tiles) {
        locate(t + kStages, ahead);
      }
    }
    ptx::cp_async_commit();

    // S = Q K^T over this warp's 16 keys, in log2 units; keys a row does not see are -inf.
    const uint32_t stage_offset = (t % kStages) * kTileBytes;
    float s[1][2][4] = {};
    mma_rows_by_rows<Elem, 1, 2, kHeadDim, kStride>(s, q_frag, k_frag + stage_offset);
    decoding::finish_scores(s[0], score_scale, lane_rows, vis, key0, 0, 0, lane, visible);
    decoding::online_softmax(s[0], row_max, row_sum, acc[0]);
    // O += P V over the warp's 16 keys.
    mma_regs_by_rows<Elem, 1, Cfg::kKeysPerWarp, kHeadDim, kStride>(acc, s, v_frag + stage_offset);
  }

  // The warps' results meet in shared memory (the ring is free once every
  // copy has landed); then each thread writes columns of the block's rows.
  ptx::cp_async_wait<0>();
  __syncthreads();
  float* s_max = reinterpret_cast<float*>(smem);  // [kWarps][kRows]
  float* s_sum = s_max + Cfg::kWarps * kRows;     // [kWarps][kRows]
  float* s_acc = s_sum + Cfg::kWarps * kRows;     // [kWarps][kRows][kHeadDim]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + half * 8;
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    if (lane % 4 == 0) {
      s_max[warp * kRows + r] = row_max[half];
      s_sum[warp * kRows + r] = sum;
    }
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      const int c = dt * 8 + (lane % 4) * 2;
      float* dst = s_acc + (warp * kRows + r) * kHeadDim + c;
      dst[0] = acc[0][dt][2 * half];
      dst[1] = acc[0][dt][2 * half + 1];
    }
  }
  __syncthreads();
  const int dim_v = static_cast<int>(p.head_dim_v);
  for (int i = threadIdx.x; i < rows * dim_v; i += Cfg::kThreads) {
    const int r = i / dim_v, c = i % dim_v;
    float max_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) max_all = fmaxf(max_all, s_max[w * kRows + r]);
    float sum = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) {
      const float m = s_max[w * kRows + r];
      const float factor = m == -INFINITY ? 0.f : exp2f(m - max_all);
      sum += s_sum[w * kRows + r] * factor;
      value += s_acc[(w * kRows + r) * kHeadDim + c] * factor;
    }
    const QueryRow row = row_of(r);
    const int64_t slot = ((b * p.heads_q + row.head) * p.len_q + row.token) * chunks + chunk;
    out_partial[slot * dim_v + c] = sum > 0.f ? value / sum : 0.f;
    // In natural-log units, as the op's lse.
    if (c == 0) lse_partial[slot] = sum > 0.f ? (max_all + log2f(sum)) * float(M_LN2) : -INFINITY;
  }
}

// out and lse of each query row from its partial results (the chunk kernels'): one warp a row.
template <typename Elem>
__global__ void merge_partials_kernel(const DecodeParams params, const float* out_partial, const float* lse_partial,
                                      int partials) {
  const AttentionProblem& p = params.problem;
  const int64_t row = blockIdx.x * int64_t{kMergeWarps} + threadIdx.x / kWarpSize;  // (batch, head, token)
  const int lane = threadIdx.x % kWarpSize;
  if (row >= p.batch * p.heads_q * p.len_q) return;
  const int64_t token = row % p.len_q, h = row / p.len_q % p.heads_q, b = row / (p.len_q * p.heads_q);
  const float* lse = lse_partial + row * partials;
  float lse_max = -INFINITY;
  for (int s = 0; s < partials; ++s) lse_max = fmaxf(lse_max, lse[s]);
  float sum = 0.f;
  for (int s = 0; s < partials; ++s) sum += lse[s] == -INFINITY ? 0.f : expf(lse[s] - lse_max);
  Elem* out = static_cast<Elem*>(params.out.data) + b * params.out.stride_batch + h * params.out.stride_head +
              token * params.out.stride_row;
  for (int c = lane; c < p.head_dim_v; c += kWarpSize) {
    float value = 0.f;
    for (int s = 0; s < partials; ++s) {
      if (lse[s] != -INFINITY) value += expf(lse[s] - lse_max) * out_partial[(row * partials + s) * p.head_dim_v + c];
    }
    out[c * params.out.stride_col] = ptx::from_float<Elem>(sum > 0.f ? value / sum : 0.f);
  }
  if (lane == 0) static_cast<float*>(params.lse)[row] = sum > 0.f ? lse_max + logf(sum) : -INFINITY;
}

// Blocks of decode_chunks_kernel that fit on one SM (its shared memory
// decides), asked once: the same on every GPU of a kind, and a wrong count
// would only cost speed.
template <typename Elem, typename Cfg>
int blocks_per_multiprocessor() {
  static const int blocks = [] {
    const auto kernel = decode_chunks_kernel<Elem, Cfg, decoding::ScoreTerm::kNone>;  // (the others' count is the same)
    const int smem_bytes = Cfg::kSmemElems * sizeof(Elem);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    int count = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, Cfg::kThreads, smem_bytes);
    return std::max(count, 1);
  }();
  return blocks;
}

int64_t row_blocks(const AttentionProblem& p) {
  return ceil_div(p.heads_q / p.heads_kv * p.len_q, kDecodeRows);
}

// Calls fn with the DecodeConfig that serves the call's head dims.
template <typename Fn>
void dispatch_decode_config(const AttentionProblem& p, Fn&& fn) {
  dispatch_head_dim(std::max(p.head_dim, p.head_dim_v),
                    [&](auto head_dim) { fn(DecodeConfig<decltype(head_dim)::value>{}); });
}

}  // namespace

int decode_partials(const DecodeParams& params, ElementType type) {
  const AttentionProblem& p = params.problem;
  if (p.heads_kv == 0 || p.batch == 0 || p.len_q == 0) return 1;
  int per_sm = 1;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_decode_config(p, [&](auto cfg) { per_sm = blocks_per_multiprocessor<decltype(elem), decltype(cfg)>(); });
  });
  // All blocks do the same work (up to the sequences' lengths), so the last
  // wave's share of the machine decides: take the fewest chunks whose waves
  // fill it within 5% of the best count's (each chunk at least kMinKeysPerChunk keys).
  const int64_t slots = int64_t{multiprocessor_count()} * per_sm;
  const int64_t units = p.batch * p.heads_kv * row_blocks(p);
  const int64_t most = std::clamp<int64_t>(p.len_k / kMinKeysPerChunk, 1, 4 * ceil_div(8 * slots, units));
  return static_cast<int>(decoding::evenest_chunks(units, slots, most));
}

void decode_attention_partials(const DecodeParams& params, ElementType type, float* out_partial, float* lse_partial,
                               int partials, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  if (p.batch * p.heads_q * p.len_q == 0) return;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    dispatch_decode_config(p, [&](auto cfg) {
      using Cfg = decltype(cfg);
      // Chunks of whole tiles.
      const int64_t keys_per_chunk = ceil_div(ceil_div(p.len_k, partials), Cfg::kBlockN) * Cfg::kBlockN;
      const int smem_bytes = Cfg::kSmemElems * sizeof(Elem);
      const int64_t blocks = partials * p.heads_kv * row_blocks(p) * p.batch;
      decoding::dispatch_score_term(params, [&](auto term) {
        const auto kernel = decode_chunks_kernel<Elem, Cfg, decltype(term)::value>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, smem_bytes, stream>>>(
            params, out_partial, lse_partial, static_cast<int>(keys_per_chunk), partials);
      });
    });
  });
}

void decode_merge(const DecodeParams& params, ElementType type, const float* out_partial, const float* lse_partial,
                  int partials, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows == 0) return;
  dispatch_element_type(type, [&](auto elem) {
    merge_partials_kernel<decltype(elem)><<<static_cast<unsigned>(ceil_div(rows, kMergeWarps)),
                                          kMergeWarps * kWarpSize, 0, stream>>>(params, out_partial, lse_partial,
                                                                                partials);
  });
}

}  // namespace flashattn_ext::cuda
