// The ATen-operation fallback (see fallback.h).
#include "fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "score_modifiers.h"

namespace flashattn_ext {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Query rows per chunk: as many as keep one chunk's scores within kFallbackChunkBytes.
int64_t rows_per_chunk(const AttentionProblem& p, at::ScalarType acc) {
  const int64_t bytes_per_row = std::max<int64_t>(1, p.batch * p.heads_q * p.len_k * int64_t(at::elementSize(acc)));
  return std::clamp<int64_t>(kFallbackChunkBytes / bytes_per_row, 1, std::max<int64_t>(p.len_q, 1));
}

// A (batch, heads_q, rows, x) tensor as (batch, heads_kv, group * rows, x):
// the query heads of a group stacked, so that one matmul with a
// (batch, heads_kv, ...) key or value covers them. (No heads: a group of 1.)
at::Tensor grouped(const at::Tensor& t, const AttentionProblem& p) {
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  return t.reshape({p.batch, p.heads_kv, group * t.size(2), t.size(3)});
}

// Rows [r0, r0 + rows) of a (batch, heads_q, len, x) tensor, grouped, in the accumulation type.
at::Tensor grouped_rows(const at::Tensor& t, const AttentionProblem& p, int64_t r0, int64_t rows,
                        at::ScalarType acc) {
  return grouped(t.narrow(2, r0, rows).to(acc), p);
}

// (batch, heads_kv, group * rows, x) back to (batch, heads_q, rows, x).
at::Tensor ungrouped(const at::Tensor& t, const AttentionProblem& p, int64_t rows) {
  return t.reshape({p.batch, p.heads_q, rows, t.size(3)});
}

// The scaled, softcapped, ALiBi-biased, masked scores of query rows [r0, r0 + rows):
// (batch, heads_q, rows, len_k). With softcap and softcap_grad given, also
// d(capped)/d(scaled) = 1 - tanh^2 into it, for the backward.
at::Tensor chunk_scores(const at::Tensor& q_rows, const at::Tensor& k_acc, const std::optional<at::Tensor>& attn_mask,
                        const AttentionProblem& p, int64_t r0, int64_t rows, at::Tensor* softcap_grad = nullptr) {
  at::Tensor s = ungrouped(at::matmul(q_rows, k_acc.transpose(-2, -1)).mul_(p.scale), p, rows);
  if (p.softcap > 0.0) {
    const Softcap<double> softcap(p, 1.0, kNaturalUnits);  // (s comes scaled)
    const at::Tensor t = at::tanh(softcap.tanh_argument(s));  // out of place: double backward differentiates through it
    if (softcap_grad != nullptr) *softcap_grad = Softcap<double>::derivative(t);
    s = softcap.from_tanh(t);
  }
  // Query row r0 + r and key j (causal, window, ALiBi), Visibility's tests in tensor form.
  const Visibility vis(p);
  const bool windowed = vis.right >= 0 || vis.left >= 0;
  at::Tensor query, key;
  if (windowed || p.alibi_slopes != nullptr) {
    query = at::arange(r0, r0 + rows, s.options().dtype(at::kLong)).unsqueeze(1);
    key = at::arange(p.len_k, s.options().dtype(at::kLong)).unsqueeze(0);
  }
  if (p.alibi_slopes != nullptr) {
    // The slopes, read in place where the problem points (the op's alibi_slopes tensor).
    const at::Tensor slopes = at::from_blob(const_cast<float*>(p.alibi_slopes), {p.batch, p.heads_q, 1, 1},
                                            {p.alibi_stride_batch, p.alibi_stride_head, 1, 1},
                                            s.options().dtype(at::kFloat));
    const at::Tensor distance = (query + vis.offset - key).abs().to(s.scalar_type());
    s.add_(alibi_bias(slopes.to(s.scalar_type()), distance));
  }
  if (attn_mask.has_value()) {
    const at::Tensor mask = attn_mask->narrow(2, r0, rows);
    if (mask.scalar_type() == at::kBool) {
      s.masked_fill_(mask.logical_not(), -kInf);
    } else {
      s.add_(mask);
    }
  }
  if (vis.right >= 0) s.masked_fill_(key > query + vis.offset + vis.right, -kInf);
  if (vis.left >= 0) s.masked_fill_(key < query + vis.offset - vis.left, -kInf);
  return s;
}

// P = softmax(s) by rows, with the row max subtracted (more accurate in float32
// than exp(s - lse)); 0 on rows that see no key. With attention sinks, each
// row's softmax spans its head's sink too, as one more score (of value 0:
// its column is dropped).
at::Tensor probabilities(const at::Tensor& s, const std::optional<at::Tensor>& sinks = std::nullopt) {
  if (!sinks.has_value()) return at::_safe_softmax(s, -1);
  const at::Tensor column = sinks->to(s.scalar_type()).view({1, -1, 1, 1}).expand({s.size(0), s.size(1), s.size(2), 1});
  return at::_safe_softmax(at::cat({s, column}, -1), -1).narrow(-1, 0, s.size(-1));
}

// Dropout's factor Z of query rows [r0, r0 + rows), (batch, heads_q, rows,
// len_k) in the accumulation type: 0 where dropped, 1 / (1 - p) where kept,
// from the same numbers as the kernels (the dropout_mask op).
at::Tensor dropout_factor(const at::Tensor& rng_state, double dropout_p, const AttentionProblem& p, int64_t r0,
                          int64_t rows, at::ScalarType acc) {
  static const auto dropout_mask =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashattn_ext::dropout_mask", "")
          .typed<at::Tensor(const at::Tensor&, double, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t)>();
  const at::Tensor keep = dropout_mask.call(rng_state, dropout_p, p.batch, p.heads_q, p.len_q, p.len_k, r0, r0 + rows);
  return keep.to(acc).mul_(dropout_keep_scale(dropout_p));
}

// The output of query rows [r0, r0 + rows) from their scores s: softmax,
// dropout, times V; (batch, heads_q, rows, Ev) in the accumulation type.
// Differentiable: the dropout factor is applied in place only where autograd
// does not track the probabilities.
at::Tensor output_rows(const at::Tensor& s, const at::Tensor& v_acc, const at::Tensor& rng_state, double dropout_p,
                       const AttentionProblem& p, int64_t r0, int64_t rows) {
  at::Tensor prob = probabilities(s);
  if (dropout_p > 0.0) {
    const at::Tensor factor = dropout_factor(rng_state, dropout_p, p, r0, rows, s.scalar_type());
    prob = prob.requires_grad() ? prob * factor : prob.mul_(factor);
  }
  return ungrouped(at::matmul(grouped(prob, p), v_acc), p, rows);
}

// The type the fallback computes in: float32 for 16-bit inputs, float64 for
// float32 and float64 ones (in float32, cuBLAS's sums over long rows came out
// 3x less accurate than torch's fused float32 kernels).
at::ScalarType accumulation_type(const at::Tensor& q) {
  return q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 ? at::kFloat : at::kDouble;
}

}  // namespace

bool kernels_requested(const char* family) {
  const char* kernels = std::getenv("FLASHATTN_EXT_KERNELS");
  return kernels != nullptr && std::strcmp(kernels, family) == 0;
}

bool fallback_requested() { return kernels_requested("aten"); }

void fallback_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, const at::Tensor& rng_state, double dropout_p,
                      const AttentionProblem& p, at::Tensor& out, at::Tensor& lse) {
  const at::ScalarType acc = accumulation_type(q);
  const at::Tensor k_acc = k.to(acc), v_acc = v.to(acc);
  const int64_t chunk = rows_per_chunk(p, acc);
  for (int64_t r0 = 0; r0 < p.len_q; r0 += chunk) {
    const int64_t rows = std::min(chunk, p.len_q - r0);
    const at::Tensor s = chunk_scores(grouped_rows(q, p, r0, rows, acc), k_acc, attn_mask, p, r0, rows);
    lse.narrow(2, r0, rows).copy_(at::logsumexp(s, -1));
    out.narrow(2, r0, rows).copy_(output_rows(s, v_acc, rng_state, dropout_p, p, r0, rows));
  }
}

void fallback_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& attn_mask, const at::Tensor& rng_state, double dropout_p,
                       const AttentionProblem& p, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                       at::Tensor& grad_attn_mask, const std::optional<at::Tensor>& sinks) {
  const at::ScalarType acc = accumulation_type(q);
  const at::Tensor k_acc = k.to(acc), v_acc = v.to(acc);
  at::Tensor dk_acc = at::zeros(k_acc.sizes(), k_acc.options());
  at::Tensor dv_acc = at::zeros(v_acc.sizes(), v_acc.options());
  const int64_t chunk = rows_per_chunk(p, acc);
  for (int64_t r0 = 0; r0 < p.len_q; r0 += chunk) {
    const int64_t rows = std::min(chunk, p.len_q - r0);
    const at::Tensor q_rows = grouped_rows(q, p, r0, rows, acc);
    at::Tensor softcap_grad;
    const at::Tensor prob = probabilities(chunk_scores(q_rows, k_acc, attn_mask, p, r0, rows, &softcap_grad), sinks);
    const at::Tensor dout_rows = grouped_rows(dout, p, r0, rows, acc);
    // With dropout, the output used P * Z: dV = (P * Z)^T dO and dP = Z * dO V^T.
    const at::Tensor factor = dropout_p > 0.0 ? dropout_factor(rng_state, dropout_p, p, r0, rows, acc) : at::Tensor();
    const at::Tensor prob_used = factor.defined() ? prob * factor : prob;
    dv_acc.add_(at::matmul(grouped(prob_used, p).transpose(-2, -1), dout_rows));
    at::Tensor dprob = ungrouped(at::matmul(dout_rows, v_acc.transpose(-2, -1)), p, rows);
    if (factor.defined()) dprob.mul_(factor);
    // delta = rowsum(P * dP), which is rowsum(dO * O) but summed from the same
    // P and dP as dS: not from the output rounded to the input type (16-bit
    // gradients came out far less accurate that way), and a row that sees one
    // key gets dS = 0 exactly, as in SDPA.
    const at::Tensor delta = (prob * dprob).sum(-1, true);
    at::Tensor dscores = prob * (dprob - delta);  // gradient of the masked, scaled (and capped) scores
    if (grad_attn_mask.numel() > 0) grad_attn_mask.narrow(2, r0, rows).copy_(dscores);
    if (softcap_grad.defined()) dscores.mul_(softcap_grad);  // through the cap, to the scaled scores
    const at::Tensor dscores_grouped = grouped(dscores, p);
    dq.narrow(2, r0, rows).copy_(ungrouped(at::matmul(dscores_grouped, k_acc).mul_(p.scale), p, rows));
    dk_acc.add_(at::matmul(dscores_grouped.transpose(-2, -1), q_rows).mul_(p.scale));
  }
  dk.copy_(dk_acc);
  dv.copy_(dv_acc);
}

at::Tensor attention_for_double_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& rng_state, const AttentionOptions& options) {
  const AttentionProblem p = attention_problem(q, k, v, options);
  const at::ScalarType acc = accumulation_type(q);
  const at::Tensor s =
      chunk_scores(grouped_rows(q, p, 0, p.len_q, acc), k.to(acc), options.attn_mask, p, 0, p.len_q);
  return output_rows(s, v.to(acc), rng_state, options.dropout_p, p, 0, p.len_q).to(q.scalar_type());
}

}  // namespace flashattn_ext
