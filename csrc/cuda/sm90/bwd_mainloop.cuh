// The Hopper backward's consumer mainloop steps (both kernels,
// flash_bwd_sm90.cuh): per streamed query tile, P^T recomputed from the
// scores (masked at the causal diagonal, a window's edges and the end of the
// keys; softcap, ALiBi), dropout's decisions, the zeroing of dS^T for queries
// that see one key, P^T or dS^T stored to shared memory as a wgmma operand,
// and dK or dV += (P^T or dS^T) times the stage's dO or Q.
#pragma once

#include <cmath>

#include "cuda/dq_accum.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/score_modifiers.cuh"
#include "cuda/sm90/accumulators.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Logit softcapping in the backward: the scores capped as in the forward
// (softcap * tanh(scale * s / softcap), in log2 units), and dS^T times the
// cap's derivative 1 - tanh^2, its tanh taken back from the float P^T and the
// lse (log2 P + lse is the capped score): no registers kept for it.
struct BackwardSoftcap : SoftcapLog2 {
  BackwardSoftcap() = default;
  __device__ __forceinline__ explicit BackwardSoftcap(const AttentionProblem& p) : SoftcapLog2(p) {}

  // (0 where P is: the pair is hidden or its weight underflowed, and its dS is 0.)
  __device__ __forceinline__ float cap_derivative(float p, float lse_log2) const {
    const float t = tanh_of(ptx::log2_approx(p) + lse_log2);  // (taken whatever p: no branch)
    return p > 0.f ? derivative(t) : 0.f;
  }
};

// A consumer's 64 keys x kBlockM queries of a tile's scores S^T become P^T =
// exp2(S^T * score_scale - lse) (lse_q: the tile's queries' lse in log2
// units, +inf for rows past the end and rows that see no key, whose P is then
// 0). Only tiles on the causal diagonal, a window's edges (kWindow) or at the
// end of the keys hide pairs; there, in 32-bit tile coordinates, key >=
// key_end is past the end, key - query > right_edge right of the diagonal (or
// the window's right edge) and key - query < left_edge left of the window.
// key_row: the thread's first key in the block (the other is key_row + 8); its
// queries are its accumulator's columns. kSoftcap: the scores are capped
// (softcap) instead of scaled by score_scale; kAlibi: scaled, then less
// alibi_log2 * |i + offset - j| (ALiBi's bias in log2 units).
template <int kBlockN, bool kWindow, bool kSoftcap = false, bool kAlibi = false, int kBlockM, int kRegs>
__device__ __forceinline__ void transposed_probabilities(float (&st)[kRegs], const AttentionProblem& p, int64_t col0,
                                                         int64_t row0, const Visibility& seen, int key_row, int lane,
                                                         const float (&lse_q)[kBlockM], float score_scale,
                                                         const BackwardSoftcap& softcap = {}, float alibi_log2 = 0.f) {
  // i + offset - j at the tile's (key 0, query 0): 32 bits, as the tile coordinates.
  const int corner = kAlibi ? static_cast<int>(row0 + seen.offset - col0) : 0;
  auto log2_score = [&](float s, int key, int query) {
    if constexpr (kSoftcap) return softcap.capped_approx(s);
    if constexpr (kAlibi) {
      return fmaf(s, score_scale, alibi_bias(alibi_log2, fabsf(static_cast<float>(corner + query - key))));
    }
    return s * score_scale;
  };
  const bool crosses_edge = kWindow ? seen.tile_is_partial(row0, kBlockM, col0, kBlockN)
                                    : p.is_causal && col0 + kBlockN - 1 > row0 + seen.offset;
  const bool crosses_end = col0 + kBlockN > seen.len_k;
  if (crosses_edge || crosses_end) {
    const int key_end = static_cast<int>(min(seen.len_k - col0, int64_t{kBlockN}));
    auto in_tile = [](int64_t d) { return static_cast<int>(clamp_index(d, -kBlockM, kBlockN)); };
    const int right_edge = crosses_edge && seen.right >= 0 ? in_tile(row0 + seen.offset + seen.right - col0) : kBlockN;
    const int left_edge = kWindow && seen.left >= 0 ? in_tile(row0 + seen.offset - seen.left - col0) : -kBlockM;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int key = key_row + accumulator_row_offset(i), query = accumulator_column(i, lane);
      const bool hidden = key >= key_end || key - query > right_edge || (kWindow && key - query < left_edge);
      st[i] = hidden ? 0.f : ptx::exp2_approx(log2_score(st[i], key, query) - lse_q[query]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int key = key_row + accumulator_row_offset(i), query = accumulator_column(i, lane);
      st[i] = ptx::exp2_approx(log2_score(st[i], key, query) - lse_q[query]);
    }
  }
}

// In the first key block (col0 == 0), zeroes the dS^T of key 0 for the
// tile's queries that see key 0 alone, exactly 0 there (visibility.cuh):
// the holder's key 0 scores are its registers at row offset 0.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_first_key_alone(float (&dst)[kRegs], const AttentionProblem& p,
                                                     const Visibility& seen, int64_t col0, int64_t row0,
                                                     bool holds_first_key, int lane) {
  if (col0 != 0) return;  // a branch uniform across the CTA, and selects within it (no divergence in the loop)
  const RowRange alone = rows_seeing_first_key_alone(p.is_causal, seen.len_k, seen.offset, row0, kBlockM);
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    if (accumulator_row_offset(i) != 0) continue;
    dst[i] = holds_first_key && alone.holds(accumulator_column(i, lane)) ? 0.f : dst[i];
  }
}

// With a sliding window, zeroes the dS^T of the tile's queries that see one
// key alone (exactly 0 there, as SDPA gives; the window's form of
// zero_first_key_alone). How many keys a query sees rises, stays and falls
// along the queries (the window clipped by the ends of the keys), so a tile
// has such queries only where its first or last one sees at most one key:
// only those tiles test each query.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_window_rows_seeing_one_key(float (&dst)[kRegs], const Visibility& seen,
                                                                int64_t row0, int lane) {
  auto keys_seen = [&](int64_t row) { return seen.key_end(row) - seen.key_begin(row); };
  if (keys_seen(row0) > 1 && keys_seen(min(row0 + kBlockM, seen.len_q) - 1) > 1) return;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) dst[i] = keys_seen(row0 + accumulator_column(i, lane)) == 1 ? 0.f : dst[i];
}

// Dropout's decisions for a streamed tile of kBlockM queries against a
// consumer warpgroup's 64 keys, as both backward kernels draw and apply them
// (the same Philox numbers as the forward's): keep[j][w] for the lane's 16 x
// 16 block j and its queries of parity w (dropout_block_pair_flags), drawn two
// blocks a step, before the tile's GEMMs, while their registers are not yet live.
template <int kBlockM>
struct TileDropout {
  uint32_t keep[kBlockM / 16][2] = {};

  // key0: the key of the thread's first S^T register row (col0 + key_row).
  __device__ __forceinline__ void draw(const DropoutState dropout, const AttentionProblem& p, int64_t bh,
                                       int64_t row0, int64_t key0, int lane) {
    const uint64_t group0 = dropout_group(bh, row0 + (lane % 4) * 2, key0, p.len_q, p.len_k);
    const uint64_t step = 4 * dropout_quads(p.len_k);  // 16 queries on
#pragma unroll
    for (int pair = 0; pair < kBlockM / 32; ++pair) {
      dropout_block_pair_flags<true>(*reinterpret_cast<uint32_t(*)[2][2]>(&keep[2 * pair]), dropout,
                                     group0 + 2 * pair * step, step, lane);
    }
  }
  // Whether S^T register i is kept: block i / 8, query parity i % 2, query half (i / 4) % 2, key half (i / 2) % 2.
  __device__ __forceinline__ bool keeps(int i) const {
    return dropout_flag(keep[i / 8][i % 2], ((i / 4) % 2) * 2 + (i / 2) % 2);
  }
  // P^T's A fragments (dV's operand) where kept: register r of block j is query half r / 2, key half r % 2.
  __device__ __forceinline__ void drop(uint32_t (&frag)[kBlockM / 16][4]) const {
#pragma unroll
    for (int j = 0; j < kBlockM / 16; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) frag[j][r] &= dropout_pair_mask(keep[j], r);
    }
  }
};

// Zeroes the dS^T of the tile's queries that see one key alone, by the
// window's edges or the causal diagonal (exactly 0 there, as SDPA gives, where
// rounding would leave noise); not with attention sinks, whose softmax gives
// that key less than all the weight (its dS is then not 0).
template <int kBlockM, bool kWindow, int kRegs>
__device__ __forceinline__ void zero_lone_key_rows(float (&dst)[kRegs], const BwdParams& params,
                                                   const Visibility& seen, int64_t col0, int64_t row0,
                                                   bool holds_first_key, int lane) {
  if (params.sinks != nullptr) return;
  if constexpr (kWindow) {
    zero_window_rows_seeing_one_key<kBlockM>(dst, seen, row0, lane);
  } else {
    zero_first_key_alone<kBlockM>(dst, params.problem, seen, col0, row0, holds_first_key, lane);
  }
}

// Zeroes the dS^T of the tile's queries that an attn_mask leaves one key
// (their delta marked kOneKeyRowDelta, their dS^T so far NaN: visibility.cuh).
// The warp's lanes first look at the tile's kBlockM rows together, so that a
// tile with none (nearly all) costs a few loads and a vote, not a select a score.
template <int kBlockM, int kRegs>
__device__ __forceinline__ void zero_rows_seeing_one_key(float (&dst)[kRegs], const float (&delta_q)[kBlockM],
                                                         int lane) {
  bool marked = false;
#pragma unroll
  for (int row = lane; row < kBlockM; row += kWarpSize) marked |= marks_one_key_row(delta_q[row]);
  if (!__any_sync(0xffffffffu, marked)) return;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) dst[i] = marks_one_key_row(delta_q[accumulator_column(i, lane)]) ? 0.f : dst[i];
}

// Stores a consumer's 64 keys x (16 kSteps) queries of A fragments (P^T or
// dS^T) into a tile of rows of queries, a key a row, in blocks of 64 columns
// (kColBlockBytes apart), 128-byte swizzled like the tiles the copy engine
// writes (16-byte chunk c of row r at chunk c ^ (r % 8)), so that wgmma reads
// it as it lies. Register r of step kk holds rows +0 / +8 (r % 2), columns
// +0 / +8 (r / 2) of the warp's 16 x 16 block: the four 8 x 8 matrices of one
// stmatrix, lanes 8 m .. 8 m + 7 giving the row addresses of matrix m.
template <int kColBlockBytes, int kSteps>
__device__ __forceinline__ void store_transposed_tile(unsigned char* tile, const uint32_t (&frag)[kSteps][4],
                                                      int key_row, int lane) {
  const int matrix = lane / 8, row = key_row - lane / 4 + (matrix % 2) * 8 + lane % 8;
  const uint32_t tile_addr = ptx::smem_addr(tile);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const int chunk = 2 * kk + matrix / 2;  // chunk: 8 queries
    ptx::stmatrix_x4(tile_addr + swizzled_chunk_offset<kColBlockBytes>(row, chunk), frag[kk]);
  }
}

// Waits for the wgmma groups issued but the last kPending, then fences the
// registers they wrote (accumulators or A fragments they read) for the code
// that follows.
template <int kPending, typename... Regs>
__device__ __forceinline__ void wgmma_wait_fenced(Regs&... regs) {
  ptx::wgmma_wait<kPending>();
  (fence_registers(regs), ...);
}

// grad (64 keys x N columns) += A (a 64 x 16 kSteps fragment of P^T or dS^T)
// times the stage's rows of dO or Q (rows_desc: N-major, stage 0's; a step: 16
// rows), issued as one wgmma group (not waited for).
template <typename Elem, int kRegs, int kSteps>
__device__ __forceinline__ void accumulate_key_gradient(float (&grad)[kRegs], uint32_t (&a)[kSteps][4],
                                                        uint64_t rows_desc, uint32_t stage_offset) {
  const uint64_t stage_desc = desc_advance(rows_desc, stage_offset);
  fence_registers(a);
  fence_registers(grad);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    ptx::wgmma_rs<Elem, 2 * kRegs, 1>(grad, a[kk], desc_advance(stage_desc, n_major_step_bytes(kk)), true);
  }
  ptx::wgmma_commit();
}

// Issues slice `slice` of dQ's columns = dS K over the block's keys (ds_desc:
// the tile's dS^T buffer, read M-major; k_desc: K as dQ's B operand, N-major):
// one wgmma group (the kernels that add dQ by atomics: head dim 256, MLA's).
template <typename Elem, typename Cfg, int kRegs>
__device__ __forceinline__ void issue_dq_slice_gemm(float (&dq)[kRegs], uint64_t ds_desc, uint64_t k_desc, int slice) {
  fence_registers(dq);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    ptx::wgmma_ss<Elem, kDqAccumSliceCols, 1, 1>(
        dq, desc_advance(ds_desc, n_major_step_bytes(kk)),
        desc_advance(k_desc, slice * Cfg::kKVColBlockBytes + n_major_step_bytes(kk)), kk > 0);
  }
  ptx::wgmma_commit();
}

// Adds a 64 x 64 dQ slice to its dq_accum slice by atomics (one float4 a
// thread and register quad: dq_accum's layout).
template <int kRegs>
__device__ __forceinline__ void add_dq_slice(float* dq_slice, const float (&dq)[kRegs], int tid) {
#pragma unroll
  for (int j = 0; j < kRegs / 4; ++j) {
    ptx::red_add_v4_f32(dq_slice + (j * kWarpgroupThreads + tid) * 4, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2],
                        dq[4 * j + 3]);
  }
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
