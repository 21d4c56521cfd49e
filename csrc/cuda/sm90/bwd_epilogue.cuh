// The Hopper backward's epilogue (both kernels, flash_bwd_sm90.cuh): a
// consumer's dK and dV, scaled and rounded, from its registers to dk and dv.
// (dQ is accumulated in the mainloop, into dq_accum: by the copy engine at
// head dims up to 128, flash_bwd_sm90_kernel.cuh, by atomics at 256.)
#pragma once

#include "cuda/ptx.cuh"
#include "cuda/sm90/bwd_scheduler.cuh"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Stores a consumer's dK (times the scale) and dV (times dropout's 1 / (1 -
// p)): its rows key_row and key_row + 8 of the block, its accumulators'
// columns from col0 of the head dim on. Columns past the head dim (padded to
// the kernel's) are not stored (as in the forward's output).
template <typename Elem, bool kVarlen = false, int kGradRegs>
__device__ __forceinline__ void store_key_gradients(const BwdParams& params, const BwdBlock& block, int key_row,
                                                    int col0, int lane, const float (&dk)[kGradRegs],
                                                    const float (&dv)[kGradRegs], float dv_scale) {
  const AttentionProblem& p = params.problem;
  const float scale = static_cast<float>(p.scale);
  // (A packed batch: batch 0 of the tensors, the sequence's keys from row k_start.)
  const int64_t batch = kVarlen ? 0 : block.b, len_k = kVarlen ? block.len_k : p.len_k;
  Elem* dk_head = head_ptr<Elem>(params.dk, batch, block.h_kv) + block.k_start * params.dk.stride_row;
  Elem* dv_head = head_ptr<Elem>(params.dv, batch, block.h_kv) + block.k_start * params.dv.stride_row;
  const int dim = static_cast<int>(p.head_dim);
  const bool padded = dim < col0 + 2 * kGradRegs;
  const int cols0 = col0 + (lane % 4) * 2;  // this thread's columns: 8 j + cols0 and the next
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t key = block.col0 + key_row + half * 8;
    if (key >= len_k) continue;
    Elem* dk_row = dk_head + key * params.dk.stride_row + cols0;
    Elem* dv_row = dv_head + key * params.dv.stride_row + cols0;
#pragma unroll
    for (int j = 0; j < kGradRegs / 4; ++j) {
      if (padded && j * 8 + cols0 >= dim) continue;
      *reinterpret_cast<uint32_t*>(dk_row + j * 8) =
          ptx::pack2<Elem>(dk[4 * j + 2 * half] * scale, dk[4 * j + 2 * half + 1] * scale);
      *reinterpret_cast<uint32_t*>(dv_row + j * 8) =
          ptx::pack2<Elem>(dv[4 * j + 2 * half] * dv_scale, dv[4 * j + 2 * half + 1] * dv_scale);
    }
  }
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
