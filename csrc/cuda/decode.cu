// Decoding on CUDA, the steps around either family's kernels (sm90/decode_sm90.cu,
// sm80/decode.cu): the new keys and values appended to the caches first (FP8
// caches: quantized on the way), and
// last the NaN marks of sequences whose lengths or block tables are out of range.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "cuda/decode_common.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"

namespace flashattn_ext::cuda {
namespace {

using decoding::cache_row;

// Writes key_new and value_new into the caches, one thread per element of a
// key row and of a value row; into an FP8 cache (params.k_scale set) as e4m3
// of x / scale, rounded to nearest and saturated (as the CPU op writes them).
// A sequence whose keys do not fit its cache gets nothing written, nor does a
// row whose block table entry names no block of the cache (decode_poison
// marks their results NaN).
template <typename Elem>
__global__ void append_kernel(const DecodeParams params) {
  const AttentionProblem& p = params.problem;
  const int64_t cols = p.head_dim + p.head_dim_v;
  const int64_t index = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (index >= p.batch * p.heads_kv * params.len_new * cols) return;
  const int64_t col = index % cols, i = index / cols % params.len_new;
  const int64_t h = index / (cols * params.len_new) % p.heads_kv, b = index / (cols * params.len_new * p.heads_kv);
  if (!params.length_fits(b)) return;
  const int64_t j = params.cached_length(b) + i;
  if (params.block_table.data != nullptr && !params.is_cache_block(params.block_table.at(b, j / params.block_size))) {
    return;
  }
  const bool key = col < p.head_dim;
  const TensorView4d& src = key ? params.k_new : params.v_new;
  const TensorView4d& dst = key ? params.k_cache : params.v_cache;
  const int64_t c = key ? col : col - p.head_dim;
  const Elem* from = static_cast<const Elem*>(src.data) + b * src.stride_batch + h * src.stride_head + i * src.stride_row;
  const Elem value = from[c * src.stride_col];
  if (params.k_scale == nullptr) {
    cache_row<Elem>(params, dst, b, h, j)[c * dst.stride_col] = value;
    return;
  }
  const float scale = (key ? params.k_scale : params.v_scale)[h * params.scale_stride_head];
  // (__fdiv_rn: IEEE division whatever the build's flags, so that ties round as on the CPU)
  cache_row<__nv_fp8_storage_t>(params, dst, b, h, j)[c * dst.stride_col] =
      __nv_cvt_float_to_fp8(__fdiv_rn(ptx::to_float(value), scale), __NV_SATFINITE, __NV_E4M3);
}

// One block a sequence: where its cache_seqlens or a block table entry it
// reads is out of range (what the CPU op raises on), its out and lse become
// NaN, written after the kernels' own results.
template <typename Elem>
__global__ void poison_kernel(const DecodeParams params) {
  const AttentionProblem& p = params.problem;
  const int64_t b = blockIdx.x;
  bool bad = !params.length_fits(b);
  if (!bad && params.block_table.data != nullptr) {
    const int64_t blocks = ceil_div(params.cached_length(b) + params.len_new, params.block_size);
    for (int64_t block = threadIdx.x; block < blocks && !bad; block += blockDim.x) {
      bad = !params.is_cache_block(params.block_table.at(b, block));
    }
  }
  if (!__syncthreads_or(bad)) return;
  const int64_t rows = p.heads_q * p.len_q;
  for (int64_t e = threadIdx.x; e < rows * p.head_dim_v; e += blockDim.x) {
    const int64_t row = e / p.head_dim_v, h = row / p.len_q, token = row % p.len_q, c = e % p.head_dim_v;
    static_cast<Elem*>(params.out.data)[b * params.out.stride_batch + h * params.out.stride_head +
                                        token * params.out.stride_row + c * params.out.stride_col] =
        ptx::from_float<Elem>(NAN);
  }
  for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) static_cast<float*>(params.lse)[b * rows + row] = NAN;
}

}  // namespace

void decode_append(const DecodeParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  const int64_t new_elements = p.batch * p.heads_kv * params.len_new * (p.head_dim + p.head_dim_v);
  if (new_elements == 0) return;
  dispatch_element_type(type, [&](auto elem) {
    append_kernel<decltype(elem)><<<static_cast<unsigned>(ceil_div(new_elements, 256)), 256, 0, stream>>>(params);
  });
}

void decode_poison(const DecodeParams& params, ElementType type, bool lengths_marked, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  if (params.cache_seqlens.data == nullptr || p.batch == 0 || p.heads_q * p.len_q * p.head_dim_v == 0) return;
  if (lengths_marked && params.block_table.data == nullptr) return;
  dispatch_element_type(type, [&](auto elem) {
    poison_kernel<decltype(elem)><<<static_cast<unsigned>(p.batch), 128, 0, stream>>>(params);
  });
}

}  // namespace flashattn_ext::cuda
