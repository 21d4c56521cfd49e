// Where the kernels' rows lie: the first element of a head of a tensor, and a
// packed batch's sequence (its first row and length). Included by the kernels
// that read or write whole heads (forwards, backwards, delta, sinks, dq_accum).
#pragma once

#include <cstdint>

#include "flash_params.h"

namespace flashattn_ext::cuda {

// The first element of head (b, h) of a tensor.
template <typename Elem>
__device__ __forceinline__ Elem* head_ptr(const TensorView4d& t, int64_t b, int64_t h) {
  return static_cast<Elem*>(t.data) + b * t.stride_batch + h * t.stride_head;
}

// A packed batch's sequence b: its first row and length in cu_seqlens (clamped
// to the packed rows and the longest length, so that no bound read from memory
// takes the kernel outside its tensors).
struct SequenceSpan {
  int start, length;
};
__device__ __forceinline__ SequenceSpan sequence_span(const IndexView& cu_seqlens, int64_t total, int64_t longest,
                                                      int b) {
  const int64_t start = clamp_index(cu_seqlens.at(0, b), 0, total);
  const int64_t end = clamp_index(cu_seqlens.at(0, b + 1), start, total);
  return {static_cast<int>(start), static_cast<int>(min(end - start, longest))};
}

}  // namespace flashattn_ext::cuda
