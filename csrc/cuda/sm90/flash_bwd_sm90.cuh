// What the Hopper backward kernels share (flash_bwd_sm90_kernel.cuh: head dims
// up to 128; flash_bwd_sm90_hdim256.cu: head dim 256; flash_bwd_sm90_mla.cu:
// MLA's 192 / 128), by role:
// bwd_scheduler.cuh, the kernel parameters, the block's place in the grid and
// its walk over the query tiles (past those an attn_mask's block map hides);
// bwd_producer.cuh, the ring of stages and the producer's loads of K and V and
// of the streamed Q and dO tiles; bwd_mainloop.cuh, the consumers' steps on a
// tile; bwd_epilogue.cuh, the final stores of dK and dV. Here: the launch.
#pragma once

#include <limits>

#include "cuda/sm90/bwd_epilogue.cuh"
#include "cuda/sm90/bwd_mainloop.cuh"
#include "cuda/sm90/bwd_producer.cuh"
#include "cuda/sm90/bwd_scheduler.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

// Builds the tensor maps, computes delta (zeroing dq_accum), then, for each
// chunk of (batch, key/value head) pairs (as many chunks as dq_accum's room
// for params.dq_accum_pairs of them needs, of sizes that differ by one at
// most), launches the kernel, one block per (kBlockN keys, key/value head,
// batch), and scales and rounds dq_accum into dq (zeroing it again before the
// next chunk). False where a tensor map cannot describe the inputs (the call
// goes to the sm80 kernels). kVarlen: a packed batch, in one chunk (its
// delta computed as that of one batch element of all the packed rows, its
// dq_accum zeroed apart).
template <typename Elem, typename Cfg, bool kVarlen = false, typename Kernel>
bool launch_backward_kernel(const BwdParams& params, Kernel kernel, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  BwdKernelParams kp;
  kp.call = params;
  constexpr bool kBFloat16 = std::is_same_v<Elem, __nv_bfloat16>;
  const MappedShape shape = mapped_shape(p, params.packed, std::max(Cfg::kBlockM, Cfg::kBlockN));
  if (!shape.fits) return false;
  const int64_t rows_q = shape.rows_q, rows_k = shape.rows_k;
  auto map = [&](CUtensorMap* m, const TensorView4d& t, int64_t cols, int64_t rows, int64_t heads, int box_rows) {
    return encode_tensor_map(m, t, cols, rows, heads, shape.tensors.batch, map_element<Elem>(), box_rows);
  };
  if (!map(&kp.q_map, params.q, p.head_dim, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.dout_map, params.dout, p.head_dim_v, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.k_map, params.k, p.head_dim, rows_k, p.heads_kv, Cfg::kBlockN) ||
      !map(&kp.v_map, params.v, p.head_dim_v, rows_k, p.heads_kv, Cfg::kBlockN)) {
    return false;
  }
  if (Cfg::Mask::kPresent &&
      !encode_mask_tiles(&kp.mask_map, &kp.mask, params.mask, Cfg::Mask::kElemBytes, p, Cfg::kBlockM)) {
    return false;
  }
  const int64_t n_blocks = ceil_div(p.len_k, Cfg::kBlockN), pairs = p.heads_kv * p.batch;
  if (n_blocks * params.dq_accum_pairs * params.head_splits > std::numeric_limits<int>::max()) {
    return false;  // the grid's limit
  }
  const ElementType type = kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16;
  if constexpr (kVarlen) {
    if (params.dq_accum_pairs != pairs) return false;  // (one chunk)
    BwdParams all_rows = params;
    all_rows.problem = shape.tensors;
    all_rows.problem.len_q = rows_q;
    all_rows.dq_accum = nullptr;
    compute_delta(all_rows, type, stream);
    cudaMemsetAsync(params.dq_accum, 0, packed_dq_accum_floats(params) * sizeof(float), stream);
  } else {
    compute_delta(params, type, stream);
  }
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  const int sms = multiprocessor_count();
  const int64_t chunks = ceil_div(pairs, params.dq_accum_pairs);
  BwdParams& chunk = kp.call;
  chunk.dq_accum_pair0 = chunk.dq_accum_pairs = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    chunk.dq_accum_pair0 += chunk.dq_accum_pairs;
    chunk.dq_accum_pairs = pairs / chunks + (c < pairs % chunks);
    if (c > 0) cudaMemsetAsync(chunk.dq_accum, 0, dq_accum_floats(p, chunk.dq_accum_pairs) * sizeof(float), stream);
    if (chunk.dq_semaphore != nullptr) {
      cudaMemsetAsync(chunk.dq_semaphore, 0, dq_semaphore_ints(p, chunk.dq_accum_pairs) * sizeof(int), stream);
    }
    // (Deterministic mode's head splits: each pair's blocks head_splits times over, in the grid as pairs.)
    const int64_t grid_pairs = chunk.dq_accum_pairs * params.head_splits;
    kp.order_chunks = one_wave_chunks(grid_pairs, n_blocks, sms);
    kernel<<<static_cast<unsigned>(n_blocks * grid_pairs), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
    convert_dq_accum(chunk, type, DqAccumLayout::kWgmmaTiles, stream);
  }
  if (params.head_splits > 1) sum_key_grad_partials(params, type, stream);
  return true;
}

// Head dim 256's dispatch (flash_bwd_sm90_hdim256.cu): a call of head dim 129
// to 256 that backward_covers, its values of the same head dim.
bool launch_hdim256_backward(const BwdParams& params, ElementType type, cudaStream_t stream);
// MLA's head dims, queries and keys of 192 with values of 128 (flash_bwd_sm90_mla.cu).
bool launch_mla_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
