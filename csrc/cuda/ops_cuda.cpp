// CUDA implementations of the flashattn_ext ops: device guard, current stream,
// launch-error checks, and the kernel family that route.h's table chooses for
// each call (what no kernel takes goes to the ATen-operation fallback,
// fallback.h, with a one-time warning quoting the table's reason).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>

#include "cuda/flash_cuda.h"
#include "cuda/route.h"
#include "fallback.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

void warn_fallback(const std::string& gap) {
  TORCH_WARN_ONCE("flashattn_ext: ", gap, ", so this call (and others like it, warned once) runs a slower fallback ",
                  "built from ATen operations.");
}

// merge_sinks (ops.h) in one pass on the device (cuda::merge_sinks) for a
// 16-bit out, its last dim contiguous; ATen's form otherwise.
void merge_sinks_on_device(const at::Tensor& sinks, at::Tensor& out, at::Tensor& lse) {
  const bool kernel_takes = (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                            out.dim() == 4 && out.stride(-1) == 1 && lse.scalar_type() == at::kFloat &&
                            lse.is_contiguous();
  if (!kernel_takes) return merge_sinks(sinks, out, lse);
  const at::Tensor sinks_float = sinks.to(at::kFloat).contiguous();
  const cuda::SinkMerge merge{view_of(out), out.size(0), out.size(1), out.size(2), out.size(3),
                              lse.data_ptr<float>(), sinks_float.data_ptr<float>()};
  cuda::merge_sinks(merge, cuda::element_type(out), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernels copy rows in 16-byte pieces: the last dim must be contiguous and
// every row start 16-byte aligned. Anything else (rare: a stride-0 grad_out,
// an odd storage offset) is copied into a fresh contiguous tensor first: a
// clone, since contiguous() keeps a contiguous tensor at an odd offset as it is.
at::Tensor with_aligned_rows(const at::Tensor& t) {
  const int64_t elems_per_16_bytes = 16 / t.element_size();
  const bool aligned = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                       t.stride(0) % elems_per_16_bytes == 0 && t.stride(1) % elems_per_16_bytes == 0 &&
                       t.stride(2) % elems_per_16_bytes == 0;
  return aligned ? t : t.clone(at::MemoryFormat::Contiguous);
}

// {seed, offset} for one call's dropout, drawn from torch's default generator of
// q's device and written to device memory by a one-thread kernel (under CUDA
// graph capture the generator's state is itself in device memory); empty
// without dropout.
at::Tensor draw_rng_state(const at::Tensor& q, double dropout_p, cudaStream_t stream) {
  if (!(dropout_p > 0.0)) return at::empty({0}, q.options().dtype(at::kLong));
  auto* generator = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.device().index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    state = generator->philox_cuda_state(kDropoutOffsetIncrement);
  }
  cuda::PhiloxSource source;
  source.captured = state.captured_;
  if (state.captured_) {
    source.seed_ptr = state.seed_.ptr;
    source.offset_ptr = state.offset_.ptr;
    source.offset_intragraph = state.offset_intragraph_;
  } else {
    source.seed = state.seed_.val;
    source.offset = state.offset_.val;
  }
  source.bits = dropout_bits();
  at::Tensor rng_state = at::empty({kRngStateSize}, q.options().dtype(at::kLong));
  cuda::write_rng_state(source, rng_state.data_ptr<int64_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rng_state;
}

// For the Hopper kernels, an attn_mask's block map: which of its tiles they
// may skip or run unmasked (cuda::classify_mask_blocks), in the returned
// device memory, which params.mask_blocks then reads; none (an empty tensor)
// without a mask.
template <typename Params>
at::Tensor map_mask_blocks(const at::Tensor& q, Params& params, cudaStream_t stream) {
  const int64_t bytes = cuda::mask_block_map_bytes(params.mask_kind, params.mask, params.problem);
  if (bytes == 0) return at::Tensor();
  at::Tensor map = at::empty({bytes}, q.options().dtype(at::kByte));
  params.mask_blocks = cuda::classify_mask_blocks(params.mask_kind, params.mask, params.problem, cuda::element_type(q),
                                                  map.data_ptr<uint8_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return map;
}

// A workspace of `results` partial results of params' call (out and lse,
// float, each part 16-byte aligned) and `counters` ints zeroed, on q's device:
// one allocation, and a memset of the counters where there are any (a
// decoding step's host time shows in its latency). `workspace` keeps the
// memory until the kernels are queued.
cuda::DecodePartials allocate_decode_partials(const DecodeParams& params, const at::Tensor& q, int64_t results,
                                              int64_t counters, at::Tensor& workspace, cudaStream_t stream) {
  auto aligned = [](int64_t floats) { return (floats + 3) / 4 * 4; };
  const int64_t out_floats = aligned(results * params.problem.head_dim_v), lse_floats = aligned(results);
  workspace = at::empty({out_floats + lse_floats + counters}, q.options().dtype(at::kFloat));
  float* out = workspace.data_ptr<float>();
  int* arrivals = reinterpret_cast<int*>(out + out_floats + lse_floats);
  if (counters > 0) C10_CUDA_CHECK(cudaMemsetAsync(arrivals, 0, counters * sizeof(int), stream));
  return {out, out + out_floats, arrivals};
}

// The Hopper decode kernel, where it takes the call: whether it ran (it marks
// the sequences whose length does not fit NaN itself: decode_poison's
// lengths_marked).
bool run_sm90_decode(const DecodeParams& params, const at::Tensor& q, cudaStream_t stream) {
  at::Tensor workspace;
  const cuda::DecodePartialsAllocator allocate = [&](int64_t results, int64_t counters) {
    return allocate_decode_partials(params, q, results, counters, workspace, stream);
  };
  return cuda::use_sm90_kernels(q) && cuda::sm90::decode_attention(params, cuda::element_type(q), allocate, stream);
}

// A decoding step's attention (the caches in the queries' dtype): the Hopper
// kernel where it takes the call, else the mma.sync ones (chunks, then their
// merge). Returns whether the Hopper kernel ran.
bool run_decode_kernels(const DecodeParams& params, const at::Tensor& q, cudaStream_t stream) {
  if (run_sm90_decode(params, q, stream)) return true;
  const AttentionProblem& p = params.problem;
  const cuda::ElementType type = cuda::element_type(q);
  const int partials = cuda::decode_partials(params, type);
  at::Tensor workspace;
  const cuda::DecodePartials buffers =
      allocate_decode_partials(params, q, p.batch * p.heads_q * p.len_q * partials, 0, workspace, stream);
  cuda::decode_attention_partials(params, type, buffers.out, buffers.lse, partials, stream);
  cuda::decode_merge(params, type, buffers.out, buffers.lse, partials, stream);
  return false;
}

// The dense forward's params as a decoding step's: k and v its caches, every
// sequence holding all len_k keys (no cache_seqlens), or with a bool mask
// (which the route takes alone) the keys up to its key extents, computed into
// `extents` (cuda::mask_key_extents).
DecodeParams as_decoding_step(const FwdParams& params, const at::Tensor& q, at::Tensor& extents,
                              cudaStream_t stream) {
  DecodeParams decode;
  decode.problem = params.problem;
  decode.problem.causal_lower_right = true;  // (the same visibility: see cuda::route_forward)
  decode.q = params.q;
  decode.out = params.out;
  decode.lse = params.lse;
  decode.k_cache = params.k;
  decode.v_cache = params.v;
  if (params.mask_kind == MaskKind::kBool) {
    decode.mask = params.mask;
    const int64_t batches = cuda::mask_key_extent_batches(params.mask, params.problem);
    extents = at::empty({batches}, q.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(extents.data_ptr<int32_t>(), 0, batches * sizeof(int32_t), stream));
    cuda::mask_key_extents(params.mask, params.problem, extents.data_ptr<int32_t>(), stream);
    decode.cache_seqlens = {extents.data_ptr<int32_t>(), /*int32=*/true, 0, batches > 1 ? 1 : 0};
  }
  return decode;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const std::optional<at::Tensor>& attn_mask,
                                                                      double dropout_p, bool is_causal,
                                                                      bool causal_lower_right, double scale,
                                                                      int64_t window_left, int64_t window_right,
                                                                      double softcap,
                                                                      const std::optional<at::Tensor>& alibi_slopes,
                                                                      const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor out, lse;
  const AttentionOptions options{attn_mask,   dropout_p,    is_causal, causal_lower_right, scale,
                                 window_left, window_right, softcap,   alibi_slopes};
  const at::Tensor q_rows = with_aligned_rows(q), k_rows = with_aligned_rows(k), v_rows = with_aligned_rows(v);
  FwdParams params = prepare_forward(q_rows, k_rows, v_rows, options, out, lse);
  check_sinks(q, sinks);
  const at::Tensor rng_state = draw_rng_state(q, dropout_p, stream);
  auto finish = [&] {
    if (sinks.has_value()) merge_sinks_on_device(*sinks, out, lse);
    return std::make_tuple(out, lse, rng_state);
  };
  auto run_fallback = [&](const std::string& gap) {
    warn_fallback(gap);
    fallback_forward(q_rows, k_rows, v_rows, attn_mask, rng_state, dropout_p, params.problem, out, lse);
    return finish();
  };
  const cuda::Route route = cuda::route_forward(q, params);
  if (route.family == cuda::Family::kAten) return run_fallback(route.reason);
  if (route.family == cuda::Family::kDecode) {
    at::Tensor extents;
    run_decode_kernels(as_decoding_step(params, q, extents, stream), q, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return finish();
  }
  if (dropout_p > 0.0) params.dropout.rng_state = rng_state.data_ptr<int64_t>();
  // No tile counter to fill for calls the Hopper forward does not take.
  const bool sm90 = route.family == cuda::Family::kSm90;
  const at::Tensor tile_counter = sm90 ? at::empty({1}, q.options().dtype(at::kInt)) : at::Tensor();
  at::Tensor mask_block_map;
  if (sm90) {
    params.tile_counter = tile_counter.data_ptr<int>();
    // (A memset: at::zeros would dispatch a fill kernel, several times the host time.)
    C10_CUDA_CHECK(cudaMemsetAsync(params.tile_counter, 0, sizeof(int), stream));
    mask_block_map = map_mask_blocks(q, params, stream);
  }
  if (!(sm90 && cuda::sm90::attention_forward(params, cuda::element_type(q), stream))) {
    // (Tensors the copy engine cannot address: such a call has no other kernel.)
    if (const auto hopper_only = cuda::hopper_only_feature(params.problem)) return run_fallback(*hopper_only);
    cuda::sm80::attention_forward(params, cuda::element_type(q), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return finish();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, const std::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, bool causal_lower_right, double scale, bool compute_grad_attn_mask, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor dq, dk, dv, dmask;
  const AttentionOptions options{attn_mask,   dropout_p,    is_causal, causal_lower_right, scale,
                                 window_left, window_right, softcap,   alibi_slopes};
  const at::Tensor dout_rows = with_aligned_rows(dout), q_rows = with_aligned_rows(q), k_rows = with_aligned_rows(k),
                   v_rows = with_aligned_rows(v), out_rows = with_aligned_rows(out);
  BwdParams params = prepare_backward(dout_rows, q_rows, k_rows, v_rows, out_rows, lse, rng_state, options,
                                      compute_grad_attn_mask, dq, dk, dv, dmask);
  check_sinks(q, sinks);
  const at::Tensor sinks_double = sinks.has_value() ? sinks->to(at::kDouble) : at::Tensor();
  if (sinks.has_value()) params.sinks = sinks_double.data_ptr<double>();
  auto run_fallback = [&](const std::string& gap) {
    warn_fallback(gap);
    fallback_backward(dout_rows, q_rows, k_rows, v_rows, attn_mask, rng_state, dropout_p, params.problem, dq, dk,
                      dv, dmask, sinks);
    return std::make_tuple(dq, dk, dv, dmask);
  };
  const cuda::Route route = cuda::route_backward(q, params);
  if (route.family == cuda::Family::kAten) return run_fallback(route.reason);
  // delta = rowsum(dO * O) per query row, in the lse's type (float32 here).
  const at::Tensor delta = at::empty(lse.sizes(), lse.options());
  params.delta = delta.data_ptr();
  // dQ added into a float32 workspace (faster): the Hopper kernels' wherever
  // they run (in deterministic mode in a fixed order, counted in
  // dq_semaphore), the sm80 kernels' up to head dim kMaxAtomicDqHeadDim unless
  // the user asked for deterministic algorithms.
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  const bool sm90 = route.family == cuda::Family::kSm90;
  at::Tensor dq_accum, dq_semaphore, key_grad_partials;
  if (sm90 || (!deterministic && params.problem.head_dim <= cuda::sm80::kMaxAtomicDqHeadDim)) {
    // (The delta pass zeroes it.) The Hopper backward may take the (batch,
    // key/value head) pairs a chunk at a time, over a workspace for one chunk.
    const AttentionProblem& p = params.problem;
    params.dq_accum_pairs = sm90 ? cuda::sm90::backward_chunk_pairs(p) : p.batch * p.heads_kv;
    dq_accum = at::empty({cuda::dq_accum_floats(p, params.dq_accum_pairs)}, q.options().dtype(at::kFloat));
    params.dq_accum = dq_accum.data_ptr<float>();
    if (sm90 && deterministic) {  // (the kernel zeroes it)
      dq_semaphore = at::empty({cuda::sm90::dq_semaphore_ints(p, params.dq_accum_pairs)}, q.options().dtype(at::kInt));
      params.dq_semaphore = dq_semaphore.data_ptr<int>();
      // (A causal GQA call's heaviest blocks split by query heads, their dK
      // and dV summed after the kernel: only where the Hopper kernel takes it.)
      const int splits = cuda::sm90::deterministic_backward_covers(params) ? cuda::sm90::deterministic_head_splits(p) : 1;
      if (splits > 1) {
        key_grad_partials = at::empty({cuda::sm90::key_grad_partial_floats(p, splits)}, q.options().dtype(at::kFloat));
        params.head_splits = splits;
        params.key_grad_partials = key_grad_partials.data_ptr<float>();
      }
    }
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor mask_block_map = sm90 ? map_mask_blocks(q, params, stream) : at::Tensor();
  if (!(sm90 && cuda::sm90::attention_backward(params, cuda::element_type(q), stream))) {
    // (Tensors the copy engine cannot address.)
    if (const auto hopper_only = cuda::hopper_only_feature(params.problem)) return run_fallback(*hopper_only);
    if (deterministic) {  // (the sm80 kernels' separate dQ pass)
      params.dq_accum = nullptr;
      params.dq_semaphore = nullptr;
      params.head_splits = 1;
      params.key_grad_partials = nullptr;
    }
    cuda::sm80::attention_backward(params, cuda::element_type(q), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv, dmask};
}

// A packed batch: the Hopper forward takes it as one launch where it covers
// the call, its cu_seqlens read on the device only (no wait for it); anything
// else runs one call per sequence.
std::tuple<at::Tensor, at::Tensor> varlen_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                                       bool causal_lower_right, double scale, int64_t window_left,
                                                       int64_t window_right, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, causal_lower_right, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  PackedBatch batch = check_packed_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options);
  if (cuda::route_packed_forward(q, packed_forward_params(batch)).family != cuda::Family::kSm90) {
    return varlen_forward_by_sequence(batch);
  }
  if (input_checks_requested()) read_sequence_bounds(batch);  // (raises on bad bounds, as the CPU does)
  batch.q = with_aligned_rows(batch.q);
  batch.k = with_aligned_rows(batch.k);
  batch.v = with_aligned_rows(batch.v);
  at::Tensor out, lse;
  FwdParams params = prepare_packed_forward(batch, out, lse);
  const int64_t block_rows = cuda::sm90::varlen_forward_block_rows(params.problem);
  const at::Tensor plan =
      at::empty({cuda::packed_forward_plan_ints(params, block_rows)}, q.options().dtype(at::kInt));
  cuda::plan_packed_forward(params, block_rows, plan.data_ptr<int32_t>(), cuda::element_type(q), stream);
  if (!cuda::sm90::attention_forward(params, cuda::element_type(q), stream)) return varlen_forward_by_sequence(batch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

// A packed batch's backward: the Hopper backward takes it as one launch where
// it covers the call (not in deterministic mode), its cu_seqlens read on the
// device only; anything else runs one call per sequence.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool is_causal, bool causal_lower_right, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, causal_lower_right, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  PackedBatch batch = check_packed_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options);
  if (cuda::route_packed_backward(q, packed_backward_params(batch)).family != cuda::Family::kSm90) {
    return varlen_backward_by_sequence(batch, dout, out, lse);
  }
  if (input_checks_requested()) read_sequence_bounds(batch);
  batch.q = with_aligned_rows(batch.q);
  batch.k = with_aligned_rows(batch.k);
  batch.v = with_aligned_rows(batch.v);
  // (out and grad_out as packed (total_q, heads, dim) tensors whose rows the copy engine can read.)
  const at::Tensor out_rows = with_aligned_rows(heads_first(out)).squeeze(0).transpose(0, 1);
  const at::Tensor dout_rows = with_aligned_rows(heads_first(dout)).squeeze(0).transpose(0, 1);
  at::Tensor dq, dk, dv;
  BwdParams params = prepare_packed_backward(batch, dout_rows, out_rows, lse, dq, dk, dv);
  const AttentionProblem& p = params.problem;
  params.dq_accum_pairs = p.batch * p.heads_kv;  // (all of them: route_packed_backward)
  const at::Tensor delta = at::empty(lse.sizes(), lse.options());
  params.delta = delta.data_ptr();
  // (Zeroed by the launch.)
  const at::Tensor dq_accum = at::empty({cuda::packed_dq_accum_floats(params)}, q.options().dtype(at::kFloat));
  params.dq_accum = dq_accum.data_ptr<float>();
  if (!cuda::sm90::attention_backward(params, cuda::element_type(q), stream)) {
    return varlen_backward_by_sequence(batch, dout, out, lse);
  }
  cuda::poison_gradients_of_bad_bounds(params, cuda::element_type(q), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv};
}

// The sinks' gradient (ops.h): delta by the backward's delta pass (one read
// of grad_out and out), where the ATen form takes float32 copies of both.
at::Tensor sinks_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& sinks) {
  check_device(grad_out, "grad_out", out, "out");
  check_device(lse, "lse", out, "out");
  check_device(sinks, "sinks", out, "out");
  const bool kernel_takes = (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                            grad_out.scalar_type() == out.scalar_type() && out.dim() == 4 &&
                            grad_out.sizes() == out.sizes() && out.stride(-1) == 1 && grad_out.stride(-1) == 1 &&
                            lse.scalar_type() == at::kFloat && lse.sizes() == out.sizes().slice(0, 3);
  if (!kernel_takes) return sinks_backward_aten(grad_out, out, lse, sinks);
  const c10::cuda::CUDAGuard device_guard(out.device());
  BwdParams params;
  AttentionProblem& p = params.problem;
  p.batch = out.size(0);
  p.heads_q = p.heads_kv = out.size(1);
  p.len_q = out.size(2);
  p.head_dim = p.head_dim_v = out.size(3);
  params.out = view_of(out);
  params.dout = view_of(grad_out);
  const at::Tensor delta = at::empty(lse.sizes(), lse.options());
  params.delta = delta.data_ptr();
  cuda::compute_delta(params, cuda::element_type(out), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sinks_gradient(delta, lse, sinks);
}

at::Tensor dropout_mask_cuda(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_k, int64_t row_begin, int64_t row_end) {
  const c10::cuda::CUDAGuard device_guard(rng_state.device());
  const DropoutMaskShape shape =
      check_dropout_mask(rng_state, dropout_p, batch, heads, len_q, len_k, row_begin, row_end);
  at::Tensor mask = at::empty({batch, heads, row_end - row_begin, len_k}, rng_state.options().dtype(at::kBool));
  cuda::dropout_mask(shape, {dropout_p, rng_state.data_ptr<int64_t>()}, mask.data_ptr<bool>(),
                     at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mask;
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                                         const std::optional<at::Tensor>& block_table,
                                                         const std::optional<at::Tensor>& k_new,
                                                         const std::optional<at::Tensor>& v_new, bool is_causal,
                                                         double scale, int64_t window_left, int64_t window_right,
                                                         double softcap,
                                                         const std::optional<at::Tensor>& alibi_slopes,
                                                         const std::optional<at::Tensor>& sinks,
                                                         const std::optional<at::Tensor>& key_scale,
                                                         const std::optional<at::Tensor>& value_scale) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   "flashattn_ext: decode_attention on CUDA takes float16 or bfloat16, got ", q.scalar_type());
  at::Tensor out, lse;
  const AttentionOptions options{std::nullopt, 0.0,          is_causal, /*causal_lower_right=*/true, scale,
                                 window_left,  window_right, softcap,   alibi_slopes};
  const DecodeArguments args{q,     k_cache, v_cache, cache_seqlens, block_table,
                             k_new, v_new,   options, key_scale,     value_scale};
  DecodeParams params = prepare_decode(args, out, lse);
  if (input_checks_requested()) check_decode_values(args, params);
  check_sinks(q, sinks);
  const AttentionProblem& p = params.problem;
  TORCH_CHECK(p.head_dim <= cuda::kMaxHeadDim && p.head_dim_v <= cuda::kMaxHeadDim,
              "flashattn_ext: decode_attention on CUDA takes head dims up to ", cuda::kMaxHeadDim, ", got ",
              p.head_dim, " and ", p.head_dim_v);
  // The kernel indexes sequences, cache blocks and rows in 32 bits.
  constexpr int64_t kLimit = int64_t{1} << 31;
  TORCH_CHECK(p.len_k < kLimit && p.batch < kLimit && params.num_blocks < kLimit,
              "flashattn_ext: decode_attention on CUDA takes fewer than 2^31 sequences, cache blocks and rows a "
              "sequence, got ", p.batch, ", ", params.num_blocks, " and ", p.len_k);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cuda::decode_append(params, cuda::element_type(q), stream);
  // FP8 caches that the Hopper kernel does not take (head dims other than 128, other GPUs, layouts the copy
  // engine cannot address): the attention runs on copies dequantized to the queries' dtype (after the append,
  // so that they hold the new keys).
  at::Tensor k_dequantized, v_dequantized;
  const bool fp8_read = params.k_scale != nullptr && run_sm90_decode(params, q, stream);
  if (params.k_scale != nullptr && !fp8_read) {
    const bool paged = block_table.has_value();
    const auto per_head = [&](const at::Tensor& s) {
      return s.numel() == 1 ? s.reshape({1, 1, 1, 1}) : s.view(paged ? c10::IntArrayRef{1, 1, -1, 1}
                                                                      : c10::IntArrayRef{1, -1, 1, 1});
    };
    k_dequantized = (k_cache.to(at::kFloat) * per_head(*key_scale)).to(q.scalar_type());
    v_dequantized = (v_cache.to(at::kFloat) * per_head(*value_scale)).to(q.scalar_type());
    params.k_cache = view_of(paged ? k_dequantized.permute({0, 2, 1, 3}) : k_dequantized);
    params.v_cache = view_of(paged ? v_dequantized.permute({0, 2, 1, 3}) : v_dequantized);
    params.k_scale = params.v_scale = nullptr;
  }
  const bool lengths_marked = fp8_read || run_decode_kernels(params, q, stream);
  cuda::decode_poison(params, cuda::element_type(q), lengths_marked, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (sinks.has_value()) merge_sinks_on_device(*sinks, out, lse);  // (a poisoned row stays NaN)
  return {out, lse};
}

// The kernel_route op: the routing table's answer for an attention_forward
// call (with backward, its attention_backward), without running it.
std::tuple<std::string, std::string> kernel_route_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                       bool is_causal, bool causal_lower_right, double scale,
                                                       int64_t window_left, int64_t window_right, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes, bool backward) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out, lse;
  const AttentionOptions options{attn_mask,   dropout_p,    is_causal, causal_lower_right, scale,
                                 window_left, window_right, softcap,   alibi_slopes};
  const FwdParams forward = prepare_forward(q, k, v, options, out, lse);
  cuda::Route route = cuda::route_forward(q, forward);
  if (backward) {
    BwdParams params;
    params.problem = forward.problem;
    params.mask_kind = forward.mask_kind;
    params.mask = forward.mask;
    params.dropout.p = dropout_p;
    // Autograd asks for the gradient of a float mask that requires it (any
    // non-null dmask says so to the table).
    if (params.mask_kind == MaskKind::kAdditive && attn_mask->requires_grad()) params.dmask.data = out.data_ptr();
    route = cuda::route_backward(q, params);
  }
  return {cuda::family_name(route.family), route.reason};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("kernel_route", &kernel_route_cuda);
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("dropout_mask", &dropout_mask_cuda);
  m.impl("sinks_backward", &sinks_backward_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
  m.impl("varlen_forward", &varlen_forward_cuda);
  m.impl("varlen_backward", &varlen_backward_cuda);
}

}  // namespace flashattn_ext
