// The float32 dQ accumulator of the atomic backwards of both kernel families:
// its size and its final scaling and rounding into dq (layout in flash_common.cuh).
#include "cuda/flash_common.cuh"
#include "cuda/flash_cuda.h"

namespace flashattn_ext::cuda {
namespace {

constexpr int kConvertThreads = 256;

// dq = dq_accum * scale, rounded to Elem. Rows layout: one thread per pair of
// columns of dq.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) convert_dq_accum_rows_kernel(const BwdParams params) {
  const AttentionProblem& p = params.problem;
  const int64_t pair = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  const int64_t pairs_per_row = p.head_dim / 2;
  if (pair >= p.batch * p.heads_q * p.len_q * pairs_per_row) return;
  const int64_t col = (pair % pairs_per_row) * 2, row = pair / pairs_per_row;
  const int64_t i = row % p.len_q, h = (row / p.len_q) % p.heads_q, b = row / (p.len_q * p.heads_q);
  const int64_t padded_len_q = ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple;
  const float2 acc = *reinterpret_cast<const float2*>(
      params.dq_accum + ((b * p.heads_q + h) * padded_len_q + i) * kHeadDim + dq_accum_column(col));
  const float scale = static_cast<float>(p.scale);
  *reinterpret_cast<uint32_t*>(head_ptr<Elem>(params.dq, b, h) + i * params.dq.stride_row + col) =
      ptx::pack2<Elem>(acc.x * scale, acc.y * scale);
}

// The same for the wgmma-tiles layout: one thread per quad of dq_accum (read
// in order), two pairs of dq.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) convert_dq_accum_tiles_kernel(const BwdParams params) {
  const AttentionProblem& p = params.problem;
  constexpr int kTileQuads = kDqAccumRowMultiple * kHeadDim / 4;
  const int64_t quad = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  const int64_t tiles_per_head = ceil_div(p.len_q, kDqAccumRowMultiple);
  if (quad >= p.batch * p.heads_q * tiles_per_head * kTileQuads) return;
  const float4 acc = reinterpret_cast<const float4*>(params.dq_accum)[quad];
  const int64_t tile = quad / kTileQuads, head = tile / tiles_per_head;  // head: b * heads_q + h
  const DqAccumQuad at = dq_accum_quad(static_cast<int>(quad % kTileQuads));
  if (at.col >= p.head_dim) return;
  const int64_t i = (tile % tiles_per_head) * kDqAccumRowMultiple + at.row;
  const float scale = static_cast<float>(p.scale);
  Elem* dq = head_ptr<Elem>(params.dq, head / p.heads_q, head % p.heads_q) + at.col;
  if (i < p.len_q) {
    *reinterpret_cast<uint32_t*>(dq + i * params.dq.stride_row) = ptx::pack2<Elem>(acc.x * scale, acc.y * scale);
  }
  if (i + 8 < p.len_q) {
    *reinterpret_cast<uint32_t*>(dq + (i + 8) * params.dq.stride_row) =
        ptx::pack2<Elem>(acc.z * scale, acc.w * scale);
  }
}

}  // namespace

int64_t dq_accum_floats(const AttentionProblem& p) {
  int64_t floats = 0;
  dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    floats = p.batch * p.heads_q * ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple * kHeadDim;
  });
  return floats;
}

void convert_dq_accum(const BwdParams& params, ElementType type, DqAccumLayout layout, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_head_dim(p.head_dim, [&](auto head_dim) {
      using Elem = decltype(elem);
      constexpr int kHeadDim = decltype(head_dim)::value;
      if (layout == DqAccumLayout::kRows) {
        launch_kernel(convert_dq_accum_rows_kernel<Elem, kHeadDim>,
                      ceil_div(p.batch * p.heads_q * p.len_q * p.head_dim / 2, kConvertThreads), kConvertThreads, 0,
                      params, stream);
      } else {
        launch_kernel(convert_dq_accum_tiles_kernel<Elem, kHeadDim>,
                      ceil_div(dq_accum_floats(p) / 4, kConvertThreads), kConvertThreads, 0, params, stream);
      }
    });
  });
}

}  // namespace flashattn_ext::cuda
