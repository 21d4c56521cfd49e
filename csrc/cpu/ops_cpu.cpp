// CPU implementations of the flashattn_ext ops.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu/flash_cpu.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v,
                                                         const std::optional<at::Tensor>& attn_mask,
                                                         double dropout_p, bool is_causal, bool causal_lower_right,
                                                         double scale, int64_t /*dropout_seed*/,
                                                         int64_t /*dropout_offset*/) {
  at::Tensor out, lse;
  const FwdParams params =
      prepare_forward(q, k, v, {attn_mask, dropout_p, is_causal, causal_lower_right, scale}, out, lse);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_forward_cpu",
                                  [&] { cpu::attention_forward<scalar_t>(params); });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    bool causal_lower_right, double scale, int64_t /*dropout_seed*/, int64_t /*dropout_offset*/,
    bool compute_grad_attn_mask) {
  at::Tensor dq, dk, dv, dmask;
  const BwdParams params =
      prepare_backward(dout, q, k, v, out, lse, {attn_mask, dropout_p, is_causal, causal_lower_right, scale},
                       compute_grad_attn_mask, dq, dk, dv, dmask);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_backward_cpu",
                                  [&] { cpu::attention_backward<scalar_t>(params); });
  return {dq, dk, dv, dmask};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
}

}  // namespace flashattn_ext
