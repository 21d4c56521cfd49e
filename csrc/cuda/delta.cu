// The backward's first pass, both families' (the sm80 backward and the Hopper
// one): delta = rowsum(dO * O) for every query row, with the zero fill of the
// float32 dQ accumulator that the backward kernels then add into.
#include <cstdint>

#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda {
namespace {

// The delta pass: delta[row] = sum_d dO[row, d] * O[row, d], and the zero fill
// of dq_accum (where set) that the backward kernels then add dQ into. Both are
// memory-bound; in one pass the fill's stores run beside the loads of a pass
// that alone does not saturate memory, and one launch goes.
constexpr int kDeltaThreads = 128;

// kVectorized: the rows start 16-byte aligned and the head dim is a multiple
// of 8 (16-byte loads, 8 elements); else element by element. kLanesPerRow:
// 16, or 8 for head dims up to 64 (vectorized: 16 lanes would leave half
// idle, and half the bytes in flight: 1.7x the time at head dim 64).
template <typename Elem, bool kVectorized, int kLanesPerRow>
__global__ void __launch_bounds__(kDeltaThreads) attention_delta_kernel(const BwdParams params, int64_t zero_floats) {
  constexpr int kRowsPerBlock = kDeltaThreads / kLanesPerRow;
  const AttentionProblem& p = params.problem;
  if (params.dq_accum != nullptr) {
    // Block b zeroes float4s b, b + gridDim.x, ...; the tail (under 4 floats) goes to block 0.
    float4* accum = reinterpret_cast<float4*>(params.dq_accum);
    for (int64_t i = int64_t(blockIdx.x) * kDeltaThreads + threadIdx.x; i < zero_floats / 4;
         i += int64_t(gridDim.x) * kDeltaThreads) {
      accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (blockIdx.x == 0 && threadIdx.x < zero_floats % 4) params.dq_accum[zero_floats / 4 * 4 + threadIdx.x] = 0.f;
  }
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int lane = threadIdx.x % kLanesPerRow;
  const int dim = static_cast<int>(p.head_dim_v);  // (O and dO: the values' head dim)
  const bool in_range = row < p.batch * p.heads_q * p.len_q;
  float sum = 0.f;
  if (in_range) {
    const int64_t i = row % p.len_q, h = (row / p.len_q) % p.heads_q, b = row / (p.len_q * p.heads_q);
    const Elem* out = head_ptr<Elem>(params.out, b, h) + i * params.out.stride_row;
    const Elem* dout = head_ptr<Elem>(params.dout, b, h) + i * params.dout.stride_row;
    if constexpr (kVectorized) {
      for (int d = lane * 8; d < dim; d += kLanesPerRow * 8) {
        const uint4 o8 = *reinterpret_cast<const uint4*>(out + d), g8 = *reinterpret_cast<const uint4*>(dout + d);
        const Elem* o = reinterpret_cast<const Elem*>(&o8);
        const Elem* g = reinterpret_cast<const Elem*>(&g8);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += ptx::to_float(o[e]) * ptx::to_float(g[e]);
      }
    } else {
      for (int d = lane; d < dim; d += kLanesPerRow) sum += ptx::to_float(out[d]) * ptx::to_float(dout[d]);
    }
  }
  for (int shift = kLanesPerRow / 2; shift > 0; shift /= 2) sum += __shfl_xor_sync(0xffffffff, sum, shift);
  if (in_range && lane == 0) static_cast<float*>(params.delta)[row] = sum;
}

}  // namespace

void compute_delta(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  constexpr int64_t kVectorElems = 8;  // 16 bytes of a 16-bit type
  auto aligned = [&](const TensorView4d& t) {
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.stride_batch % kVectorElems == 0 &&
           t.stride_head % kVectorElems == 0 && t.stride_row % kVectorElems == 0;
  };
  const bool vectorized = p.head_dim_v % kVectorElems == 0 && aligned(params.out) && aligned(params.dout);
  const bool narrow = vectorized && p.head_dim_v <= 8 * kVectorElems;  // (8 lanes a row)
  const int64_t blocks = ceil_div(p.batch * p.heads_q * p.len_q, int64_t{kDeltaThreads / (narrow ? 8 : 16)});
  if (blocks == 0) return;
  const int64_t zero_floats = params.dq_accum != nullptr ? dq_accum_floats(p, params.dq_accum_pairs) : 0;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    auto kernel = !vectorized ? attention_delta_kernel<Elem, false, 16>
                  : narrow    ? attention_delta_kernel<Elem, true, 8>
                              : attention_delta_kernel<Elem, true, 16>;
    kernel<<<static_cast<unsigned>(blocks), kDeltaThreads, 0, stream>>>(params, zero_floats);
  });
  mark_rows_seeing_one_key(params, type, stream);
}

}  // namespace flashattn_ext::cuda
