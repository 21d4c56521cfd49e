// The rows that see one key or none (exact zeros in dS, the kOneKeyRowDelta
// mark, lse_log2's +inf); which keys a query row sees is flash_params.h's
// Visibility. Included by the forwards and
// backwards of both families and by mask_blocks.cu (the mark).
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_params.h"

namespace flashattn_ext::cuda {

// Query rows that see key 0 and no other (a causal row whose diagonal passes
// through key 0, or any row when there is one key) have probability 1 there,
// so their dS = P (dP - delta) is exactly 0, as SDPA gives; the kernels' is
// not (delta comes from the rounded output), so they zero it for these rows:
// those of rows [row0, row0 + rows), as [begin, end) counted from row0. Not
// with attention sinks (BwdParams::sinks): the sink takes part of the weight.
struct RowRange {
  int begin, end;
  __device__ __forceinline__ bool holds(int row) const { return unsigned(row - begin) < unsigned(end - begin); }
};
__device__ __forceinline__ RowRange rows_seeing_first_key_alone(bool is_causal, int64_t len_k, int64_t offset,
                                                                int64_t row0, int rows) {
  // Causal rows see key 0 from row -offset on; the one row there sees it alone, or all do where it is the only key.
  const int64_t first = is_causal ? -offset - row0 : -row0;
  const int64_t end = len_k == 1 ? rows : is_causal ? first + 1 : 0;
  auto clamp = [&](int64_t row) { return static_cast<int>(max(min(row, int64_t(rows)), int64_t(0))); };
  return {clamp(first), clamp(end)};
}
__device__ __forceinline__ RowRange rows_seeing_first_key_alone(const BwdParams& params, int64_t offset, int64_t row0,
                                                                int rows) {
  if (params.sinks != nullptr) return {0, 0};
  return rows_seeing_first_key_alone(params.problem.is_causal, params.problem.len_k, offset, row0, rows);
}

// Rows that an attn_mask leaves one key (any key) are the same case: the
// backward marks them before its kernels run (mark_rows_seeing_one_key) by
// setting their delta to this NaN. Arithmetic never makes it (the GPU's NaNs
// are 0x7fffffff, and a 16-bit NaN widened to float has its low 13 bits 0), so
// a NaN that comes from the inputs is not mistaken for it.
constexpr uint32_t kOneKeyRowDelta = 0x7fc00001u;

__device__ __forceinline__ bool marks_one_key_row(float delta) { return __float_as_uint(delta) == kOneKeyRowDelta; }

// dS = P (dP - delta) of one score; exactly 0 in a row marked kOneKeyRowDelta
// (kMasked: kernels that take an attn_mask, the only ones that see the mark).
// (The Hopper backward zeroes the marked rows of a tile after the fact instead:
// zero_rows_seeing_one_key.)
template <bool kMasked>
__device__ __forceinline__ float score_gradient(float p, float dp, float delta) {
  return kMasked && marks_one_key_row(delta) ? 0.f : p * (dp - delta);
}

// The log-sum-exp in log2 units, with rows that see no key (lse = -inf) and rows
// past the end mapped to +inf, so that exp2(s - lse) is 0 for them.
__device__ __forceinline__ float lse_log2(const float* lse, int64_t row, int64_t len) {
  if (row >= len) return INFINITY;
  const float x = lse[row];
  return x == -INFINITY ? INFINITY : x * float(M_LOG2E);
}

}  // namespace flashattn_ext::cuda
