// Attention sinks merged into a forward's out and lse (ops.h: merge_sinks) in
// one pass on the device, in place: the ATen form's mixed-dtype, broadcasting
// multiply runs unvectorized (75 us for a 32 MiB out on an H100, four small
// launches besides; this pass reads and writes out once at full width).
#include <cmath>

#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda {
namespace {

constexpr int kMergeThreads = 256;
constexpr int kLanesPerRow = 8;  // each 16 bytes (8 elements) at a time
constexpr int kRowsPerBlock = kMergeThreads / kLanesPerRow;

// kVectorized: out's rows start 16-byte aligned and the head dim is a
// multiple of 8; else element by element.
template <typename Elem, bool kVectorized>
__global__ void __launch_bounds__(kMergeThreads) merge_sinks_kernel(const SinkMerge merge) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  if (row >= merge.batch * merge.heads * merge.rows) return;
  const int lane = threadIdx.x % kLanesPerRow;
  const int64_t h = row / merge.rows % merge.heads, b = row / (merge.rows * merge.heads);
  const float lse = merge.lse[row], sink = merge.sinks[h];
  // logaddexp(lse, sink): -inf where both are, NaN where lse is (a decode
  // row poisoned for bad inputs stays so; fmaxf would drop the NaN).
  const float high = fmaxf(lse, sink), low = fminf(lse, sink);
  const float merged = isnan(lse) ? lse : high == -INFINITY ? -INFINITY : high + log1pf(expf(low - high));
  const float kept = merged == -INFINITY ? 0.f : expf(lse - merged);
  Elem* out = head_ptr<Elem>(merge.out, b, h) + row % merge.rows * merge.out.stride_row;
  if constexpr (kVectorized) {
    for (int d = lane * 8; d < merge.dim; d += kLanesPerRow * 8) {
      uint4 chunk = *reinterpret_cast<const uint4*>(out + d);
      uint32_t* pairs = reinterpret_cast<uint32_t*>(&chunk);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Elem* pair = reinterpret_cast<const Elem*>(&pairs[e]);
        pairs[e] = ptx::pack2<Elem>(ptx::to_float(pair[0]) * kept, ptx::to_float(pair[1]) * kept);
      }
      *reinterpret_cast<uint4*>(out + d) = chunk;
    }
  } else {
    for (int d = lane; d < merge.dim; d += kLanesPerRow) out[d] = ptx::from_float<Elem>(ptx::to_float(out[d]) * kept);
  }
  if (lane == 0) merge.lse[row] = merged;
}

}  // namespace

void merge_sinks(const SinkMerge& merge, ElementType type, cudaStream_t stream) {
  const int64_t blocks = ceil_div(merge.batch * merge.heads * merge.rows, kRowsPerBlock);
  const TensorView4d& out = merge.out;
  const bool vectorized = merge.dim % 8 == 0 && reinterpret_cast<uintptr_t>(out.data) % 16 == 0 &&
                          out.stride_batch % 8 == 0 && out.stride_head % 8 == 0 && out.stride_row % 8 == 0;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_flag(vectorized, [&](auto vector) {
      launch_kernel(merge_sinks_kernel<decltype(elem), decltype(vector)::value>, blocks, kMergeThreads, 0, merge,
                    stream);
    });
  });
}

}  // namespace flashattn_ext::cuda
