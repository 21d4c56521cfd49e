// A packed batch's (the varlen ops') glue: the arguments checked, the
// sequence bounds read to the host and checked, and the forward's and
// backward's outputs and kernel params.
#include <algorithm>
#include <utility>
#include <vector>

#include "ops.h"
#include "ops_checks.h"

namespace flashattn_ext {

at::Tensor heads_first(const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); }

at::Tensor empty_packed_like(const at::Tensor& t) { return at::empty({t.size(2), t.size(1), t.size(3)}, t.options()); }

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
                               int64_t max_seqlen_k, const AttentionOptions& options) {
  TORCH_INTERNAL_ASSERT(!options.attn_mask.has_value() && options.dropout_p == 0.0,
                        "flashattn_ext: the varlen ops take no attn_mask and no dropout");
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
  PackedBatch batch{heads_first(q), heads_first(k), heads_first(v), cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q,   max_seqlen_k,   options};
  // The 4-d views checked as a dense call's (dtypes, devices, heads, head
  // dims, options), but the slopes: one row a sequence, not a batch of one.
  AttentionOptions without_slopes = options;
  without_slopes.alibi_slopes = std::nullopt;
  check_qkv(batch.q, batch.k, batch.v, without_slopes);
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

}  // namespace flashattn_ext
