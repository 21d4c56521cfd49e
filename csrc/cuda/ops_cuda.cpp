// CUDA implementations of the flashattn_ext ops: argument checks, device guard
// and stream. The kernels themselves are not written yet, so every call ends in
// a clear NotImplementedError after its arguments have been checked.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops.h"

namespace flashattn_ext {
namespace {

[[noreturn]] void kernels_not_written() {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "flashattn_ext: the CUDA kernels are not implemented yet; run on CPU tensors or use "
                              "torch.nn.functional.scaled_dot_product_attention on the GPU for now");
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& attn_mask,
                                                          double dropout_p, bool is_causal, bool causal_lower_right,
                                                          double scale, int64_t /*dropout_seed*/,
                                                          int64_t /*dropout_offset*/) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out, lse;
  prepare_forward(q, k, v, {attn_mask, dropout_p, is_causal, causal_lower_right, scale}, out, lse);
  kernels_not_written();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    bool causal_lower_right, double scale, int64_t /*dropout_seed*/, int64_t /*dropout_offset*/,
    bool /*compute_grad_attn_mask*/) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor dq, dk, dv, delta;
  prepare_backward(dout, q, k, v, out, lse, {attn_mask, dropout_p, is_causal, causal_lower_right, scale}, dq, dk, dv,
                   delta);
  kernels_not_written();
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
}

}  // namespace flashattn_ext
