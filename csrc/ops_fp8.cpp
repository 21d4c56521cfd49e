// The attention_forward_fp8 op: query, key and value in float8 e4m3 with
// descales a (sequence, key/value head) (torch's
// _scaled_dot_product_attention_quantized, PER_HEAD: a stored x stands for
// x * descale[b, h_kv], the query's heads by their key/value head), or a
// (sequence, key/value head, block of kFp8BlockRows rows) (FA3's block
// quantization); out in bfloat16, the log-sum-exp in float32. Where the
// Hopper forward's e4m3 kernel does not take the call (it takes per-head
// descales at head dim 128: csrc/cuda/ops_fp8_cuda.cpp), every device runs it
// through attention_forward on the tensors dequantized: in float32 on the CPU
// (the values exact), in bfloat16 on CUDA (each value rounded once).
// attention_forward_quantized quantizes 16-bit inputs for it, and
// attention_backward_fp8 gives the gradients that make that trainable
// (straight through the quantization; the autograd is in autograd.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"
#include "ops_checks.h"

namespace flashattn_ext {
namespace {

// Rows a block descale covers: a multiple of the Hopper kernels' tiles.
constexpr int64_t kFp8BlockRows = 128;
constexpr float kE4M3Max = 448.f;

// Blocks of kFp8BlockRows rows that len rows take.
int64_t fp8_blocks(int64_t len) { return (len + kFp8BlockRows - 1) / kFp8BlockRows; }

// x (batch, heads, len, dim) in float32, its heads grouped by key/value head:
// (batch, heads_kv, heads / heads_kv, len, dim).
at::Tensor grouped_by_kv_head(const at::Tensor& x, int64_t heads_kv) {
  return x.to(at::kFloat).reshape({x.size(0), heads_kv, x.size(1) / heads_kv, x.size(2), x.size(3)});
}

// A descale ((batch, heads_kv), or (batch, heads_kv, blocks) one a block of
// kFp8BlockRows rows) as the factor of grouped_by_kv_head's rows of len.
at::Tensor descale_of_rows(const at::Tensor& descale, int64_t len) {
  const int64_t batch = descale.size(0), heads_kv = descale.size(1);
  if (descale.dim() == 2) return descale.reshape({batch, heads_kv, 1, 1, 1});
  return descale.repeat_interleave(kFp8BlockRows, 2).narrow(2, 0, len).view({batch, heads_kv, 1, len, 1});
}

// The checks of a descale of x (device, float32, one of the two shapes) whose
// key/value heads are heads_kv.
void check_descale(const at::Tensor& descale, const at::Tensor& x, int64_t heads_kv, const char* name,
                   const at::Tensor& like, const char* like_name) {
  check_device(descale, name, like, like_name);
  TORCH_CHECK_TYPE(descale.scalar_type() == at::kFloat, "flashattn_ext: ", name, " must be float32, got ",
                   descale.scalar_type());
  const int64_t batch = x.size(0), blocks = fp8_blocks(x.size(2));
  const bool per_head = descale.dim() == 2, per_block = descale.dim() == 3 && descale.size(2) == blocks;
  TORCH_CHECK((per_head || per_block) && descale.size(0) == batch && descale.size(1) == heads_kv, "flashattn_ext: ",
              name, " must be (batch, key/value heads) = (", batch, ", ", heads_kv, "), or with one a block of ",
              kFp8BlockRows, " rows (", batch, ", ", heads_kv, ", ", blocks, "), got shape ", descale.sizes());
}

// x times its descale in `dtype`: the dequantize_fp8 op (on CUDA, a kernel
// where the descale is one a (batch, key/value head)).
at::Tensor dequantized(const at::Tensor& x, const std::optional<at::Tensor>& descale, at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashattn_ext::dequantize_fp8", "")
                             .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, at::ScalarType)>();
  return op.call(x, descale, dtype);
}

std::tuple<at::Tensor, at::Tensor> attention_forward_fp8(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v,
                                                         const std::optional<at::Tensor>& q_descale,
                                                         const std::optional<at::Tensor>& k_descale,
                                                         const std::optional<at::Tensor>& v_descale, bool is_causal,
                                                         bool causal_lower_right, double scale, int64_t window_left,
                                                         int64_t window_right) {
  check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale);
  return attention_forward_fp8_dequantized(q, k, v, q_descale, k_descale, v_descale, is_causal, causal_lower_right,
                                           scale, window_left, window_right);
}

// The gradients of attention over the dequantized q, k and v (so, straight
// through the quantization, those of the tensors the caller quantized), from
// the e4m3 forward's out and lse; in grad_out's dtype. Until the Hopper
// backward takes e4m3 operands, every device runs attention_backward on the
// tensors dequantized as attention_forward_fp8_dequantized does.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_fp8(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale, bool is_causal, bool causal_lower_right, double scale,
    int64_t window_left, int64_t window_right) {
  check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale);
  const at::ScalarType dtype = q.is_cpu() ? at::kFloat : at::kBFloat16;
  const at::Tensor no_dropout = at::empty({0}, q.options().dtype(at::kLong));
  auto [dq, dk, dv, unused] = call_attention_backward(
      grad_out.to(dtype), dequantized(q, q_descale, dtype), dequantized(k, k_descale, dtype),
      dequantized(v, v_descale, dtype), out.to(dtype), lse, no_dropout,
      AttentionOptions{std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right},
      /*compute_grad_attn_mask=*/false, std::nullopt);
  const at::ScalarType grad_dtype = grad_out.scalar_type();
  return {dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)};
}

std::tuple<at::Tensor, at::Tensor> attention_forward_quantized(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, bool is_causal,
                                                               bool causal_lower_right, double scale,
                                                               int64_t window_left, int64_t window_right) {
  QuantizedAttention forward =
      quantized_attention_forward(q, k, v, is_causal, causal_lower_right, scale, window_left, window_right);
  return {forward.out, forward.lse};
}

}  // namespace

QuantizedAttention quantized_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               bool is_causal, bool causal_lower_right, double scale,
                                               int64_t window_left, int64_t window_right) {
  static const auto quantize = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("flashattn_ext::quantize_fp8", "")
                                   .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, bool)>();
  static const auto forward_fp8 = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("flashattn_ext::attention_forward_fp8", "")
                                      .typed<decltype(attention_forward_fp8)>();
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "flashattn_ext: attention_forward_quantized takes query, key and value of one dtype, got ",
                   q.scalar_type(), ", ", k.scalar_type(), " and ", v.scalar_type());
  check_rank4(k, "key");
  const int64_t heads_kv = k.size(1);
  QuantizedAttention f;
  std::tie(f.q8, f.q_descale) = quantize.call(q, heads_kv, false);
  std::tie(f.k8, f.k_descale) = quantize.call(k, heads_kv, false);
  std::tie(f.v8, f.v_descale) = quantize.call(v, heads_kv, false);
  std::tie(f.fp8_out, f.lse) = forward_fp8.call(f.q8, f.k8, f.v8, f.q_descale, f.k_descale, f.v_descale, is_causal,
                                                causal_lower_right, scale, window_left, window_right);
  f.out = f.fp8_out.to(q.scalar_type());
  return f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_backward_fp8(
    const at::Tensor& grad_out, const QuantizedAttention& f, bool is_causal, bool causal_lower_right, double scale,
    int64_t window_left, int64_t window_right) {
  static const auto backward_fp8 = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("flashattn_ext::attention_backward_fp8", "")
                                       .typed<decltype(attention_backward_fp8)>();
  return backward_fp8.call(grad_out, f.q8, f.k8, f.v8, f.fp8_out, f.lse, f.q_descale, f.k_descale, f.v_descale,
                           is_causal, causal_lower_right, scale, window_left, window_right);
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_aten(const at::Tensor& x, int64_t heads_kv, bool per_block) {
  check_rank4(x, "x");
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()) && x.element_size() > 1, "flashattn_ext: quantize_fp8 takes "
                   "a 16- or 32-bit float tensor, got ", x.scalar_type());
  const int64_t batch = x.size(0), heads = x.size(1), len = x.size(2), dim = x.size(3);
  TORCH_CHECK_VALUE(heads_kv > 0 && heads % heads_kv == 0, "flashattn_ext: heads_kv (", heads_kv,
                    ") must divide the ", heads, " heads");
  const int64_t blocks = per_block ? fp8_blocks(len) : 1;
  const std::vector<int64_t> descale_shape =
      per_block ? std::vector<int64_t>{batch, heads_kv, blocks} : std::vector<int64_t>{batch, heads_kv};
  if (len == 0 || blocks == 0) {
    return {x.to(at::kFloat8_e4m3fn), at::ones(descale_shape, x.options().dtype(at::kFloat))};
  }
  const int64_t rows = per_block ? blocks * kFp8BlockRows : len;
  const at::Tensor grouped = grouped_by_kv_head(x, heads_kv);
  const at::Tensor largest = at::constant_pad_nd(grouped, {0, 0, 0, rows - len})
                                 .abs()
                                 .view({batch, heads_kv, heads / heads_kv, blocks, rows / blocks, dim})
                                 .amax({2, 4, 5});
  const at::Tensor descale =
      (largest / kE4M3Max).clamp_min(std::numeric_limits<float>::min()).view(descale_shape);
  const at::Tensor quantized = (grouped / descale_of_rows(descale, len))
                                   .clamp(-kE4M3Max, kE4M3Max)
                                   .to(at::kFloat8_e4m3fn)
                                   .view(x.sizes());
  return {quantized, descale};
}

at::Tensor dequantize_fp8_aten(const at::Tensor& x, const std::optional<at::Tensor>& descale, at::ScalarType dtype) {
  check_rank4(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat8_e4m3fn, "flashattn_ext: dequantize_fp8 takes float8_e4m3fn, got ",
                   x.scalar_type());
  if (!descale.has_value() || descale->size(1) == 0) return x.to(dtype);
  const int64_t heads_kv = descale->size(1);
  TORCH_CHECK_VALUE(x.size(1) % heads_kv == 0, "flashattn_ext: dequantize_fp8's descale has ", heads_kv,
                    " key/value heads, which must divide x's ", x.size(1));
  check_descale(*descale, x, heads_kv, "descale", x, "x");
  return (grouped_by_kv_head(x, heads_kv) * descale_of_rows(*descale, x.size(2))).view(x.sizes()).to(dtype);
}

void check_fp8_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
                      const std::optional<at::Tensor>& v_descale) {
  for (const auto& [t, name] : {std::pair{&q, "query"}, std::pair{&k, "key"}, std::pair{&v, "value"}}) {
    check_rank4(*t, name);
    check_device(*t, name, q);
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat8_e4m3fn, "flashattn_ext: the FP8 attention takes ", name,
                     " as float8_e4m3fn, got ", t->scalar_type());
  }
  const int64_t batch = q.size(0), heads_kv = k.size(1);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == heads_kv, "flashattn_ext: key ",
              k.sizes(), " and value ", v.sizes(), " must have query's batch (", batch, ") and the same heads");
  TORCH_CHECK(heads_kv > 0 ? q.size(1) % heads_kv == 0 : q.size(1) == 0, "flashattn_ext: the ", heads_kv,
              " key/value heads must divide the ", q.size(1), " query heads");
  for (const auto& [d, x, name] : {std::tuple{&q_descale, &q, "q_descale"}, std::tuple{&k_descale, &k, "k_descale"},
                                   std::tuple{&v_descale, &v, "v_descale"}}) {
    if (d->has_value()) check_descale(**d, *x, heads_kv, name, q, "query");
  }
}

std::tuple<at::Tensor, at::Tensor> attention_forward_fp8_dequantized(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale, bool is_causal,
    bool causal_lower_right, double scale, int64_t window_left, int64_t window_right) {
  // The CPU computes in float32, where e4m3 times a float32 descale is exact
  // up to the product's rounding; CUDA's kernels take 16-bit inputs.
  const at::ScalarType dtype = q.is_cpu() ? at::kFloat : at::kBFloat16;
  auto [out, lse, rng_state] = call_attention_forward(
      dequantized(q, q_descale, dtype), dequantized(k, k_descale, dtype),
      dequantized(v, v_descale, dtype),
      AttentionOptions{std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right},
      std::nullopt);
  return {out.to(at::kBFloat16), lse.to(at::kFloat)};
}

TORCH_LIBRARY_FRAGMENT(flashattn_ext, m) {
  m.def(
      "attention_forward_fp8(Tensor query, Tensor key, Tensor value, Tensor? q_descale, Tensor? k_descale, "
      "Tensor? v_descale, bool is_causal, bool causal_lower_right, float scale, int window_left=-1, "
      "int window_right=-1) -> (Tensor out, Tensor lse)");
  // quantize_fp8: x (batch, heads, len, dim) as e4m3 of x / descale (rounded
  // to nearest, saturated) and its float32 descale, the largest magnitude
  // over 448 of what it covers: a (batch, key/value head) ((batch, heads_kv)),
  // or with per_block a block of kFp8BlockRows rows of those. dequantize_fp8:
  // float(x) times its descale, in dtype.
  m.def("quantize_fp8(Tensor x, int heads_kv, bool per_block=False) -> (Tensor quantized, Tensor descale)");
  m.def("dequantize_fp8(Tensor x, Tensor? descale, ScalarType dtype) -> Tensor");
  // attention_forward_quantized: 16-bit (or float32) query, key and value,
  // each quantized to e4m3 with one descale a (batch, key/value head)
  // (quantize_fp8), then attention_forward_fp8; out in query's dtype.
  // Differentiable (autograd.cpp): the gradients of attention over the
  // dequantized tensors, straight through the quantization
  // (attention_backward_fp8).
  m.def(
      "attention_forward_quantized(Tensor query, Tensor key, Tensor value, bool is_causal, bool causal_lower_right, "
      "float scale, int window_left=-1, int window_right=-1) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward_fp8(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, bool is_causal, bool causal_lower_right, "
      "float scale, int window_left=-1, int window_right=-1) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value)");
}

TORCH_LIBRARY_IMPL(flashattn_ext, CompositeExplicitAutograd, m) {
  m.impl("attention_forward_fp8", &attention_forward_fp8);
  m.impl("attention_backward_fp8", &attention_backward_fp8);
  m.impl("attention_forward_quantized", &attention_forward_quantized);
  m.impl("quantize_fp8", &quantize_fp8_aten);
  m.impl("dequantize_fp8", &dequantize_fp8_aten);
}

}  // namespace flashattn_ext
