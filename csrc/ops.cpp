// The flashattn_ext ops' argument checks and the translation to kernel params
// (the schemas: schemas.cpp).
#include "ops.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace flashattn_ext {

TensorView4d view_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), "flashattn_ext: ", name, " is on ", t.device(), " but ", like_name,
              " is on ", like.device());
}

namespace {

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

}  // namespace

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
  p.scale = options.scale;
  p.is_causal = options.is_causal;
  p.causal_lower_right = options.causal_lower_right;
  p.window_left = options.window_left;
  p.window_right = options.window_right;
  p.softcap = options.softcap;
  set_alibi(p, options.alibi_slopes);
  open_wide_window(p);
  return p;
}

at::ScalarType lse_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

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

// cache_seqlens or block_table, read in place.
IndexView index_view(const at::Tensor& t) {
  IndexView view;
  view.data = t.data_ptr();
  view.int32 = t.scalar_type() == at::kInt;
  view.stride_row = t.dim() == 2 ? t.stride(0) : 0;
  view.stride_col = t.stride(t.dim() - 1);
  return view;
}

at::Tensor heads_first(const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); }

at::Tensor empty_packed_like(const at::Tensor& t) { return at::empty({t.size(2), t.size(1), t.size(3)}, t.options()); }

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

namespace {

// cu_seqlens read to the host.
std::vector<int64_t> offsets_on_host(const at::Tensor& cu_seqlens) {
  const at::Tensor host = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  return {data, data + host.numel()};
}

// Checks cu_seqlens (as bounds, on the host): from 0 to the packed rows, not
// decreasing, no sequence longer than max_seqlen.
void check_sequence_bounds(const std::vector<int64_t>& bounds, const char* name, int64_t total, int64_t max_seqlen) {
  TORCH_CHECK_VALUE(bounds.front() == 0 && bounds.back() == total, "flashattn_ext: ", name,
                    " must start at 0 and end at the ", total, " packed tokens, got ", bounds.front(), " ... ",
                    bounds.back());
  int64_t longest = 0;
  for (size_t b = 0; b + 1 < bounds.size(); ++b) {
    TORCH_CHECK_VALUE(bounds[b + 1] >= bounds[b], "flashattn_ext: ", name, " must not decrease, got ",
                      bounds[b], " then ", bounds[b + 1], " at sequence ", b);
    longest = std::max(longest, bounds[b + 1] - bounds[b]);
  }
  TORCH_CHECK_VALUE(longest <= max_seqlen, "flashattn_ext: the max_seqlen given with ", name, " (", max_seqlen,
                    ") is below its longest sequence (", longest, ")");
}

}  // namespace

PackedBatch check_packed_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, bool is_causal, bool causal_lower_right, double scale,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<at::Tensor>& alibi_slopes) {
  for (const auto& [t, name] : {std::pair{&q, "query"}, std::pair{&k, "key"}, std::pair{&v, "value"}}) {
    TORCH_CHECK(t->dim() == 3, "flashattn_ext: ", name, " must be 3-d (total_tokens, heads, head_dim), got shape ",
                t->sizes());
  }
  TORCH_CHECK(k.size(0) == v.size(0), "flashattn_ext: key has ", k.size(0), " tokens but value has ", v.size(0));
  for (const auto& [t, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, std::pair{&cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() > 0, "flashattn_ext: ", name,
                      " must be a non-empty 1-d tensor, got shape ", t->sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "flashattn_ext: ", name,
                     " must be int32 or int64, got ", t->scalar_type());
    check_device(*t, name, q);
  }
  TORCH_CHECK_VALUE(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "flashattn_ext: cu_seqlens_q holds ",
                    cu_seqlens_q.numel() - 1, " sequences but cu_seqlens_k ", cu_seqlens_k.numel() - 1);
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0,
                    "flashattn_ext: max_seqlen_q and max_seqlen_k must be >= 0, got ", max_seqlen_q, " and ",
                    max_seqlen_k);
  // No sequence is longer than the packed rows: a larger max_seqlen says no
  // more (and would overflow where the kernels add it to an index).
  max_seqlen_q = std::min(max_seqlen_q, q.size(0));
  max_seqlen_k = std::min(max_seqlen_k, k.size(0));
  static const std::optional<at::Tensor> no_attn_mask;  // (AttentionOptions holds a reference to it)
  const AttentionOptions options{no_attn_mask, 0.0,     is_causal, causal_lower_right, scale, window_left,
                                 window_right, softcap, alibi_slopes};
  PackedBatch batch{heads_first(q), heads_first(k), heads_first(v), cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q,   max_seqlen_k,   options};
  // (The 4-d views checked as a dense call's: dtypes, devices, heads, head dims, options.)
  check_qkv(batch.q, batch.k, batch.v, {options.attn_mask, 0.0, options.is_causal, options.causal_lower_right,
                                        options.scale, options.window_left, options.window_right, options.softcap});
  check_alibi(options.alibi_slopes, batch.sequences(), q.size(1), q);
  return batch;
}

SequenceBounds read_sequence_bounds(const PackedBatch& batch) {
  SequenceBounds bounds;
  bounds.q = offsets_on_host(batch.cu_seqlens_q);
  check_sequence_bounds(bounds.q, "cu_seqlens_q", batch.q.size(2), batch.max_seqlen_q);
  // (Self-attention passes one tensor for both: one read, one wait.)
  const bool same = batch.cu_seqlens_k.is_same(batch.cu_seqlens_q);
  bounds.k = same ? bounds.q : offsets_on_host(batch.cu_seqlens_k);
  check_sequence_bounds(bounds.k, "cu_seqlens_k", batch.k.size(2), batch.max_seqlen_k);
  return bounds;
}

namespace {

// What a packed batch's forward and backward params share: the problem (its
// sequences as the batch, the longest lengths as len_q and len_k), q, k, v
// and the sequences' bounds, read in place.
template <typename Params>
Params packed_params(const PackedBatch& batch) {
  Params params;
  AttentionProblem& p = params.problem;
  p = attention_problem(batch.q, batch.k, batch.v, batch.options);
  p.batch = batch.sequences();
  p.len_q = batch.max_seqlen_q;
  p.len_k = batch.max_seqlen_k;
  open_wide_window(p);
  params.q = view_of(batch.q);
  params.k = view_of(batch.k);
  params.v = view_of(batch.v);
  params.packed.cu_seqlens_q = index_view(batch.cu_seqlens_q);
  params.packed.cu_seqlens_k = index_view(batch.cu_seqlens_k);
  params.packed.total_q = batch.q.size(2);
  params.packed.total_k = batch.k.size(2);
  return params;
}

}  // namespace

FwdParams packed_forward_params(const PackedBatch& batch) { return packed_params<FwdParams>(batch); }

BwdParams packed_backward_params(const PackedBatch& batch) { return packed_params<BwdParams>(batch); }

FwdParams prepare_packed_forward(const PackedBatch& batch, at::Tensor& out, at::Tensor& lse) {
  const at::Tensor& q = batch.q;
  FwdParams params = packed_forward_params(batch);
  const AttentionProblem& p = params.problem;
  out = at::empty({q.size(2), p.heads_q, p.head_dim_v}, q.options());
  lse = at::empty({p.heads_q, q.size(2)}, q.options().dtype(lse_dtype(q.scalar_type())));
  params.out = view_of(heads_first(out));
  params.lse = lse.data_ptr();
  return params;
}

BwdParams prepare_packed_backward(const PackedBatch& batch, const at::Tensor& grad_out, const at::Tensor& out,
                                  const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const at::Tensor& q = batch.q;
  BwdParams params = packed_backward_params(batch);
  const AttentionProblem& p = params.problem;
  const std::vector<int64_t> out_shape{q.size(2), p.heads_q, p.head_dim_v};
  check_saved(out, "out", out_shape, q.scalar_type(), q);
  check_saved(grad_out, "grad_out", out_shape, q.scalar_type(), q);
  check_saved(lse, "lse", {p.heads_q, q.size(2)}, lse_dtype(q.scalar_type()), q);
  TORCH_CHECK(lse.is_contiguous(), "flashattn_ext: lse must be contiguous");
  dq = empty_packed_like(q);
  dk = empty_packed_like(batch.k);
  dv = empty_packed_like(batch.v);
  params.out = view_of(heads_first(out));
  params.dout = view_of(heads_first(grad_out));
  params.dq = view_of(heads_first(dq));
  params.dk = view_of(heads_first(dk));
  params.dv = view_of(heads_first(dv));
  params.lse = lse.data_ptr();
  return params;
}

DecodeParams prepare_decode(const DecodeArguments& args, at::Tensor& out, at::Tensor& lse) {
  const at::Tensor& q = args.q;
  check_rank4(q, "query");
  check_floating(q, "query");
  check_options({std::nullopt, 0.0, args.is_causal, /*causal_lower_right=*/true, args.scale, args.window_left,
                 args.window_right, args.softcap});
  const bool paged = args.block_table.has_value();
  const char* cache_dims = paged ? "(num_blocks, block_size, heads, head_dim) with block_table"
                                 : "(batch, heads, capacity, head_dim) without block_table";
  for (const auto& [t, name] : {std::pair{&args.k_cache, "key_cache"}, std::pair{&args.v_cache, "value_cache"}}) {
    TORCH_CHECK(t->dim() == 4, "flashattn_ext: ", name, " must be 4-d ", cache_dims, ", got shape ", t->sizes());
    check_like(*t, name, q);
  }
  // The caches as (batch or block, head, row, col).
  const at::Tensor k4 = paged ? args.k_cache.permute({0, 2, 1, 3}) : args.k_cache;
  const at::Tensor v4 = paged ? args.v_cache.permute({0, 2, 1, 3}) : args.v_cache;
  TORCH_CHECK(k4.sizes().slice(0, 3) == v4.sizes().slice(0, 3), "flashattn_ext: key_cache ", args.k_cache.sizes(),
              " and value_cache ", args.v_cache.sizes(), " must agree in all but the last dim ", cache_dims);
  const int64_t batch = q.size(0), heads_kv = k4.size(1);
  TORCH_CHECK(heads_kv > 0 ? q.size(1) % heads_kv == 0 : q.size(1) == 0, "flashattn_ext: the ", heads_kv,
              " key/value heads of the cache must divide the ", q.size(1), " query heads");
  TORCH_CHECK(k4.size(3) == q.size(3), "flashattn_ext: key_cache head dim ", k4.size(3),
              " does not match query head dim ", q.size(3));
  TORCH_CHECK(paged || k4.size(0) == batch, "flashattn_ext: key_cache has batch size ", k4.size(0),
              " but query has ", batch);

  TORCH_CHECK(args.cache_seqlens.dim() == 1 && args.cache_seqlens.size(0) == batch,
              "flashattn_ext: cache_seqlens must be 1-d with one length per sequence (", batch, "), got shape ",
              args.cache_seqlens.sizes());
  check_device(args.cache_seqlens, "cache_seqlens", q);
  TORCH_CHECK_TYPE(args.cache_seqlens.scalar_type() == at::kInt || args.cache_seqlens.scalar_type() == at::kLong,
                   "flashattn_ext: cache_seqlens must be int32 or int64, got ", args.cache_seqlens.scalar_type());

  DecodeParams params;
  params.cache_seqlens = index_view(args.cache_seqlens);
  int64_t capacity = k4.size(2);
  if (paged) {
    const at::Tensor& block_table = *args.block_table;
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
                "flashattn_ext: block_table must be 2-d (batch = ", batch, ", blocks per sequence), got shape ",
                block_table.sizes());
    check_device(block_table, "block_table", q);
    TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
                     "flashattn_ext: block_table must be int32 or int64, got ", block_table.scalar_type());
    TORCH_CHECK_VALUE(k4.size(2) > 0, "flashattn_ext: the cache's blocks must hold at least one row, got shape ",
                      args.k_cache.sizes());
    params.block_table = index_view(block_table);
    params.block_size = k4.size(2);
    params.num_blocks = k4.size(0);
    TORCH_CHECK_VALUE(!c10::mul_overflows(block_table.size(1), params.block_size, &capacity),
                      "flashattn_ext: block_table's ", block_table.size(1), " blocks a sequence of ",
                      params.block_size, " rows hold more keys than an int64 counts");
  }

  TORCH_CHECK(args.k_new.has_value() == args.v_new.has_value(),
              "flashattn_ext: key_new and value_new must be given together");
  if (args.k_new.has_value()) {
    const at::Tensor &k_new = *args.k_new, &v_new = *args.v_new;
    check_rank4(k_new, "key_new");
    check_rank4(v_new, "value_new");
    check_like(k_new, "key_new", q);
    check_like(v_new, "value_new", q);
    const std::vector<int64_t> k_shape{batch, heads_kv, k_new.size(2), k4.size(3)};
    const std::vector<int64_t> v_shape{batch, heads_kv, k_new.size(2), v4.size(3)};
    TORCH_CHECK(k_new.sizes() == at::IntArrayRef(k_shape) && v_new.sizes() == at::IntArrayRef(v_shape),
                "flashattn_ext: key_new and value_new must have shapes ", at::IntArrayRef(k_shape), " and ",
                at::IntArrayRef(v_shape), " (batch, cache heads, new tokens, head dim), got ", k_new.sizes(), " and ",
                v_new.sizes());
    for (const auto& [cache, name] : {std::pair{&args.k_cache, "key_cache"}, std::pair{&args.v_cache, "value_cache"}}) {
      TORCH_CHECK(at::has_internal_overlap(*cache) != at::MemOverlap::Yes, "flashattn_ext: ", name,
                  " has elements that share memory (an expanded view?): the new keys and values cannot be written "
                  "into it");
    }
    params.k_new = view_of(k_new);
    params.v_new = view_of(v_new);
    params.len_new = k_new.size(2);
  }

  AttentionProblem& p = params.problem;
  p.batch = batch;
  p.heads_q = q.size(1);
  p.heads_kv = heads_kv;
  p.len_q = q.size(2);
  p.len_k = capacity;
  p.head_dim = q.size(3);
  p.head_dim_v = v4.size(3);
  p.scale = args.scale;
  p.is_causal = args.is_causal;
  p.causal_lower_right = true;
  p.window_left = args.window_left;
  p.window_right = args.window_right;
  p.softcap = args.softcap;
  check_alibi(args.alibi_slopes, p.batch, p.heads_q, q);
  set_alibi(p, args.alibi_slopes);
  open_wide_window(p);

  out = empty_in_layout_of(q, {p.batch, p.heads_q, p.len_q, p.head_dim_v});
  lse = at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(lse_dtype(q.scalar_type())));
  params.q = view_of(q);
  params.out = view_of(out);
  params.lse = lse.data_ptr();
  params.k_cache = view_of(k4);
  params.v_cache = view_of(v4);
  return params;
}

void check_decode_values_on_host(const DecodeParams& params) {
  const AttentionProblem& p = params.problem;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t cached = params.cache_seqlens.at(0, b);
    TORCH_CHECK_VALUE(params.length_fits(b), "flashattn_ext: sequence ", b, " has ", cached, " cached keys",
                      params.len_new > 0 ? " and " + std::to_string(params.len_new) + " new ones" : "",
                      ", but its cache holds ", p.len_k);
    if (params.block_table.data == nullptr) continue;
    const int64_t length = cached + params.len_new;  // (at most the capacity: no overflow)
    for (int64_t block = 0; block * params.block_size < length; ++block) {
      const int64_t index = params.block_table.at(b, block);
      TORCH_CHECK_VALUE(params.is_cache_block(index), "flashattn_ext: block_table[", b, ", ", block, "] is ", index,
                        ", not a block of the cache (", params.num_blocks, " blocks)");
    }
  }
}

void check_decode_values(const DecodeArguments& args, const DecodeParams& params) {
  // (cpu() of a host tensor is that tensor: no copy.)
  const at::Tensor cache_seqlens = args.cache_seqlens.cpu();
  const std::optional<at::Tensor> block_table =
      args.block_table.has_value() ? std::optional<at::Tensor>(args.block_table->cpu()) : std::nullopt;
  DecodeParams host = params;
  host.cache_seqlens = index_view(cache_seqlens);
  if (block_table.has_value()) host.block_table = index_view(*block_table);
  check_decode_values_on_host(host);
}

bool input_checks_requested() {
  const char* value = std::getenv("FLASHATTN_EXT_CHECK_INPUTS");
  return value != nullptr && std::string(value) == "1";
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
