// The argument checks, views and problem sizes that the ops' preparations
// share (declared in ops.h, or in ops_checks.h where only those files use
// them), and the FLASHATTN_EXT_CHECK_INPUTS setting.
#include "ops_checks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

namespace flashattn_ext {

TensorView4d view_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), "flashattn_ext: ", name, " is on ", t.device(), " but ", like_name,
              " is on ", like.device());
}

void check_floating(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                   "flashattn_ext: ", name, " must be float16, bfloat16, float32 or float64, got ", dtype);
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_device(t, name, q);
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "flashattn_ext: ", name, " has dtype ", t.scalar_type(),
                   " but query has dtype ", q.scalar_type());
}

void check_rank4(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "flashattn_ext: ", name, " must be 4-d (batch, heads, seq_len, head_dim), got ",
              t.dim(), "-d with shape ", t.sizes());
}

void check_options(const AttentionOptions& options) {
  TORCH_CHECK_VALUE(options.dropout_p >= 0.0 && options.dropout_p <= 1.0,
                    "flashattn_ext: dropout_p must be in [0, 1], got ", options.dropout_p);
  TORCH_CHECK_VALUE(!std::isnan(options.scale), "flashattn_ext: scale must not be NaN");
  TORCH_CHECK_VALUE(options.window_left >= -1 && options.window_right >= -1,
                    "flashattn_ext: window bounds must be >= 0, or -1 for none, got (", options.window_left, ", ",
                    options.window_right, ")");
  TORCH_CHECK_VALUE(options.softcap >= 0.0 && std::isfinite(options.softcap),
                    "flashattn_ext: softcap must be finite and >= 0 (0: off), got ", options.softcap);
}

// A window bound of len_q + len_k or more hides no key from any query (the
// diagonal's offset lies in [-len_q, len_k]): it becomes -1, open, so that no
// kernel adds it to an index (an "unbounded" sys.maxsize would overflow).
void open_wide_window(AttentionProblem& p) {
  const int64_t span = p.len_q + p.len_k;
  if (p.window_left >= span) p.window_left = -1;
  if (p.window_right >= span) p.window_right = -1;
}

// ALiBi's slopes, one per (batch, query head).
void check_alibi(const std::optional<at::Tensor>& slopes, int64_t batch, int64_t heads_q, const at::Tensor& q) {
  if (!slopes.has_value()) return;
  check_device(*slopes, "alibi_slopes", q);
  TORCH_CHECK_TYPE(slopes->scalar_type() == at::kFloat, "flashattn_ext: alibi_slopes must be float32, got ",
                   slopes->scalar_type());
  TORCH_CHECK(slopes->dim() == 2 && slopes->size(0) == batch && slopes->size(1) == heads_q,
              "flashattn_ext: alibi_slopes must have shape (batch, query heads) = (", batch, ", ", heads_q,
              "), got ", slopes->sizes());
}

// Where the problem reads the slopes.
void set_alibi(AttentionProblem& p, const std::optional<at::Tensor>& slopes) {
  if (!slopes.has_value()) return;
  p.alibi_slopes = slopes->data_ptr<float>();
  p.alibi_stride_batch = slopes->stride(0);
  p.alibi_stride_head = slopes->stride(1);
}

AttentionProblem check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const AttentionOptions& options) {
  check_rank4(q, "query");
  check_rank4(k, "key");
  check_rank4(v, "value");
  check_floating(q, "query");
  check_like(k, "key", q);
  check_like(v, "value", q);
  check_options(options);

  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "flashattn_ext: batch sizes differ: query ",
              q.size(0), ", key ", k.size(0), ", value ", v.size(0));
  TORCH_CHECK(k.size(1) == v.size(1), "flashattn_ext: key has ", k.size(1), " heads but value has ", v.size(1));
  TORCH_CHECK(k.size(1) > 0 ? q.size(1) % k.size(1) == 0 : q.size(1) == 0, "flashattn_ext: the ", k.size(1),
              " key/value heads must divide the ", q.size(1), " query heads");
  TORCH_CHECK(k.size(2) == v.size(2), "flashattn_ext: key has sequence length ", k.size(2), " but value has ",
              v.size(2));
  TORCH_CHECK(k.size(3) == q.size(3), "flashattn_ext: key head dim ", k.size(3), " does not match query head dim ",
              q.size(3));

  if (options.attn_mask.has_value()) {
    const at::Tensor& mask = *options.attn_mask;
    check_device(mask, "attn_mask", q);
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.scalar_type() == q.scalar_type(),
                     "flashattn_ext: attn_mask must be bool or have query's dtype ", q.scalar_type(), ", got ",
                     mask.scalar_type());
    const std::vector<int64_t> mask_shape{q.size(0), q.size(1), q.size(2), k.size(2)};
    TORCH_CHECK(mask.sizes() == at::IntArrayRef(mask_shape), "flashattn_ext: attn_mask must have shape ",
                at::IntArrayRef(mask_shape), " (batch, query heads, query length, key length; broadcast views are fine), got ",
                mask.sizes());
  }
  check_alibi(options.alibi_slopes, q.size(0), q.size(1), q);

  return attention_problem(q, k, v, options);
}

void check_saved(const at::Tensor& t, const char* name, at::IntArrayRef expected_shape, at::ScalarType dtype,
                 const at::Tensor& q) {
  check_device(t, name, q);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "flashattn_ext: ", name, " must have dtype ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK(t.sizes() == expected_shape, "flashattn_ext: ", name, " must have shape ", expected_shape, ", got ",
              t.sizes());
}

// An empty (B, H, L, Ev) tensor whose batch, head and row dims lie in memory
// in the order of q's (by stride, ties in dim order; the last dim contiguous),
// as SDPA's fused backends lay out their output: for q transposed from
// (B, L, H, E), the usual layout of a model's projections,
// out.transpose(1, 2).reshape(B, L, H * Ev) is then a view, not a copy.
// (_fake.py mirrors this.)
at::Tensor empty_in_layout_of(const at::Tensor& q, std::array<int64_t, 4> sizes) {
  std::array<int64_t, 3> order{0, 1, 2};  // outermost first
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return q.stride(a) > q.stride(b); });
  const at::Tensor t = at::empty({sizes[order[0]], sizes[order[1]], sizes[order[2]], sizes[3]}, q.options());
  std::array<int64_t, 4> inverse{0, 0, 0, 3};
  for (int64_t i = 0; i < 3; ++i) inverse[order[i]] = i;
  return t.permute(inverse);
}

AttentionProblem attention_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const AttentionOptions& options) {
  AttentionProblem p;
  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.heads_kv = k.size(1);
  p.len_q = q.size(2);
  p.len_k = k.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  set_options(p, options);
  return p;
}

// The options' part of a problem whose sizes are set (the window's bounds
// depend on them); attn_mask and dropout are not the problem's.
void set_options(AttentionProblem& p, const AttentionOptions& options) {
  p.scale = options.scale;
  p.is_causal = options.is_causal;
  p.causal_lower_right = options.causal_lower_right;
  p.window_left = options.window_left;
  p.window_right = options.window_right;
  p.softcap = options.softcap;
  set_alibi(p, options.alibi_slopes);
  open_wide_window(p);
}

at::ScalarType lse_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// cache_seqlens or block_table, read in place.
IndexView index_view(const at::Tensor& t) {
  IndexView view;
  view.data = t.data_ptr();
  view.int32 = t.scalar_type() == at::kInt;
  view.stride_row = t.dim() == 2 ? t.stride(0) : 0;
  view.stride_col = t.stride(t.dim() - 1);
  return view;
}

bool input_checks_requested() {
  const char* value = std::getenv("FLASHATTN_EXT_CHECK_INPUTS");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace flashattn_ext
