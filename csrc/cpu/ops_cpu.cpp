// CPU implementations of the flashattn_ext ops.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <mutex>

#include "cpu/flash_cpu.h"
#include "fallback.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

// {seed, offset, bits} for one call's dropout: a seed drawn from torch's default
// CPU generator (so torch.manual_seed makes runs repeat), offset 0 and the
// bits set now; empty without dropout.
at::Tensor draw_rng_state(double dropout_p) {
  if (!(dropout_p > 0.0)) return at::empty({0}, at::kLong);
  auto* generator = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    seed = generator->random64();
  }
  return at::tensor({static_cast<int64_t>(seed), int64_t(0), int64_t(dropout_bits())}, at::kLong);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, bool causal_lower_right, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  at::Tensor out, lse;
  FwdParams params = prepare_forward(
      q, k, v,
      {attn_mask, dropout_p, is_causal, causal_lower_right, scale, window_left, window_right, softcap, alibi_slopes},
      out, lse);
  check_sinks(q, sinks);
  const at::Tensor rng_state = draw_rng_state(dropout_p);
  if (fallback_requested()) {
    fallback_forward(q, k, v, attn_mask, rng_state, dropout_p, params.problem, out, lse);
  } else {
    if (dropout_p > 0.0) params.dropout.rng_state = rng_state.data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_forward_cpu",
                                    [&] { cpu::attention_forward<scalar_t>(params); });
  }
  if (sinks.has_value()) merge_sinks(*sinks, out, lse);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, bool causal_lower_right, double scale, bool compute_grad_attn_mask, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  at::Tensor dq, dk, dv, dmask;
  BwdParams params = prepare_backward(
      dout, q, k, v, out, lse, rng_state,
      {attn_mask, dropout_p, is_causal, causal_lower_right, scale, window_left, window_right, softcap, alibi_slopes},
      compute_grad_attn_mask, dq, dk, dv, dmask);
  check_sinks(q, sinks);
  if (fallback_requested()) {
    fallback_backward(dout, q, k, v, attn_mask, rng_state, dropout_p, params.problem, dq, dk, dv, dmask, sinks);
    return {dq, dk, dv, dmask};
  }
  const at::Tensor sinks_double = sinks.has_value() ? sinks->to(at::kDouble).contiguous() : at::Tensor();
  if (sinks.has_value()) params.sinks = sinks_double.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_backward_cpu",
                                  [&] { cpu::attention_backward<scalar_t>(params); });
  return {dq, dk, dv, dmask};
}

at::Tensor dropout_mask_cpu(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                            int64_t len_q, int64_t len_k, int64_t row_begin, int64_t row_end) {
  const DropoutMaskShape shape =
      check_dropout_mask(rng_state, dropout_p, batch, heads, len_q, len_k, row_begin, row_end);
  at::Tensor mask = at::empty({batch, heads, row_end - row_begin, len_k}, rng_state.options().dtype(at::kBool));
  cpu::dropout_mask(shape, {dropout_p, rng_state.data_ptr<int64_t>()}, mask.data_ptr<bool>());
  return mask;
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                                        const std::optional<at::Tensor>& block_table,
                                                        const std::optional<at::Tensor>& k_new,
                                                        const std::optional<at::Tensor>& v_new, bool is_causal,
                                                        double scale, int64_t window_left, int64_t window_right,
                                                        double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                        const std::optional<at::Tensor>& sinks,
                                                        const std::optional<at::Tensor>& key_scale,
                                                        const std::optional<at::Tensor>& value_scale) {
  at::Tensor out, lse;
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, /*causal_lower_right=*/true, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  const DecodeParams params = prepare_decode(
      {q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, options, key_scale, value_scale}, out, lse);
  check_decode_values_on_host(params);
  check_sinks(q, sinks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_attention_cpu",
                                  [&] { cpu::decode_attention<scalar_t>(params); });
  if (sinks.has_value()) merge_sinks(*sinks, out, lse);
  return {out, lse};
}

std::tuple<std::string, std::string> kernel_route_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                      bool is_causal, bool causal_lower_right, double scale,
                                                      int64_t window_left, int64_t window_right, double softcap,
                                                      const std::optional<at::Tensor>& alibi_slopes, bool backward) {
  (void)backward;  // (both passes alike)
  at::Tensor out, lse;
  prepare_forward(q, k, v,
                  {attn_mask, dropout_p, is_causal, causal_lower_right, scale, window_left, window_right, softcap,
                   alibi_slopes},
                  out, lse);
  if (fallback_requested()) return {"aten", "FLASHATTN_EXT_KERNELS=aten asks for the ATen fallback"};
  return {"cpu", "the CPU kernels take every call"};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("kernel_route", &kernel_route_cpu);
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
  m.impl("sinks_backward", &sinks_backward_aten);
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace flashattn_ext
