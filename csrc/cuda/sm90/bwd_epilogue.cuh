// The Hopper backward's epilogue (both kernels, flash_bwd_sm90.cuh): a
// consumer's dK and dV, scaled and rounded, from its registers to dk and dv
// (at head dims up to 128 through shared memory: store_key_gradients).
// (dQ is accumulated in the mainloop, into dq_accum: by the copy engine at
// head dims up to 128, bwd_dq_writer.cuh, by atomics at 256.)
#pragma once

#include "cuda/ptx.cuh"
#include "cuda/sm90/accumulators.cuh"
#include "cuda/sm90/bwd_mainloop.cuh"
#include "cuda/sm90/bwd_scheduler.cuh"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Stores a consumer's dK or dV (dst, head dim `dim`; times `scale`): its rows
// key_row and key_row + 8 of the block, its accumulators' columns from col0
// on, those from first_col to the head dim (columns past it: the kernel's
// padding; before first_col: another consumer's).
template <typename Elem, bool kVarlen = false, int kGradRegs>
__device__ __forceinline__ void store_key_gradient(const TensorView4d& dst, int64_t dim, const BwdParams& params,
                                                   const BwdBlock& block, int key_row, int col0, int first_col,
                                                   int lane, const float (&grad)[kGradRegs], float scale) {
  // (A packed batch: batch 0 of the tensors, the sequence's keys from row k_start.)
  const int64_t batch = kVarlen ? 0 : block.b, len_k = kVarlen ? block.len_k : params.problem.len_k;
  Elem* head = head_ptr<Elem>(dst, batch, block.h_kv) + block.k_start * dst.stride_row;
  const bool partial = dim < col0 + 2 * kGradRegs || first_col > col0;
  const int cols0 = col0 + (lane % 4) * 2;  // this thread's columns: 8 j + cols0 and the next
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t key = block.col0 + key_row + half * 8;
    if (key >= len_k) continue;
    Elem* row = head + key * dst.stride_row + cols0;
#pragma unroll
    for (int j = 0; j < kGradRegs / 4; ++j) {
      if (partial && (j * 8 + cols0 >= dim || j * 8 + cols0 < first_col)) continue;
      *reinterpret_cast<uint32_t*>(row + j * 8) =
          ptx::pack2<Elem>(grad[4 * j + 2 * half] * scale, grad[4 * j + 2 * half + 1] * scale);
    }
  }
}

// Stores a consumer warpgroup's dK or dV (all its columns, times `scale`)
// through shared memory: rounded into `staging` (the block tile whose rows
// consumer * 64 on are the consumer's own, 128-byte swizzled, kColBlockBytes
// a 64-column block), then copied to dst's rows by 16-byte stores, the
// threads along the rows (from registers a thread holds 4 bytes of a row at a
// time: half of each 32-byte sector written, 8x the store instructions).
// Where dst's rows are not 16-byte aligned or dim is not a multiple of 8,
// store_key_gradient instead. `barrier`: a named barrier of the warpgroup's
// own; the staging rows may be written again once this returns.
template <typename Elem, bool kVarlen, int kColBlockBytes, int kGradRegs>
__device__ __forceinline__ void store_key_gradient_staged(const TensorView4d& dst, int64_t dim,
                                                          const BwdParams& params, const BwdBlock& block,
                                                          int consumer, int key_row, int lane, float (&grad)[kGradRegs],
                                                          float scale, unsigned char* staging, int barrier) {
  const int64_t batch = kVarlen ? 0 : block.b, len_k = kVarlen ? block.len_k : params.problem.len_k;
  Elem* head = head_ptr<Elem>(dst, batch, block.h_kv) + block.k_start * dst.stride_row;
  constexpr int kChunks = kGradRegs / 4;  // 16-byte chunks a row (kGradRegs / 2 columns)
  if (dim % 8 != 0 || dst.stride_row % 8 != 0 || reinterpret_cast<uintptr_t>(head) % 16 != 0) {
    store_key_gradient<Elem, kVarlen>(dst, dim, params, block, key_row, 0, 0, lane, grad, scale);
    return;
  }
#pragma unroll
  for (int i = 0; i < kGradRegs; ++i) grad[i] *= scale;
  uint32_t frag[kGradRegs / 8][4];
  to_fragments<Elem>(grad, frag);
  store_transposed_tile<kColBlockBytes>(staging, frag, key_row, lane);  // (rows of keys: as dS^T's are)
  ptx::named_barrier_sync(barrier, kWarpgroupThreads);
  const int tid = threadIdx.x % kWarpgroupThreads;
#pragma unroll
  for (int step = 0; step < 64 * kChunks / kWarpgroupThreads; ++step) {
    const int index = step * kWarpgroupThreads + tid, row = consumer * 64 + index / kChunks, chunk = index % kChunks;
    const int64_t key = block.col0 + row;
    if (key >= len_k || chunk * 8 >= dim) continue;
    *reinterpret_cast<uint4*>(head + key * dst.stride_row + chunk * 8) =
        *reinterpret_cast<const uint4*>(staging + swizzled_chunk_offset<kColBlockBytes>(row, chunk));
  }
  ptx::named_barrier_sync(barrier, kWarpgroupThreads);
}

// Stores a consumer's dK (times the scale) and dV (times dropout's 1 / (1 -
// p)), all their columns, through the consumer's rows of a block tile in
// shared memory that it alone reads (store_key_gradient_staged).
template <typename Elem, bool kVarlen, int kColBlockBytes, int kGradRegs>
__device__ __forceinline__ void store_key_gradients(const BwdParams& params, const BwdBlock& block, int consumer,
                                                    int key_row, int lane, float (&dk)[kGradRegs],
                                                    float (&dv)[kGradRegs], float dv_scale, unsigned char* staging,
                                                    int barrier) {
  const AttentionProblem& p = params.problem;
  store_key_gradient_staged<Elem, kVarlen, kColBlockBytes>(params.dk, p.head_dim, params, block, consumer, key_row,
                                                           lane, dk, static_cast<float>(p.scale), staging, barrier);
  store_key_gradient_staged<Elem, kVarlen, kColBlockBytes>(params.dv, p.head_dim_v, params, block, consumer, key_row,
                                                           lane, dv, dv_scale, staging, barrier);
}

// Deterministic mode with the query heads split (params.head_splits > 1,
// head dims up to 128): a consumer's dK (times the scale) and dV (times
// dv_scale) as float32 into the block's split of params.key_grad_partials,
// rows key_row and key_row + 8 of the block, all head_dim columns
// (sum_key_grad_partials adds the splits and rounds).
template <int kGradRegs>
__device__ __forceinline__ void store_key_grad_partials(const BwdParams& params, const BwdBlock& block, int key_row,
                                                        int lane, const float (&dk)[kGradRegs],
                                                        const float (&dv)[kGradRegs], float dv_scale) {
  const AttentionProblem& p = params.problem;
  const int64_t per_tensor = p.batch * p.heads_kv * p.len_k * p.head_dim;
  const int64_t head_rows = (block.b * p.heads_kv + block.h_kv) * p.len_k;
  const int cols0 = (lane % 4) * 2;  // this thread's columns: 8 j + cols0 and the next
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const float(&grad)[kGradRegs] = which == 0 ? dk : dv;
    const float scale = which == 0 ? static_cast<float>(p.scale) : dv_scale;
    float* head = params.key_grad_partials + (2 * block.split + which) * per_tensor + head_rows * p.head_dim;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t key = block.col0 + key_row + half * 8;
      if (key >= p.len_k) continue;
      float* row = head + key * p.head_dim + cols0;
#pragma unroll
      for (int j = 0; j < kGradRegs / 4; ++j) {
        if (j * 8 + cols0 >= p.head_dim) continue;  // (the kernel's padding)
        *reinterpret_cast<float2*>(row + j * 8) =
            make_float2(grad[4 * j + 2 * half] * scale, grad[4 * j + 2 * half + 1] * scale);
      }
    }
  }
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
