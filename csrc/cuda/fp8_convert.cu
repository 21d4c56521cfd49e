// 16-bit tensors to e4m3 and back with one descale a (batch, key/value head):
// the quantize_fp8 and dequantize_fp8 ops on CUDA (ops_fp8_cuda.cpp), in
// the arithmetic of their ATen paths (ops_fp8.cpp), bit for bit. Memory-bound:
// the quantize reads its input twice (the largest magnitude, then the cast),
// the dequantize reads and writes once.
#include <cuda_fp8.h>

#include <cfloat>

#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/views.cuh"

namespace flashattn_ext::cuda {
namespace {

constexpr int kConvertThreads = 256;
constexpr int kConvertRows = 32;  // rows of one head a block
constexpr float kE4M3Max = 448.f;

// The rows of one (batch, head) that a block converts.
struct ConvertBlock {
  int64_t b, h, pair;  // pair: the (batch, key/value head) whose descale it uses
  int64_t row0;
  int rows;
};

__device__ __forceinline__ ConvertBlock convert_block(const Fp8ConvertParams& p) {
  const int64_t row_blocks = ceil_div(p.rows, kConvertRows);
  ConvertBlock block;
  block.row0 = blockIdx.x % row_blocks * kConvertRows;
  block.h = blockIdx.x / row_blocks % p.heads;
  block.b = blockIdx.x / (row_blocks * p.heads);
  block.pair = block.b * p.heads_kv + block.h / (p.heads / p.heads_kv);
  block.rows = static_cast<int>(min(int64_t{kConvertRows}, p.rows - block.row0));
  return block;
}

__device__ __forceinline__ int64_t offset(const TensorView4d& t, int64_t row, int64_t col) {
  return row * t.stride_row + col * t.stride_col;
}

// amax[pair] = the largest |x| of its heads, as float bits: atomicMax on the
// bits of non-negative floats orders them as the floats (a NaN's bits above
// infinity's, so that a NaN makes the descale NaN, as ATen's amax does).
template <typename Elem>
__global__ void __launch_bounds__(kConvertThreads) fp8_amax_kernel(const Fp8ConvertParams params) {
  const ConvertBlock block = convert_block(params);
  const Elem* x = head_ptr<const Elem>(params.wide, block.b, block.h);
  const int cols = static_cast<int>(params.cols);
  int largest = 0;
  for (int i = threadIdx.x; i < block.rows * cols; i += kConvertThreads) {
    const float value = ptx::to_float(x[offset(params.wide, block.row0 + i / cols, i % cols)]);
    largest = max(largest, __float_as_int(value) & 0x7fffffff);
  }
#pragma unroll
  for (int lanes = kWarpSize / 2; lanes > 0; lanes /= 2) {
    largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, lanes));
  }
  __shared__ int warp_largest[kConvertThreads / kWarpSize];
  if (threadIdx.x % kWarpSize == 0) warp_largest[threadIdx.x / kWarpSize] = largest;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kConvertThreads / kWarpSize; ++w) largest = max(largest, warp_largest[w]);
    atomicMax(reinterpret_cast<int*>(params.amax) + block.pair, largest);
  }
}

// x8 = e4m3(x / descale), rounded to nearest and saturated, descale =
// max(amax / 448, FLT_MIN) (a NaN amax stays NaN); the first block of each
// pair's first head writes the descale.
template <typename Elem>
__global__ void __launch_bounds__(kConvertThreads) fp8_quantize_kernel(const Fp8ConvertParams params) {
  const ConvertBlock block = convert_block(params);
  // (__fdiv_rn: IEEE division whatever the build's flags, as ATen divides)
  float descale = __fdiv_rn(params.amax[block.pair], kE4M3Max);
  descale = descale < FLT_MIN ? FLT_MIN : descale;
  if (threadIdx.x == 0 && block.row0 == 0 && block.h % (params.heads / params.heads_kv) == 0) {
    params.descale[block.pair] = descale;
  }
  const Elem* x = head_ptr<const Elem>(params.wide, block.b, block.h);
  __nv_fp8_storage_t* x8 = head_ptr<__nv_fp8_storage_t>(params.narrow, block.b, block.h);
  const int cols = static_cast<int>(params.cols);
  for (int i = threadIdx.x; i < block.rows * cols; i += kConvertThreads) {
    const int64_t row = block.row0 + i / cols, col = i % cols;
    x8[offset(params.narrow, row, col)] = __nv_cvt_float_to_fp8(
        __fdiv_rn(ptx::to_float(x[offset(params.wide, row, col)]), descale), __NV_SATFINITE, __NV_E4M3);
  }
}

// wide = Elem(float(x8) * descale), rounded to nearest.
template <typename Elem>
__global__ void __launch_bounds__(kConvertThreads) fp8_dequantize_kernel(const Fp8ConvertParams params) {
  const ConvertBlock block = convert_block(params);
  const float descale = params.descale[block.pair];
  const __nv_fp8_storage_t* x8 = head_ptr<const __nv_fp8_storage_t>(params.narrow, block.b, block.h);
  Elem* wide = head_ptr<Elem>(params.wide, block.b, block.h);
  const int cols = static_cast<int>(params.cols);
  for (int i = threadIdx.x; i < block.rows * cols; i += kConvertThreads) {
    const int64_t row = block.row0 + i / cols, col = i % cols;
    const float value = __half2float(__half(__nv_cvt_fp8_to_halfraw(x8[offset(params.narrow, row, col)], __NV_E4M3)));
    wide[offset(params.wide, row, col)] = ptx::from_float<Elem>(value * descale);
  }
}

int64_t convert_blocks(const Fp8ConvertParams& p) { return p.batch * p.heads * ceil_div(p.rows, kConvertRows); }

}  // namespace

void quantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    launch_kernel(fp8_amax_kernel<Elem>, convert_blocks(params), kConvertThreads, 0, params, stream);
    launch_kernel(fp8_quantize_kernel<Elem>, convert_blocks(params), kConvertThreads, 0, params, stream);
  });
}

void dequantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    launch_kernel(fp8_dequantize_kernel<Elem>, convert_blocks(params), kConvertThreads, 0, params, stream);
  });
}

}  // namespace flashattn_ext::cuda
