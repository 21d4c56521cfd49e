// What the Hopper backward kernel's roles share (flash_bwd_sm90_kernel.cuh
// puts them together): the block's shared memory and its named barriers.
#pragma once

#include "cuda/launch.cuh"
#include "cuda/sm90/bwd_producer.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// The block's shared memory (1024-byte aligned, as the swizzled tiles need:
// BwdTileConfig budgets no slack): K, V, the stages of Q, dO and the mask
// tile, the dS^T buffers, the consumers' dQ block buffers, the stages' lse and
// delta, the barriers.
template <typename Cfg>
struct BwdSharedMemory {
  unsigned char *k, *v, *q, *dout, *mask, *ds;
  // Each consumer's dQ block buffers, in dq_accum's layout, for the copy engine to add.
  float* dq;
  // Per stage: lse (in log2 units) and delta of the tile's queries.
  float (*stats)[2][Cfg::kBlockM];
  BwdBarriers<Cfg::kStages>* bars;
  static_assert(sizeof(BwdBarriers<Cfg::kStages>) <= Cfg::kBarrierBytes, "the barriers' room (BwdTileConfig)");

  __device__ __forceinline__ explicit BwdSharedMemory(unsigned char* smem)
      : k(smem),
        v(k + Cfg::kKVBytes),
        q(v + Cfg::kKVBytes),
        dout(q + Cfg::kStages * Cfg::kQBytes),
        mask(dout + Cfg::kStages * Cfg::kQBytes),
        ds(mask + Cfg::kStages * Cfg::Mask::kBytes),
        dq(reinterpret_cast<float*>(ds + Cfg::kDsBuffers * Cfg::kDsBytes)),
        stats(reinterpret_cast<float(*)[2][Cfg::kBlockM]>(dq_buffer(Cfg::kConsumers, 0))),
        bars(reinterpret_cast<BwdBarriers<Cfg::kStages>*>(stats + Cfg::kStages)) {}

  // Consumer c's dQ block buffer i.
  __device__ __forceinline__ float* dq_buffer(int consumer, int buffer) const {
    return dq + (consumer * Cfg::kDqBuffers + buffer) * Cfg::kDqBlockFloats;
  }
};

// Named barriers (0 is __syncthreads). kDsReady: both consumers' dS^T of a
// tile are in shared memory. Consumer c hands its dQ block buffer i to the dQ
// writer warp at dq_full(c, i), and gets it back empty at dq_empty(c, i).
// kDsFree (one dS^T buffer): both consumers are done with the last tile's.
// key_grad_staging(c): consumer c's warpgroup alone.
template <typename Cfg>
struct BwdNamedBarriers {
  static constexpr int kDsReady = 1;
  __device__ static constexpr int dq_full(int consumer, int buffer) { return 2 + consumer * Cfg::kDqBuffers + buffer; }
  __device__ static constexpr int dq_empty(int consumer, int buffer) {
    return 2 + (Cfg::kConsumers + consumer) * Cfg::kDqBuffers + buffer;
  }
  static constexpr int kDsFree = 2 + 2 * Cfg::kConsumers * Cfg::kDqBuffers;
  // Consumer c's own, for the dK and dV it stages (store_key_gradients).
  __device__ static constexpr int key_grad_staging(int consumer) { return kDsFree + 1 + consumer; }
  static_assert(kDsFree + Cfg::kConsumers < 16, "16 named barriers");
  // Who meets there: a consumer and the dQ writer warp (dq_full, dq_empty); both consumers (kDsReady, kDsFree).
  static constexpr int kDqHandoffThreads = kWarpgroupThreads + kWarpSize;
  static constexpr int kConsumerThreads = Cfg::kConsumers * kWarpgroupThreads;
};

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
