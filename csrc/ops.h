// Torch glue shared by the per-device implementations of the flashattn_ext ops:
// argument checks, output allocation and the translation to kernel params.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>
#include <vector>

#include "flash_params.h"

namespace flashattn_ext {

// The options of one attention call, in the op schemas' order: each op's
// entry point gathers its flat arguments into one, which everything below it
// takes. (A value: copies share the tensors.)
struct AttentionOptions {
  std::optional<at::Tensor> attn_mask;
  double dropout_p;
  bool is_causal;
  bool causal_lower_right;
  double scale;
  int64_t window_left = -1;  // see AttentionProblem
  int64_t window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes = std::nullopt;  // float32 (batch, heads_q)
};

// The sizes of 4-d (batch, heads, seq_len, head_dim) q, k, v (not checked:
// see prepare_forward) and the options' flags, as the kernels take them.
AttentionProblem attention_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const AttentionOptions& options);

// A 4-d tensor as the kernels see it: its data and strides (in elements).
TensorView4d view_of(const at::Tensor& t);

// Raises, naming the argument, unless t is on like's device ("flashattn_ext:
// <name> is on <device> but <like_name> is on <device>").
void check_device(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name = "query");

// The dtype of the saved log-sum-exp: float32, or float64 for float64 inputs.
at::ScalarType lse_dtype(at::ScalarType input_dtype);

// Checks q, k, v and the options; allocates out and lse; returns the kernel
// params (params.dropout.rng_state unset: each device draws its own).
FwdParams prepare_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options, at::Tensor& out, at::Tensor& lse);

// Attention sinks (gpt-oss's learned logit of each query head): each query
// row's softmax also spans one more key, of score sinks[head] (the scaled,
// capped and biased scores sit beside it as they are) and of value 0.
// merge_sinks makes a forward's out and lse without them those with them, in
// place: lse' = logaddexp(lse, sink), out * exp(lse - lse') (a row that sees
// no key: out 0, lse' the sink). A backward given out and lse' (and the
// sinks, for the CPU kernels and the fallback) gives the gradients with them.
// check_sinks checks sinks against q (4-d), naming the argument.
void check_sinks(const at::Tensor& q, const std::optional<at::Tensor>& sinks);
void merge_sinks(const at::Tensor& sinks, at::Tensor& out, at::Tensor& lse);
// The sinks' gradient (the op sinks_backward, schemas.cpp), a sink being a key
// of value 0: -sum over its head's rows of exp(sink - lse) * delta, delta =
// rowsum(grad_out * out) (0 where the sink and lse are both -inf), in sinks'
// dtype. sinks_gradient takes delta (batch, heads, len_q) in lse's dtype;
// sinks_backward_aten computes it with ATen operations (any device and dtype).
at::Tensor sinks_gradient(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks);
at::Tensor sinks_backward_aten(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& sinks);

// Checks the saved tensors and dout; allocates dq, dk, dv and, with
// compute_grad_attn_mask, the mask's gradient (else an empty tensor); returns
// the kernel params (params.delta unset: a workspace of the CUDA kernels).
BwdParams prepare_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, const at::Tensor& rng_state,
                           const AttentionOptions& options, bool compute_grad_attn_mask, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                           at::Tensor& grad_attn_mask);

// The arguments of the decode_attention op.
struct DecodeArguments {
  const at::Tensor& q;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& cache_seqlens;
  const std::optional<at::Tensor>& block_table;
  const std::optional<at::Tensor>& k_new;
  const std::optional<at::Tensor>& v_new;
  // No attn_mask, no dropout; causal_lower_right (a decoding step's queries
  // are its sequences' last rows).
  AttentionOptions options;
  // FP8 caches' scales (float32, () or (1,) for the whole cache, or one a key/value head).
  const std::optional<at::Tensor>& key_scale;
  const std::optional<at::Tensor>& value_scale;
};

// Checks the shapes, dtypes and devices of a decode_attention call (not the
// values in cache_seqlens and block_table: see check_decode_values_on_host);
// allocates out and lse; returns the kernel params, which read cache_seqlens
// and block_table in place (int32 or int64, any strides: no copy).
DecodeParams prepare_decode(const DecodeArguments& args, at::Tensor& out, at::Tensor& lse);

// Checks that every sequence's cached and new keys fit its cache, and that the
// block table names blocks of the cache where it is read, for params whose
// cache_seqlens and block_table are in host memory.
void check_decode_values_on_host(const DecodeParams& params);

// check_decode_values_on_host for params whose cache_seqlens and block_table
// (args') may be on a GPU: read to the host first (a wait for the device).
void check_decode_values(const DecodeArguments& args, const DecodeParams& params);

// Whether FLASHATTN_EXT_CHECK_INPUTS=1 (read at each call) asks the CUDA ops to
// read index tensors to the host and raise the CPU's errors on bad values,
// where they would otherwise give NaN results without waiting for the GPU.
bool input_checks_requested();

// A packed batch (the varlen ops): q, k, v (total rows, heads, dim) seen as
// (1, heads, total rows, dim), and the sequences' bounds cu_seqlens as given
// (on the inputs' device: not read here).
struct PackedBatch {
  at::Tensor q, k, v;  // 4-d views (1, heads, total rows, dim)
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  AttentionOptions options;  // no attn_mask, no dropout; alibi_slopes (sequences, heads_q)

  int64_t sequences() const { return cu_seqlens_q.numel() - 1; }
};

// Checks the varlen ops' arguments but the values in cu_seqlens (see
// read_sequence_bounds). The options are the ops' own: no attn_mask, no
// dropout (their schemas have neither).
PackedBatch check_packed_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const AttentionOptions& options);

// A packed batch's sequence bounds (sequences + 1 each), read to the host and
// checked: from 0 to the packed rows, not decreasing, no sequence longer than
// its max_seqlen. Where cu_seqlens live on a GPU this waits for it (once where
// both are the same tensor); the CUDA kernels that take a batch whole check
// them on the device instead (cuda::plan_packed_forward).
struct SequenceBounds {
  std::vector<int64_t> q, k;
};
SequenceBounds read_sequence_bounds(const PackedBatch& batch);

// The packed (total rows, heads, dim) tensor t seen as (1, heads, total rows, dim).
at::Tensor heads_first(const at::Tensor& t);
// A new packed (total rows, heads, dim) tensor for the (1, heads, total rows, dim) view t.
at::Tensor empty_packed_like(const at::Tensor& t);

// A packed batch's forward (backward) params before anything is allocated:
// the problem and the views of q, k, v and the bounds (what cuda::route
// reads to choose a path).
FwdParams packed_forward_params(const PackedBatch& batch);
BwdParams packed_backward_params(const PackedBatch& batch);

// Allocates the packed batch's out (total_q, heads_q, Ev) and lse (heads_q,
// total_q) and returns the kernel params of its forward (params.packed set).
FwdParams prepare_packed_forward(const PackedBatch& batch, at::Tensor& out, at::Tensor& lse);

// Checks the saved out, lse and grad_out of a packed batch's backward;
// allocates dq, dk, dv (packed, contiguous) and returns the kernel params of
// its backward (params.packed set; delta and dq_accum unset).
BwdParams prepare_packed_backward(const PackedBatch& batch, const at::Tensor& grad_out, const at::Tensor& out,
                                  const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// The attention_forward and attention_backward ops called through the
// dispatcher, options spelled out as their schemas' arguments: for the C++
// code that calls them (autograd.cpp, varlen.cpp, ops_fp8.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const AttentionOptions& options,
                                                                      const std::optional<at::Tensor>& sinks);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, const AttentionOptions& options, bool compute_grad_attn_mask,
    const std::optional<at::Tensor>& sinks);

// The packed batch's forward and backward as one attention_forward (or
// attention_backward) call per sequence on views of the packed tensors, their
// results copied into the packed ones (read_sequence_bounds first): the path
// of every device and call that no kernel takes as a whole.
std::tuple<at::Tensor, at::Tensor> varlen_forward_by_sequence(const PackedBatch& batch);
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_backward_by_sequence(const PackedBatch& batch,
                                                                          const at::Tensor& grad_out,
                                                                          const at::Tensor& out,
                                                                          const at::Tensor& lse);

// The bits of dropout's random numbers for the next forward (8 or 16;
// set_dropout_bits), which it records in its rng_state.
int dropout_bits();

// Checks the arguments of the dropout_mask op.
DropoutMaskShape check_dropout_mask(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                                    int64_t len_q, int64_t len_k, int64_t row_begin, int64_t row_end);

// The quantize_fp8 and dequantize_fp8 ops in ATen (ops_fp8.cpp): every call
// on the CPU, and the CUDA calls that its kernels do not take.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_aten(const at::Tensor& x, int64_t heads_kv, bool per_block);
at::Tensor dequantize_fp8_aten(const at::Tensor& x, const std::optional<at::Tensor>& descale, at::ScalarType dtype);

// The attention_forward_quantized op's forward (ops_fp8.cpp): q, k and v
// quantized to e4m3 with one descale a (batch, key/value head), the FP8
// forward, out in q's dtype; with what its autograd (autograd.cpp) saves.
struct QuantizedAttention {
  at::Tensor out, lse;  // out in q's dtype; fp8_out: as attention_forward_fp8 returned it (bfloat16)
  at::Tensor fp8_out, q8, k8, v8, q_descale, k_descale, v_descale;
};
QuantizedAttention quantized_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               bool is_causal, bool causal_lower_right, double scale,
                                               int64_t window_left, int64_t window_right);
// The attention_backward_fp8 op through the dispatcher, for the forward's saved tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_backward_fp8(
    const at::Tensor& grad_out, const QuantizedAttention& forward, bool is_causal, bool causal_lower_right,
    double scale, int64_t window_left, int64_t window_right);

// The attention_forward_fp8 op's pieces (ops_fp8.cpp): the checks of its
// inputs, and its path on any device, attention_forward on the tensors
// dequantized (CUDA's glue runs it where the e4m3 kernel does not take the call).
void check_fp8_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
                      const std::optional<at::Tensor>& v_descale);
std::tuple<at::Tensor, at::Tensor> attention_forward_fp8_dequantized(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale, bool is_causal,
    bool causal_lower_right, double scale, int64_t window_left, int64_t window_right);

}  // namespace flashattn_ext
