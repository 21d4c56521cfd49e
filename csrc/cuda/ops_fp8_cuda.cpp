// The attention_forward_fp8 op on CUDA: the Hopper forward's e4m3 kernel
// (cuda::sm90::attention_forward_fp8) where it takes the call (Hopper kernels
// in use, descales a (batch, key/value head), head dim 128, no window), else
// attention_forward on the tensors dequantized to bfloat16 (ops_fp8.cpp).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cuda/flash_cuda.h"
#include "cuda/route.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_fp8_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale, bool is_causal,
    bool causal_lower_right, double scale, int64_t window_left, int64_t window_right) {
  check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale);
  auto dequantized_path = [&] {
    return attention_forward_fp8_dequantized(q, k, v, q_descale, k_descale, v_descale, is_causal, causal_lower_right,
                                             scale, window_left, window_right);
  };
  const bool per_head = q_descale.has_value() && k_descale.has_value() && v_descale.has_value() &&
                        q_descale->dim() == 2 && k_descale->dim() == 2 && v_descale->dim() == 2;
  if (!per_head || !cuda::use_sm90_kernels(q)) return dequantized_path();
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cuda::sm90::Fp8FwdParams params;
  FwdParams& fwd = params.fwd;
  fwd.problem = attention_problem(
      q, k, v, AttentionOptions{std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right});
  const AttentionProblem& p = fwd.problem;
  // (The descales' storage is read as contiguous (batch, heads_kv) floats.)
  const at::Tensor qd = q_descale->contiguous(), kd = k_descale->contiguous(), vd = v_descale->contiguous();
  params.q_descale = qd.data_ptr<float>();
  params.k_descale = kd.data_ptr<float>();
  params.v_descale = vd.data_ptr<float>();
  if (!cuda::sm90::fp8_forward_covers(params)) return dequantized_path();

  at::Tensor out = at::empty({p.batch, p.heads_q, p.len_q, p.head_dim_v}, q.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(at::kFloat));
  const at::Tensor values_t = at::empty({cuda::sm90::fp8_values_t_bytes(p)}, q.options().dtype(at::kByte));
  const at::Tensor tile_counter = at::empty({1}, q.options().dtype(at::kInt));
  fwd.q = view_of(q);
  fwd.k = view_of(k);
  fwd.v = view_of(v);
  fwd.out = view_of(out);
  fwd.lse = lse.data_ptr();
  fwd.tile_counter = tile_counter.data_ptr<int>();
  params.values_t = values_t.data_ptr();
  C10_CUDA_CHECK(cudaMemsetAsync(fwd.tile_counter, 0, sizeof(int), stream));
  if (!cuda::sm90::attention_forward_fp8(params, stream)) return dequantized_path();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) { m.impl("attention_forward_fp8", &attention_forward_fp8_cuda); }

}  // namespace flashattn_ext
