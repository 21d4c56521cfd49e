// Attention built from ATen operations, on any device, for the calls that the
// hand-written CUDA kernels do not cover (float32 and float64 inputs, head dims
// that are not a multiple of 8 or are above 256, Ev != E).
// The same algorithm at a coarser grain: query rows go in chunks whose scores
// (at most about kFallbackChunkBytes of them) are materialized, the forward
// saves the LSE and the backward recomputes P. Accumulation in float32 for
// 16-bit inputs, in float64 for float32 and float64 ones; GQA without
// repeating key and value. Dropout from the same random numbers as the kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "flash_params.h"
#include "ops.h"

namespace flashattn_ext {

constexpr int64_t kFallbackChunkBytes = int64_t(128) << 20;

// Whether FLASHATTN_EXT_KERNELS (read at each call: for tests and
// comparisons) names `family`: "aten", "sm80" or "dense" (cuda/route.h).
bool kernels_requested(const char* family);

// Whether FLASHATTN_EXT_KERNELS=aten asks every device to run this fallback
// instead of its kernels (the CPU tests check the fallback this way).
bool fallback_requested();

// Fills out and lse, as allocated by prepare_forward. q, k, v, attn_mask:
// (batch, heads, rows, dim) as the ops receive them; rng_state: dropout's
// {seed, offset} as the forward op returns it (read only if dropout_p > 0).
void fallback_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, const at::Tensor& rng_state, double dropout_p,
                      const AttentionProblem& p, at::Tensor& out, at::Tensor& lse);

// Fills dq, dk, dv and, where it is not empty, grad_attn_mask, as allocated by
// prepare_backward (it recomputes the probabilities: no out or lse needed),
// with the forward's attention sinks where it had any.
void fallback_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& attn_mask, const at::Tensor& rng_state, double dropout_p,
                       const AttentionProblem& p, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                       at::Tensor& grad_attn_mask, const std::optional<at::Tensor>& sinks);

// The output of attention over all query rows at once, from the same ATen
// operations with autograd tracking them (the whole score matrix in memory, as
// in SDPA's math backend): what double backward differentiates. Any device.
at::Tensor attention_for_double_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& rng_state, const AttentionOptions& options);

}  // namespace flashattn_ext
