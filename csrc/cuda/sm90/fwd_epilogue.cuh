// The Hopper forward's epilogue: a consumer warpgroup's 64 rows of output,
// normalized and rounded, to out. At head dim 128 they leave through shared
// memory and the copy engine: the consumers round them into the K buffer of
// the tile's last stage, which the producer refills only once the copy
// engine has read it (out_free, handed back by hand_back_out_stage after the
// next tile's first Q K^T is issued); at 64 and 256, and for a packed batch's
// rows whose box would cross into the next sequence, each thread stores its
// registers.
#pragma once

#include "cuda/ptx.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/sm90/tile_config.h"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

template <typename Elem, typename Cfg, bool kVarlen>
struct FwdEpilogue {
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kHeadDimV = Cfg::kHeadDimV, kOutRegs = kHeadDimV / 2;
  static constexpr bool kOutThroughSmem = Cfg::kOutThroughSmem;
  static constexpr int kOutBoxBytes = 64 * kSwizzleRowBytes;  // the out map's box: 64 rows x 64 columns

  const FwdKernelParams& kp;
  FwdSharedState<kStages>* const shared;
  unsigned char* const smem_k;
  const int consumer, tid, lane, tile_row;
  // Thread 0 of each consumer: the stage whose K buffer holds this consumer's
  // output of the previous tile while the copy engine reads it (-1: none).
  int out_stage = -1;

  __device__ __forceinline__ void hand_back_out_stage() {
    if (out_stage >= 0) {
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(&shared->out_free[out_stage]);
      out_stage = -1;
    }
  }

  // Tile t's output o (its K/V tiles end before the kv-th of the ring), each
  // row times its inv_sum.
  __device__ __forceinline__ void store(const FwdTile& t, int kv, const float (&o)[kOutRegs],
                                        const float (&inv_sum)[2]) {
    const FwdParams& params = kp.call;
    const AttentionProblem& p = params.problem;
    const int64_t row0 = t.row0;
    const int64_t len_q = kVarlen ? t.len_q : p.len_q;
    const int n_blocks = t.n_blocks;
    // In a packed batch the copy engine stores a consumer's 64 rows only where
    // they all lie in the sequence (its box would write the next one's).
    const bool box_in_sequence = !kVarlen || row0 + consumer * 64 + 64 <= len_q;
    if (kOutThroughSmem && n_blocks > 0 && box_in_sequence) {
      // Once every consumer's last Q K^T has read the last stage's K buffer
      // (its "empty" phase completed), each rounds its 64 rows into it,
      // 128-byte swizzled as the out map's boxes, and one thread has the copy
      // engine store them (clipping rows past the end and columns past the head
      // dim). That thread hands the buffer back when the copy engine has read
      // it, after the next tile's first Q K^T is issued.
      const int last = kv - 1;
      ptx::mbarrier_wait(&shared->k_empty[last % kStages], (last / kStages) & 1);
      unsigned char* s_out = smem_k + (last % kStages) * Cfg::kKBytes + consumer * Cfg::kColBlocksV * kOutBoxBytes;
      const uint32_t out_addr = ptx::smem_addr(s_out);
      // stmatrix of 16 columns (two 8-column pieces) by this warp's 16 rows:
      // lane group m = lane / 8 addresses matrix m: rows + 8 (m % 2), piece + m / 2.
      const int m = lane / 8, row = (tid / kWarpSize) * 16 + (m % 2) * 8 + lane % 8;
#pragma unroll
      for (int j = 0; j < kOutRegs / 8; ++j) {
        const uint32_t frag[4] = {ptx::pack2<Elem>(o[8 * j] * inv_sum[0], o[8 * j + 1] * inv_sum[0]),
                                  ptx::pack2<Elem>(o[8 * j + 2] * inv_sum[1], o[8 * j + 3] * inv_sum[1]),
                                  ptx::pack2<Elem>(o[8 * j + 4] * inv_sum[0], o[8 * j + 5] * inv_sum[0]),
                                  ptx::pack2<Elem>(o[8 * j + 6] * inv_sum[1], o[8 * j + 7] * inv_sum[1])};
        const int piece = 2 * j + m / 2;  // the row's 16-byte piece
        ptx::stmatrix_x4(out_addr + swizzled_chunk_offset<kOutBoxBytes>(row, piece), frag);
      }
      ptx::fence_proxy_async();
      ptx::named_barrier_sync(1 + Cfg::kConsumers + consumer, kWarpgroupThreads);
      if (tid == 0) {
        const int out_row = static_cast<int>(row0) + consumer * 64;
        if (out_row < len_q) {
          for (int c = 0; c < Cfg::kColBlocksV; ++c) {
            ptx::tma_store_4d(&kp.out_map, s_out + c * kOutBoxBytes, c * kSwizzleCols, t.q_start + out_row, t.head,
                              kVarlen ? 0 : t.batch);
          }
        }
        ptx::bulk_commit_group();
        out_stage = last % kStages;
      }
    } else {
      // The producer waits for every consumer's hand-back of the last stage's
      // K buffer: one that stores its registers hands it back unused.
      if (kOutThroughSmem && n_blocks > 0 && tid == 0) out_stage = (kv - 1) % kStages;
      // Each thread stores its registers (with no key seen, zeros). Columns past
      // the head dim (padded to the kernel's) are not stored; the check is per
      // thread, so it is made only where there are such columns.
      const int dim = static_cast<int>(p.head_dim_v);
      const bool padded = dim < kHeadDimV;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = row0 + tile_row + half * 8;
        if (row >= len_q) continue;
        const int cols0 = (lane % 4) * 2;  // this thread's columns of the row: 8 j + cols0 and the next
        Elem* out_row = head_ptr<Elem>(params.out, kVarlen ? 0 : t.batch, t.head) +
                        (t.q_start + row) * params.out.stride_row + cols0;
#pragma unroll
        for (int j = 0; j < kOutRegs / 4; ++j) {
          if (!padded || j * 8 + cols0 < dim) {
            *reinterpret_cast<uint32_t*>(out_row + j * 8) =
                ptx::pack2<Elem>(o[4 * j + 2 * half] * inv_sum[half], o[4 * j + 2 * half + 1] * inv_sum[half]);
          }
        }
      }
    }
  }
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
