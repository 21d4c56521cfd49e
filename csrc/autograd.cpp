// Autograd for the flashattn_ext ops: a torch::autograd::Function that saves
// q, k, v, out, the log-sum-exp and dropout's rng_state (never the
// probabilities or a dropout mask) and calls the backward op. Registered for
// the Autograd key, so every device shares it. With attention sinks, the
// out and log-sum-exp it saves are those with the sinks (merge_sinks in
// ops.h), the backward op is told of them, and the sinks' own gradient comes
// from the op sinks_backward. The packed batch's (varlen_forward) and the FP8
// forward of 16-bit inputs (attention_forward_quantized) have theirs below.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <type_traits>
#include <utility>

#include "fallback.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

// Calls visit(name, field) on each of the options' scalars, which an
// autograd context keeps in saved_data (the tensors, attn_mask and
// alibi_slopes, go to save_for_backward with the inputs): the one list that
// save_options and load_options share.
template <typename Options, typename Visit>
void for_each_scalar_option(Options& options, Visit visit) {
  visit("dropout_p", options.dropout_p);
  visit("is_causal", options.is_causal);
  visit("causal_lower_right", options.causal_lower_right);
  visit("scale", options.scale);
  visit("window_left", options.window_left);
  visit("window_right", options.window_right);
  visit("softcap", options.softcap);
}

void save_options(AutogradContext* ctx, const AttentionOptions& options) {
  for_each_scalar_option(options, [&](const char* name, const auto& value) { ctx->saved_data[name] = value; });
}

// The options that save_options saved, with their tensors as saved.
AttentionOptions load_options(AutogradContext* ctx, std::optional<Tensor> attn_mask,
                              std::optional<Tensor> alibi_slopes) {
  AttentionOptions options{};
  for_each_scalar_option(options, [&](const char* name, auto& value) {
    value = ctx->saved_data.at(name).to<std::decay_t<decltype(value)>>();
  });
  options.attn_mask = std::move(attn_mask);
  options.alibi_slopes = std::move(alibi_slopes);
  return options;
}

// The backward's result for an op of `inputs` inputs of which only the
// first three (q, k, v) get gradients.
variable_list qkv_gradients(Tensor dq, Tensor dk, Tensor dv, size_t inputs) {
  variable_list result(inputs);
  result[0] = std::move(dq);
  result[1] = std::move(dk);
  result[2] = std::move(dv);
  return result;
}

// A saved optional tensor (undefined: absent).
std::optional<Tensor> optional_saved(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

class FlashAttentionFunction : public torch::autograd::Function<FlashAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                               bool causal_lower_right, double scale, int64_t window_left, int64_t window_right,
                               double softcap, const std::optional<Tensor>& alibi_slopes,
                               const std::optional<Tensor>& sinks) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AttentionOptions options{attn_mask,   dropout_p,    is_causal, causal_lower_right, scale,
                                   window_left, window_right, softcap,   alibi_slopes};
    auto [out, lse, rng_state] = call_attention_forward(q, k, v, options, sinks);
    ctx->save_for_backward({q, k, v, out, lse, rng_state, attn_mask.value_or(Tensor()),
                            alibi_slopes.value_or(Tensor()), sinks.value_or(Tensor())});
    save_options(ctx, options);
    ctx->mark_non_differentiable({lse, rng_state});
    // lse and rng_state get no gradient: without this the engine would fill
    // a tensor of zeros for each, every backward.
    ctx->set_materialize_grads(false);
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(13);  // no gradient reached out: none for the inputs
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& q = saved[0];
    const Tensor& k = saved[1];
    const Tensor& v = saved[2];
    const Tensor& out = saved[3];
    const Tensor& lse = saved[4];
    const Tensor& rng_state = saved[5];
    const AttentionOptions options = load_options(ctx, optional_saved(saved[6]), optional_saved(saved[7]));
    const std::optional<Tensor> sinks = optional_saved(saved[8]);
    const bool has_mask = options.attn_mask.has_value(), has_slopes = options.alibi_slopes.has_value();
    const bool grad_attn_mask_needed = has_mask && ctx->needs_input_grad(3);
    // (The backward op's own autograd recomputes attention without the sinks.)
    TORCH_CHECK_NOT_IMPLEMENTED(!sinks.has_value() || !at::GradMode::is_enabled(),
                                "flashattn_ext: double backward of attention with sinks is not supported");

    auto [dq, dk, dv, dmask] =
        call_attention_backward(grads[0], q, k, v, out, lse, rng_state, options, grad_attn_mask_needed, sinks);
    Tensor dsinks;
    // (needs_input_grad counts the tensor arguments given: q, k, v, then those
    // of attn_mask, alibi_slopes and sinks that are.)
    if (sinks.has_value() && ctx->needs_input_grad(3 + has_mask + has_slopes)) {
      static const auto sinks_backward = c10::Dispatcher::singleton()
                                             .findSchemaOrThrow("flashattn_ext::sinks_backward", "")
                                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
      dsinks = sinks_backward.call(grads[0], out, lse, *sinks);
    }
    // One gradient per forward argument; undefined for the non-tensor ones and
    // for alibi_slopes (not differentiable).
    return {dq,       dk,       dv,       grad_attn_mask_needed ? dmask : Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), dsinks};
  }
};

std::tuple<Tensor, Tensor, Tensor> attention_forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                              const std::optional<Tensor>& attn_mask,
                                                              double dropout_p, bool is_causal,
                                                              bool causal_lower_right, double scale,
                                                              int64_t window_left, int64_t window_right,
                                                              double softcap,
                                                              const std::optional<Tensor>& alibi_slopes,
                                                              const std::optional<Tensor>& sinks) {
  const variable_list outputs = FlashAttentionFunction::apply(q, k, v, attn_mask, dropout_p, is_causal,
                                                              causal_lower_right, scale, window_left, window_right,
                                                              softcap, alibi_slopes, sinks);
  return {outputs[0], outputs[1], outputs[2]};
}

// The backward op's own autograd, for double backward: it differentiates the
// gradients of attention_for_double_backward (fallback.h), which materializes
// the scores (memory grows as len_q x len_k, as in SDPA's math backend). out
// and lse get no gradient: the recomputation covers their dependence on q, k and v.
class FlashAttentionBackwardFunction : public torch::autograd::Function<FlashAttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& rng_state,
                               const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                               bool causal_lower_right, double scale, bool compute_grad_attn_mask,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AttentionOptions options{attn_mask,   dropout_p,    is_causal, causal_lower_right, scale,
                                   window_left, window_right, softcap,   alibi_slopes};
    // (With sinks, FlashAttentionFunction refuses the double backward that
    // would differentiate this: attention_for_double_backward has none.)
    auto [dq, dk, dv, dmask] =
        call_attention_backward(dout, q, k, v, out, lse, rng_state, options, compute_grad_attn_mask, sinks);
    ctx->save_for_backward(
        {dout, q, k, v, rng_state, attn_mask.value_or(Tensor()), alibi_slopes.value_or(Tensor())});
    save_options(ctx, options);
    return {dq, dk, dv, dmask};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_mask = saved[5].defined();
    const bool float_mask = has_mask && saved[5].scalar_type() != at::kBool;
    // Triple backward differentiates this one in turn, when the engine runs with create_graph.
    const bool create_graph = at::GradMode::is_enabled();
    at::AutoGradMode enable_grad(true);
    variable_list leaves;  // dout, q, k, v[, a float mask]
    for (int i = 0; i < 4; ++i) leaves.push_back(saved[i].detach().requires_grad_());
    std::optional<Tensor> attn_mask;
    if (has_mask) attn_mask = float_mask ? saved[5].detach().requires_grad_() : saved[5];
    if (float_mask) leaves.push_back(*attn_mask);

    const AttentionOptions options = load_options(ctx, attn_mask, optional_saved(saved[6]));
    const Tensor out = attention_for_double_backward(leaves[1], leaves[2], leaves[3], saved[4], options);
    // The first gradients as functions of the leaves, then their vector-Jacobian
    // product with the incoming gradients (of dq, dk, dv[, dmask]).
    const variable_list inputs(leaves.begin() + 1, leaves.end());
    const variable_list first = torch::autograd::grad({out}, inputs, {leaves[0]}, /*retain_graph=*/true,
                                                      /*create_graph=*/true, /*allow_unused=*/true);
    variable_list outputs, grad_outputs;
    for (size_t i = 0; i < first.size(); ++i) {
      // (An empty dmask, not asked for, has no gradient to pass on.)
      if (first[i].defined() && first[i].requires_grad() && grads[i].defined() &&
          grads[i].sizes() == first[i].sizes()) {
        outputs.push_back(first[i]);
        grad_outputs.push_back(grads[i]);
      }
    }
    variable_list second(leaves.size());
    if (!outputs.empty()) {
      second = torch::autograd::grad(outputs, leaves, grad_outputs, /*retain_graph=*/create_graph, create_graph,
                                     /*allow_unused=*/true);
    }
    // One gradient per forward argument: dout, q, k, v, out, lse, rng_state, attn_mask, then the options,
    // alibi_slopes and sinks.
    return {second[0], second[1], second[2], second[3], Tensor(), Tensor(), Tensor(),
            float_mask ? second[4] : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward_autograd(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const Tensor& rng_state, const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
    bool causal_lower_right, double scale, bool compute_grad_attn_mask, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks) {
  const variable_list grads = FlashAttentionBackwardFunction::apply(
      dout, q, k, v, out, lse, rng_state, attn_mask, dropout_p, is_causal, causal_lower_right, scale,
      compute_grad_attn_mask, window_left, window_right, softcap, alibi_slopes, sinks);
  return {grads[0], grads[1], grads[2], grads[3]};
}

using VarlenForwardOp = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, int64_t, int64_t, bool, bool, double, int64_t,
                                                    int64_t, double, const std::optional<Tensor>&);
using VarlenBackwardOp = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                            const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                            int64_t, int64_t, bool, bool, double, int64_t, int64_t,
                                                            double, const std::optional<Tensor>&);

// The packed batch's forward (varlen_forward): saves q, k, v, out, lse and
// the sequences' bounds, and calls varlen_backward. (No double backward.)
class VarlenFunction : public torch::autograd::Function<VarlenFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, bool is_causal, bool causal_lower_right, double scale,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<Tensor>& alibi_slopes) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flashattn_ext::varlen_forward", "")
                               .typed<VarlenForwardOp>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                              causal_lower_right, scale, window_left, window_right, softcap, alibi_slopes);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes.value_or(Tensor())});
    save_options(ctx, {std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right, softcap});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(14);
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flashattn_ext::varlen_backward", "")
                               .typed<VarlenBackwardOp>();
    TORCH_CHECK(!at::GradMode::is_enabled(), "flashattn_ext: varlen_attention has no double backward");
    const variable_list s = ctx->get_saved_variables();
    const AttentionOptions o = load_options(ctx, std::nullopt, optional_saved(s[7]));
    auto [dq, dk, dv] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6],
                                ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt(),
                                o.is_causal, o.causal_lower_right, o.scale, o.window_left, o.window_right, o.softcap,
                                o.alibi_slopes);
    return qkv_gradients(dq, dk, dv, 14);
  }
};

std::tuple<Tensor, Tensor> varlen_forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                                   bool causal_lower_right, double scale, int64_t window_left,
                                                   int64_t window_right, double softcap,
                                                   const std::optional<Tensor>& alibi_slopes) {
  const variable_list outputs =
      VarlenFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                            causal_lower_right, scale, window_left, window_right, softcap, alibi_slopes);
  return {outputs[0], outputs[1]};
}

// The FP8 forward of 16-bit inputs (attention_forward_quantized): saves the
// e4m3 q, k, v (half the bytes of the inputs) with their descales, the FP8
// forward's out and lse, and calls attention_backward_fp8, whose gradients
// pass straight through the quantization. (No double backward.)
class QuantizedAttentionFunction : public torch::autograd::Function<QuantizedAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                               bool causal_lower_right, double scale, int64_t window_left, int64_t window_right) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const QuantizedAttention f =
        quantized_attention_forward(q, k, v, is_causal, causal_lower_right, scale, window_left, window_right);
    ctx->save_for_backward({f.q8, f.k8, f.v8, f.q_descale, f.k_descale, f.v_descale, f.fp8_out, f.lse});
    save_options(ctx, {std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right});
    ctx->mark_non_differentiable({f.lse});
    ctx->set_materialize_grads(false);
    return {f.out, f.lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(8);
    TORCH_CHECK(!at::GradMode::is_enabled(), "flashattn_ext: the FP8 attention has no double backward");
    const variable_list s = ctx->get_saved_variables();
    QuantizedAttention f;
    f.q8 = s[0], f.k8 = s[1], f.v8 = s[2], f.q_descale = s[3], f.k_descale = s[4], f.v_descale = s[5];
    f.fp8_out = s[6], f.lse = s[7];
    const AttentionOptions o = load_options(ctx, std::nullopt, std::nullopt);
    auto [dq, dk, dv] = call_attention_backward_fp8(grads[0], f, o.is_causal, o.causal_lower_right, o.scale,
                                                    o.window_left, o.window_right);
    return qkv_gradients(dq, dk, dv, 8);
  }
};

std::tuple<Tensor, Tensor> attention_forward_quantized_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                bool is_causal, bool causal_lower_right, double scale,
                                                                int64_t window_left, int64_t window_right) {
  const variable_list outputs = QuantizedAttentionFunction::apply(q, k, v, is_causal, causal_lower_right, scale,
                                                                  window_left, window_right);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, Autograd, m) {
  m.impl("attention_forward_quantized", &attention_forward_quantized_autograd);
  m.impl("attention_forward", &attention_forward_autograd);
  m.impl("attention_backward", &attention_backward_autograd);
  m.impl("varlen_forward", &varlen_forward_autograd);
}

}  // namespace flashattn_ext
