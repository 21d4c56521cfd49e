// Torch glue shared by the per-device implementations of the flashattn_ext ops:
// argument checks, output allocation and the translation to kernel params.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "flash_params.h"

namespace flashattn_ext {

// The options of one attention call, as they appear in the op schemas.
struct AttentionOptions {
  const std::optional<at::Tensor>& attn_mask;
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

// The dtype of the saved log-sum-exp: float32, or float64 for float64 inputs.
at::ScalarType lse_dtype(at::ScalarType input_dtype);

// Checks q, k, v and the options; allocates out and lse; returns the kernel
// params (params.dropout.rng_state unset: each device draws its own).
FwdParams prepare_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options, at::Tensor& out, at::Tensor& lse);

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
  bool is_causal;
  double scale;
  int64_t window_left = -1;  // see AttentionProblem
  int64_t window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes = std::nullopt;  // float32 (batch, heads_q)
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

// The bits of dropout's random numbers for the next forward (8 or 16;
// set_dropout_bits), which it records in its rng_state.
int dropout_bits();

// Checks the arguments of the dropout_mask op.
DropoutMaskShape check_dropout_mask(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                                    int64_t len_q, int64_t len_k, int64_t row_begin, int64_t row_end);

}  // namespace flashattn_ext
