// The dense attention ops' glue: the forward's and backward's checks,
// outputs and kernel params, attention sinks, the ops' calls through the
// dispatcher and the dropout_mask op's checks (the schemas: schemas.cpp).
#include <cmath>
#include <vector>

#include "ops.h"
#include "ops_checks.h"

namespace flashattn_ext {

namespace {

// rng_state as the forward returned it: {seed, offset, bits} with dropout, else
// empty (bits checked where rng_state is in host memory; the CUDA kernels read
// anything but 16 as 8).
void check_rng_state(const at::Tensor& rng_state, double dropout_p, const at::Tensor& q) {
  const int64_t expected_size = dropout_p > 0.0 ? kRngStateSize : 0;
  TORCH_CHECK(rng_state.dim() == 1 && rng_state.size(0) == expected_size && rng_state.scalar_type() == at::kLong &&
                  rng_state.is_contiguous(),
              "flashattn_ext: rng_state must be the forward's: ", expected_size, " int64 values for dropout_p ",
              dropout_p, ", got ", rng_state.scalar_type(), " of shape ", rng_state.sizes());
  if (expected_size > 0) check_device(rng_state, "rng_state", q);
  if (expected_size > 0 && rng_state.is_cpu()) {
    const int64_t bits = rng_state.data_ptr<int64_t>()[2];
    TORCH_CHECK(bits == 8 || bits == 16, "flashattn_ext: rng_state must be the forward's: its bits are ", bits,
                ", not 8 or 16");
  }
}

MaskKind mask_kind(const std::optional<at::Tensor>& attn_mask) {
  if (!attn_mask.has_value()) return MaskKind::kNone;
  return attn_mask->scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
}

TensorView4d optional_view(const std::optional<at::Tensor>& t) { return t.has_value() ? view_of(*t) : TensorView4d{}; }

}  // namespace

void check_sinks(const at::Tensor& q, const std::optional<at::Tensor>& sinks) {
  if (!sinks.has_value()) return;
  const at::Tensor& s = *sinks;
  check_device(s, "sinks", q);
  TORCH_CHECK(at::isFloatingType(s.scalar_type()), "flashattn_ext: sinks must be a floating-point tensor, got ",
              s.scalar_type());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == q.size(1), "flashattn_ext: sinks must have shape (", q.size(1),
              ",), one logit a query head, got ", s.sizes());
}

// (In lse's dtype, float32 or float64, from ATen operations: about one more
// read and write of out.)
void merge_sinks(const at::Tensor& sinks, at::Tensor& out, at::Tensor& lse) {
  const at::Tensor merged = at::logaddexp(lse, sinks.to(lse.scalar_type()).view({1, -1, 1}));
  // (Where the sink is -inf too, the row's lse stays -inf: a scale of 0, not exp(NaN).)
  const at::Tensor kept = at::where(merged == -INFINITY, 0.0, at::exp(lse - merged));
  out.mul_(kept.unsqueeze(-1));
  lse.copy_(merged);
}

at::Tensor sinks_gradient(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks) {
  TORCH_CHECK(lse.dim() == 3 && sinks.dim() == 1 && sinks.size(0) == lse.size(1) && delta.sizes() == lse.sizes(),
              "flashattn_ext: sinks_backward needs lse (batch, heads, len_q) and sinks (heads,), got ", lse.sizes(),
              " and ", sinks.sizes());
  const at::Tensor p_sink = (sinks.to(lse.scalar_type()).view({1, -1, 1}) - lse).exp().nan_to_num(0.0);
  return (-(p_sink * delta).sum(at::IntArrayRef{0, 2})).to(sinks.scalar_type());
}

at::Tensor sinks_backward_aten(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& sinks) {
  TORCH_CHECK(grad_out.sizes() == out.sizes(), "flashattn_ext: sinks_backward needs grad_out shaped as out ",
              out.sizes(), ", got ", grad_out.sizes());
  const at::ScalarType type = lse.scalar_type();
  return sinks_gradient((grad_out.to(type) * out.to(type)).sum(-1), lse, sinks);
}

FwdParams prepare_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options, at::Tensor& out, at::Tensor& lse) {
  FwdParams params;
  params.problem = check_qkv(q, k, v, options);
  const AttentionProblem& p = params.problem;
  out = empty_in_layout_of(q, {p.batch, p.heads_q, p.len_q, p.head_dim_v});
  lse = at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(lse_dtype(q.scalar_type())));
  params.q = view_of(q);
  params.k = view_of(k);
  params.v = view_of(v);
  params.out = view_of(out);
  params.lse = lse.data_ptr();
  params.mask_kind = mask_kind(options.attn_mask);
  params.mask = optional_view(options.attn_mask);
  params.dropout.p = options.dropout_p;
  return params;
}

BwdParams prepare_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, const at::Tensor& rng_state,
                           const AttentionOptions& options, bool compute_grad_attn_mask, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                           at::Tensor& grad_attn_mask) {
  TORCH_CHECK(!compute_grad_attn_mask || mask_kind(options.attn_mask) == MaskKind::kAdditive,
              "flashattn_ext: compute_grad_attn_mask needs a float attn_mask");
  BwdParams params;
  params.problem = check_qkv(q, k, v, options);
  const AttentionProblem& p = params.problem;
  const std::vector<int64_t> out_shape{p.batch, p.heads_q, p.len_q, p.head_dim_v};
  const std::vector<int64_t> lse_shape{p.batch, p.heads_q, p.len_q};
  check_saved(out, "out", out_shape, q.scalar_type(), q);
  check_saved(dout, "grad_out", out_shape, q.scalar_type(), q);
  check_saved(lse, "lse", lse_shape, lse_dtype(q.scalar_type()), q);
  TORCH_CHECK(lse.is_contiguous(), "flashattn_ext: lse must be contiguous");
  check_rng_state(rng_state, options.dropout_p, q);

  dq = at::empty_like(q);
  dk = at::empty_like(k);
  dv = at::empty_like(v);
  params.q = view_of(q);
  params.k = view_of(k);
  params.v = view_of(v);
  params.out = view_of(out);
  params.dout = view_of(dout);
  params.dq = view_of(dq);
  params.dk = view_of(dk);
  params.dv = view_of(dv);
  params.lse = lse.data_ptr();
  params.mask_kind = mask_kind(options.attn_mask);
  params.mask = optional_view(options.attn_mask);
  // Pairs that the kernels skip (above the causal diagonal) keep a zero gradient.
  grad_attn_mask = compute_grad_attn_mask ? at::zeros({p.batch, p.heads_q, p.len_q, p.len_k}, q.options())
                                          : at::empty({0}, q.options());
  if (compute_grad_attn_mask) params.dmask = view_of(grad_attn_mask);
  params.dropout = {options.dropout_p, options.dropout_p > 0.0 ? rng_state.data_ptr<int64_t>() : nullptr};
  return params;
}

namespace {

// The ops' signatures (schemas.cpp) and typed handles, looked up once.
using AttentionForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool, bool,
    double, int64_t, int64_t, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using AttentionBackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, double, bool, bool, double, bool, int64_t, int64_t, double,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<AttentionForwardOp> attention_forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashattn_ext::attention_forward", "")
                             .typed<AttentionForwardOp>();
  return op;
}

c10::TypedOperatorHandle<AttentionBackwardOp> attention_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashattn_ext::attention_backward", "")
                             .typed<AttentionBackwardOp>();
  return op;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const AttentionOptions& options,
                                                                      const std::optional<at::Tensor>& sinks) {
  const AttentionOptions& o = options;
  return attention_forward_op().call(q, k, v, o.attn_mask, o.dropout_p, o.is_causal, o.causal_lower_right, o.scale,
                                     o.window_left, o.window_right, o.softcap, o.alibi_slopes, sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, const AttentionOptions& options, bool compute_grad_attn_mask,
    const std::optional<at::Tensor>& sinks) {
  const AttentionOptions& o = options;
  return attention_backward_op().call(dout, q, k, v, out, lse, rng_state, o.attn_mask, o.dropout_p, o.is_causal,
                                      o.causal_lower_right, o.scale, compute_grad_attn_mask, o.window_left,
                                      o.window_right, o.softcap, o.alibi_slopes, sinks);
}

DropoutMaskShape check_dropout_mask(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                                    int64_t len_q, int64_t len_k, int64_t row_begin, int64_t row_end) {
  TORCH_CHECK_VALUE(dropout_p > 0.0 && dropout_p <= 1.0, "flashattn_ext: dropout_mask needs dropout_p in (0, 1], got ",
                    dropout_p);
  check_rng_state(rng_state, dropout_p, rng_state);
  TORCH_CHECK_VALUE(batch >= 0 && heads >= 0 && len_q >= 0 && len_k >= 0,
                    "flashattn_ext: dropout_mask needs sizes >= 0, got batch ", batch, ", heads ", heads, ", len_q ",
                    len_q, ", len_k ", len_k);
  TORCH_CHECK_VALUE(0 <= row_begin && row_begin <= row_end && row_end <= len_q, "flashattn_ext: dropout_mask rows [",
                    row_begin, ", ", row_end, ") are not within [0, len_q = ", len_q, "]");
  return {batch, heads, len_q, len_k, row_begin, row_end};
}

}  // namespace flashattn_ext
