// The varlen ops' path through one dense call per sequence (CPU, and CUDA
// calls that no kernel takes as a whole): views of the packed tensors in, the
// results copied into the packed outputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace flashattn_ext {
namespace {

using at::Tensor;

// Sequence b's rows [starts[b], starts[b + 1]) of a 4-d (1, heads, rows, dim) view.
Tensor rows_of(const Tensor& t, const std::vector<int64_t>& starts, int64_t b) {
  return t.narrow(2, starts[b], starts[b + 1] - starts[b]);
}

// The options of sequence b's dense call: the batch's, with its row of the
// ALiBi slopes as a batch of one, (1, heads_q).
AttentionOptions options_of_sequence(const PackedBatch& batch, int64_t b) {
  AttentionOptions options = batch.options;
  if (options.alibi_slopes.has_value()) options.alibi_slopes = options.alibi_slopes->narrow(0, b, 1);
  return options;
}

std::tuple<Tensor, Tensor> varlen_forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                              bool causal_lower_right, double scale, int64_t window_left,
                                              int64_t window_right, double softcap,
                                              const std::optional<Tensor>& alibi_slopes) {
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, causal_lower_right, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  return varlen_forward_by_sequence(
      check_packed_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options));
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward_cpu(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                       const Tensor& v, const Tensor& out, const Tensor& lse,
                                                       const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                                       bool causal_lower_right, double scale, int64_t window_left,
                                                       int64_t window_right, double softcap,
                                                       const std::optional<Tensor>& alibi_slopes) {
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, causal_lower_right, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  const PackedBatch batch =
      check_packed_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options);
  return varlen_backward_by_sequence(batch, grad_out, out, lse);
}

}  // namespace

std::tuple<Tensor, Tensor> varlen_forward_by_sequence(const PackedBatch& batch) {
  const SequenceBounds bounds = read_sequence_bounds(batch);
  const Tensor& q = batch.q;
  Tensor out = at::empty({q.size(2), q.size(1), batch.v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(1), q.size(2)}, q.options().dtype(lse_dtype(q.scalar_type())));
  for (int64_t b = 0; b < batch.sequences(); ++b) {
    const auto [seq_out, seq_lse, rng_state] =
        call_attention_forward(rows_of(q, bounds.q, b), rows_of(batch.k, bounds.k, b),
                               rows_of(batch.v, bounds.k, b), options_of_sequence(batch, b), /*sinks=*/std::nullopt);
    rows_of(heads_first(out), bounds.q, b).copy_(seq_out);
    rows_of(lse.unsqueeze(0).unsqueeze(3), bounds.q, b).copy_(seq_lse.unsqueeze(3));
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward_by_sequence(const PackedBatch& batch, const Tensor& grad_out,
                                                               const Tensor& out, const Tensor& lse) {
  const SequenceBounds bounds = read_sequence_bounds(batch);
  const Tensor& q = batch.q;
  const std::vector<int64_t> out_shape{q.size(2), q.size(1), batch.v.size(3)};
  TORCH_CHECK(out.sizes() == at::IntArrayRef(out_shape) && grad_out.sizes() == at::IntArrayRef(out_shape),
              "flashattn_ext: out and grad_out must have shape ", at::IntArrayRef(out_shape), ", got ", out.sizes(),
              " and ", grad_out.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(2),
              "flashattn_ext: lse must have shape (heads, total_q) = (", q.size(1), ", ", q.size(2), "), got ",
              lse.sizes());
  Tensor dq = empty_packed_like(q), dk = empty_packed_like(batch.k), dv = empty_packed_like(batch.v);
  const Tensor no_rng_state = at::empty({0}, q.options().dtype(at::kLong));
  for (int64_t b = 0; b < batch.sequences(); ++b) {
    const auto [seq_dq, seq_dk, seq_dv, unused] = call_attention_backward(
        rows_of(heads_first(grad_out), bounds.q, b), rows_of(q, bounds.q, b),
        rows_of(batch.k, bounds.k, b), rows_of(batch.v, bounds.k, b),
        rows_of(heads_first(out), bounds.q, b),
        rows_of(lse.unsqueeze(0).unsqueeze(3), bounds.q, b).squeeze(3).contiguous(), no_rng_state,
        options_of_sequence(batch, b), /*compute_grad_attn_mask=*/false, /*sinks=*/std::nullopt);
    rows_of(heads_first(dq), bounds.q, b).copy_(seq_dq);
    rows_of(heads_first(dk), bounds.k, b).copy_(seq_dk);
    rows_of(heads_first(dv), bounds.k, b).copy_(seq_dv);
  }
  return {dq, dk, dv};
}

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("varlen_forward", &varlen_forward_cpu);
  m.impl("varlen_backward", &varlen_backward_cpu);
}

}  // namespace flashattn_ext
