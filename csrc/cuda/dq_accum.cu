// The float32 dQ accumulator of the atomic backwards of both kernel families:
// its size and its final scaling and rounding into dq (layout in dq_accum.cuh).
#include "cuda/dq_accum.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/views.cuh"

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
      params.dq_accum + ((b * p.heads_q + h) * padded_len_q + i) * dq_accum_cols(kHeadDim) + dq_accum_column(col));
  const float scale = static_cast<float>(p.scale);
  *reinterpret_cast<uint32_t*>(head_ptr<Elem>(params.dq, b, h) + i * params.dq.stride_row + col) =
      ptx::pack2<Elem>(acc.x * scale, acc.y * scale);
}

// The same for the wgmma-tiles layout: one block per 64 x 64 slice of a
// dq_accum tile. Its floats are read in order (whole lines), put in place in
// shared memory, and written as rows of dq (whole 128-byte rows of the slice
// a warp instruction): 3.0 TB/s on the H100, where writing each quad's two
// pairs straight to dq (half-sectors) ran at 1.8 TB/s. dq's rows are 16-byte aligned on this path (the Hopper
// backward's inputs are), so 8-byte stores of 4 elements are aligned.
constexpr int kSliceRows = kDqAccumRowMultiple, kSliceCols = kDqAccumSliceCols;
constexpr int kSliceQuads = kSliceRows * kSliceCols / 4;
// Padded rows: the quads' float2 stores (rows r and r + 8, 8 columns of 4 rows
// a half-warp) and the float4 row reads are both free of bank conflicts.
constexpr int kSliceStride = kSliceCols + 8;
static_assert(kSliceQuads % kConvertThreads == 0, "whole quads a thread");

template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) convert_dq_accum_tiles_kernel(const BwdParams params) {
  const AttentionProblem& p = params.problem;
  constexpr int kSlicesPerTile = kHeadDim / kSliceCols;
  __shared__ float s_slice[kSliceRows][kSliceStride];
  const int tid = threadIdx.x;
  const float4* quads = reinterpret_cast<const float4*>(params.dq_accum) + int64_t(blockIdx.x) * kSliceQuads;
#pragma unroll
  for (int k = 0; k < kSliceQuads / kConvertThreads; ++k) {
    const int quad = k * kConvertThreads + tid;
    const float4 acc = quads[quad];
    const DqAccumQuad at = dq_accum_quad(quad);  // a quad of slice 0: its column within the slice
    *reinterpret_cast<float2*>(&s_slice[at.row][at.col]) = make_float2(acc.x, acc.y);
    *reinterpret_cast<float2*>(&s_slice[at.row + 8][at.col]) = make_float2(acc.z, acc.w);
  }
  __syncthreads();
  const int col0 = static_cast<int>(blockIdx.x % kSlicesPerTile) * kSliceCols;
  const int64_t tile = blockIdx.x / kSlicesPerTile;
  // The tile's dq rows: from row0 of a dense call's (batch, head), rows below len_q.
  int64_t row0, len_q;
  Elem* dq;
  const PackedSequences& packed = params.packed;
  if (packed.present()) {
    // A packed batch: the tile's head, and its sequence (the last whose rows
    // start at or before the tile's: packed_dq_accum_start grows with it).
    const int64_t head_rows = packed_dq_accum_start(packed.total_q, p.batch);
    const int64_t head = tile / (head_rows / kSliceRows), accum_row = tile % (head_rows / kSliceRows) * kSliceRows;
    int64_t low = 0, high = p.batch - 1;
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (packed_dq_accum_start(packed.cu_seqlens_q.at(0, mid), mid) <= accum_row) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    // (Clamped as sequence_span's: bounds that are not a packed batch's keep the rows in dq.)
    const SequenceSpan queries = sequence_span(packed.cu_seqlens_q, packed.total_q, p.len_q, static_cast<int>(low));
    row0 = accum_row - packed_dq_accum_start(queries.start, low);
    len_q = queries.length;
    dq = head_ptr<Elem>(params.dq, 0, head) + int64_t{queries.start} * params.dq.stride_row;
  } else {
    const int64_t tiles_per_head = ceil_div(p.len_q, kDqAccumRowMultiple);
    // head: b * heads_q + h, from the first query head of the pairs dq_accum holds on
    const int64_t head = params.dq_accum_pair0 * (p.heads_q / p.heads_kv) + tile / tiles_per_head;
    row0 = (tile % tiles_per_head) * kSliceRows;
    len_q = p.len_q;
    dq = head_ptr<Elem>(params.dq, head / p.heads_q, head % p.heads_q);
  }
  const float scale = static_cast<float>(p.scale);
  constexpr int kRowQuads = kSliceCols / 4;
#pragma unroll
  for (int k = 0; k < kSliceQuads / kConvertThreads; ++k) {
    const int index = k * kConvertThreads + tid, row = index / kRowQuads, col = col0 + index % kRowQuads * 4;
    if (row0 + row < 0 || row0 + row >= len_q || col >= p.head_dim) continue;
    const float4 acc = *reinterpret_cast<const float4*>(&s_slice[row][col - col0]);
    *reinterpret_cast<uint2*>(dq + (row0 + row) * params.dq.stride_row + col) =
        make_uint2(ptx::pack2<Elem>(acc.x * scale, acc.y * scale), ptx::pack2<Elem>(acc.z * scale, acc.w * scale));
  }
}

}  // namespace

int64_t packed_dq_accum_floats(const BwdParams& params) {
  const AttentionProblem& p = params.problem;
  int64_t floats = 0;
  dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    floats = p.heads_q * packed_dq_accum_start(params.packed.total_q, p.batch) * dq_accum_cols(head_dim);
  });
  return floats;
}

int64_t dq_accum_floats(const AttentionProblem& p, int64_t pairs) {
  int64_t floats = 0;
  dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 0;  // query heads a pair (a call may have none)
    floats = pairs * group * ceil_div(p.len_q, kDqAccumRowMultiple) * kDqAccumRowMultiple * dq_accum_cols(head_dim);
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
      } else {  // (the Hopper backward's, whose kernels' head dims are those of dq_accum_cols: 64, 128, 256)
        const int64_t floats =
            params.packed.present() ? packed_dq_accum_floats(params) : dq_accum_floats(p, params.dq_accum_pairs);
        launch_kernel(convert_dq_accum_tiles_kernel<Elem, dq_accum_cols(kHeadDim)>, floats / (kSliceRows * kSliceCols),
                      kConvertThreads, 0, params, stream);
      }
    });
  });
}

}  // namespace flashattn_ext::cuda
