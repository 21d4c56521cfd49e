// The Hopper backward's dQ writer (flash_bwd_sm90_kernel.cuh): a warp of the
// producer warpgroup that has the copy engine add each consumer's dQ block
// to dq_accum, in deterministic mode in each tile's fixed order (DqAddOrder).
#pragma once

#include "cuda/dq_accum.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/bwd_scheduler.cuh"
#include "cuda/sm90/bwd_shared.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Consumer c's dQ block of tile t in dq_accum (query head head0 + t.head,
// queries from (m_begin + t.m) * kBlockM + 64 * its row block): a
// whole dq_accum tile's slice, its rows past len_q in the padding; nullptr
// where all of them are past len_q.
template <typename Cfg, bool kVarlen>
__device__ __forceinline__ float* dq_accum_block(const AttentionProblem& p, const BwdBlock& block, const QueryTile& t,
                                                 int consumer) {
  const int64_t row0 = (block.m_begin + t.m) * Cfg::kBlockM + 64 * (consumer % Cfg::kDqRowBlocks);
  if (row0 >= (kVarlen ? block.len_q : p.len_q)) return nullptr;
  return block.dq_accum + (t.head * block.dq_accum_head_rows + row0) * Cfg::kDqAccumCols +
         (consumer / Cfg::kDqRowBlocks) * kDqAccumRowMultiple * kDqAccumSliceCols;
}

// The producer's dQ writer warp: the copy engine adds each dQ block to
// dq_accum, so the consumers only store them to shared memory. A tile's
// buffers go back to the consumers once the copy engine has read them, checked
// kDqBuffers - 1 tiles later, so that its reads overlap the next tiles. In
// deterministic mode (kOrdered) each tile's additions wait for the block's
// turn (DqAddOrder) and are counted once they have landed. Where the block
// before in each tile's order runs two tiles or more ahead (count_late),
// they are counted as the next tile's are issued, so that the landing (about
// a microsecond) overlaps the next tile; or at once if the next tile's turn
// has not come: a block that waits holding an uncounted tile deadlocks where
// the block before it reached the tile one step earlier (its count would
// wait for its own next turn, which waits for this block's count). Elsewhere
// (one tile ahead: 128-row tiles) they are counted at once, which measured
// faster there.
// (A struct that the kernel makes and runs: as a function taking these as
// arguments, the walk compiled to PTX in another order.)
template <typename Cfg, bool kVarlen, bool kOrdered>
struct BwdDqWriter {
  const BwdParams& params;
  const BwdBlock& block;
  const BwdSharedMemory<Cfg>& shared;
  const int lane;
  QueryTile t;  // the tile whose dQ blocks are added (next_query_tile's walk)

  __device__ __forceinline__ void run() {
    using Barriers = BwdNamedBarriers<Cfg>;
    constexpr int kLag = Cfg::kDqBuffers - 1;
    for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
      for (int buffer = 0; buffer < Cfg::kDqBuffers && buffer < block.tiles; ++buffer) {
        ptx::named_barrier_arrive(Barriers::dq_empty(consumer, buffer), Barriers::kDqHandoffThreads);
      }
    }
    const DqAddOrder<Cfg> order(params.problem, block);
    // (kOrdered, lane 0) The counter of the tile issued last while its
    // additions are not yet counted; else null.
    int* uncounted = nullptr;
    for (int tile = 0; next_query_tile<Cfg, kOrdered>(params, block, t); ++tile) {
      const int buffer = tile % Cfg::kDqBuffers;
      // The tile's counter (kOrdered): how many blocks have added theirs.
      int* const turns = kOrdered ? block.dq_semaphore + t.head * block.m_tiles + block.m_begin + t.m : nullptr;
      if (kOrdered && lane == 0) {
        const int rank = order.rank(static_cast<int>(block.m_begin + t.m));
        if (ptx::load_acquire(turns) != rank) {
          if (uncounted != nullptr) {  // (never wait holding a count)
            count_landed<0>(uncounted);
            uncounted = nullptr;
          }
          while (ptx::load_acquire(turns) != rank) {
          }
        }
        ptx::fence_proxy_async_global();  // (the additions below after the others')
      }
      for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
        ptx::named_barrier_sync(Barriers::dq_full(consumer, buffer), Barriers::kDqHandoffThreads);
        float* dst = dq_accum_block<Cfg, kVarlen>(params.problem, block, t, consumer);
        if (lane == 0) {
          if (dst != nullptr) {
            ptx::bulk_reduce_add_f32(dst, shared.dq_buffer(consumer, buffer), Cfg::kDqBlockFloats * sizeof(float));
          }
          ptx::bulk_commit_group();  // (empty if nothing to add: the group count stays in step)
        }
      }
      if (kOrdered && lane == 0) {
        if (!order.count_late) {
          count_landed<0>(turns);
        } else {
          if (uncounted != nullptr) count_landed<Cfg::kConsumers>(uncounted);  // (all but this tile's groups)
          uncounted = turns;
        }
      }
      if (lane == 0) ptx::bulk_wait_group_read<Cfg::kConsumers * kLag>();
      __syncwarp();
      const int read = tile - kLag;  // the tile whose buffers are read out now
      if (read >= 0 && read + Cfg::kDqBuffers < block.tiles) {
        for (int consumer = 0; consumer < Cfg::kConsumers; ++consumer) {
          ptx::named_barrier_arrive(Barriers::dq_empty(consumer, read % Cfg::kDqBuffers), Barriers::kDqHandoffThreads);
        }
      }
    }
    if (lane == 0) {  // (all the reductions landed; the last uncounted tile counted)
      if (kOrdered && uncounted != nullptr) {
        count_landed<0>(uncounted);
      } else {
        ptx::bulk_wait_group();
      }
    }
  }

  // Counts a tile's additions into its counter once all but the kPending most
  // recent bulk groups have landed.
  template <int kPending>
  static __device__ __forceinline__ void count_landed(int* turns) {
    ptx::bulk_wait_group<kPending>();
    ptx::fence_proxy_async_global();
    ptx::red_release_add(turns, 1);
  }
};

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
