// 16-bit tensors to e4m3 and back with one descale a (batch, key/value head):
// the quantize_fp8 and dequantize_fp8 ops on CUDA (ops_fp8_cuda.cpp), in
// the arithmetic of their ATen paths (ops_fp8.cpp), bit for bit. Memory-bound:
// the quantize reads its input twice (the largest magnitude, then the cast),
// the dequantize reads and writes once; 8 elements a thread at a time where
// the layout allows.
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

// kVectorized: both sides' columns contiguous, whole groups of kVector of them
// 16-byte (16-bit side) and 8-byte (e4m3 side) aligned, so that a thread moves
// kVector elements with one load and one store; else one element at a time.
constexpr int kVector = 8;

// visit(row, col) for each group of columns a thread takes of the block's
// rows: kVector columns (kVectorized) or one, kConvertThreads groups apart.
template <bool kVectorized, typename Visit>
__device__ __forceinline__ void for_each_group(const ConvertBlock& block, int64_t cols, Visit&& visit) {
  const int step = kVectorized ? kVector : 1, width = static_cast<int>(cols);  // (32-bit divisions)
  for (int i = threadIdx.x * step; i < block.rows * width; i += kConvertThreads * step) {
    visit(block.row0 + i / width, int64_t{i % width});
  }
}

template <typename Elem>
struct Wide8 {
  uint4 bits;
  __device__ __forceinline__ float get(int i) const {
    const uint32_t word = (&bits.x)[i / 2];
    const float2 pair = ptx::unpack2<Elem>(word);
    return i % 2 == 0 ? pair.x : pair.y;
  }
};

// amax[pair] = the largest |x| of its heads, as float bits: atomicMax on the
// bits of non-negative floats orders them as the floats (a NaN's bits above
// infinity's, so that a NaN makes the descale NaN, as ATen's amax does).
template <typename Elem, bool kVectorized>
__global__ void __launch_bounds__(kConvertThreads) fp8_amax_kernel(const Fp8ConvertParams params) {
  const ConvertBlock block = convert_block(params);
  const Elem* x = head_ptr<const Elem>(params.wide, block.b, block.h);
  int largest = 0;
  for_each_group<kVectorized>(block, params.cols, [&](int64_t row, int64_t col) {
    const int64_t at = offset(params.wide, row, col);
    if constexpr (kVectorized) {
      const Wide8<Elem> v{*reinterpret_cast<const uint4*>(x + at)};
#pragma unroll
      for (int e = 0; e < kVector; ++e) largest = max(largest, __float_as_int(v.get(e)) & 0x7fffffff);
    } else {
      largest = max(largest, __float_as_int(ptx::to_float(x[at])) & 0x7fffffff);
    }
  });
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

// e4m3 of x, rounded to nearest and saturated (two at once: cuda_fp8.h's
// conversions, native from sm_89, emulated before).
__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// x8 = e4m3(x / descale), rounded to nearest and saturated, descale =
// max(amax / 448, FLT_MIN) (a NaN amax stays NaN); the first block of each
// pair's first head writes the descale.
template <typename Elem, bool kVectorized>
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
  for_each_group<kVectorized>(block, params.cols, [&](int64_t row, int64_t col) {
    if constexpr (kVectorized) {
      const Wide8<Elem> v{*reinterpret_cast<const uint4*>(x + offset(params.wide, row, col))};
      uint16_t pairs[kVector / 2];
#pragma unroll
      for (int e = 0; e < kVector / 2; ++e) {
        pairs[e] = to_e4m3x2(__fdiv_rn(v.get(2 * e), descale), __fdiv_rn(v.get(2 * e + 1), descale));
      }
      *reinterpret_cast<uint2*>(x8 + offset(params.narrow, row, col)) =
          make_uint2(pairs[0] | uint32_t{pairs[1]} << 16, pairs[2] | uint32_t{pairs[3]} << 16);
    } else {
      x8[offset(params.narrow, row, col)] = __nv_cvt_float_to_fp8(
          __fdiv_rn(ptx::to_float(x[offset(params.wide, row, col)]), descale), __NV_SATFINITE, __NV_E4M3);
    }
  });
}

// e4m3 to float, exactly (through fp16, which holds every e4m3 value).
__device__ __forceinline__ float2 from_e4m3x2(uint16_t pair) {
  const __half2 halves(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
  return __half22float2(halves);
}

// wide = Elem(float(x8) * descale), rounded to nearest.
template <typename Elem, bool kVectorized>
__global__ void __launch_bounds__(kConvertThreads) fp8_dequantize_kernel(const Fp8ConvertParams params) {
  const ConvertBlock block = convert_block(params);
  const float descale = params.descale[block.pair];
  const __nv_fp8_storage_t* x8 = head_ptr<const __nv_fp8_storage_t>(params.narrow, block.b, block.h);
  Elem* wide = head_ptr<Elem>(params.wide, block.b, block.h);
  for_each_group<kVectorized>(block, params.cols, [&](int64_t row, int64_t col) {
    if constexpr (kVectorized) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(x8 + offset(params.narrow, row, col));
      uint4 out;
#pragma unroll
      for (int e = 0; e < kVector / 2; ++e) {
        const uint32_t word = (&bytes.x)[e / 2];
        const float2 v = from_e4m3x2(static_cast<uint16_t>(e % 2 == 0 ? word : word >> 16));
        (&out.x)[e] = ptx::pack2<Elem>(v.x * descale, v.y * descale);
      }
      *reinterpret_cast<uint4*>(wide + offset(params.wide, row, col)) = out;
    } else {
      const float value = __half2float(__half(__nv_cvt_fp8_to_halfraw(x8[offset(params.narrow, row, col)], __NV_E4M3)));
      wide[offset(params.wide, row, col)] = ptx::from_float<Elem>(value * descale);
    }
  });
}

// Whether every group of kVector columns starts aligned for the vectors on both sides.
bool vectorizable(const Fp8ConvertParams& p, int wide_bytes) {
  auto aligned = [&](const TensorView4d& t, int64_t bytes) {
    return t.stride_col == 1 && t.stride_row % kVector == 0 && t.stride_head % kVector == 0 &&
           t.stride_batch % kVector == 0 && reinterpret_cast<uintptr_t>(t.data) % bytes == 0;
  };
  return p.cols % kVector == 0 && aligned(p.wide, int64_t{kVector} * wide_bytes) && aligned(p.narrow, kVector);
}

int64_t convert_blocks(const Fp8ConvertParams& p) { return p.batch * p.heads * ceil_div(p.rows, kConvertRows); }

}  // namespace

void quantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    dispatch_flag(vectorizable(params, sizeof(Elem)), [&](auto vectorized) {
      launch_kernel(fp8_amax_kernel<Elem, vectorized>, convert_blocks(params), kConvertThreads, 0, params, stream);
      launch_kernel(fp8_quantize_kernel<Elem, vectorized>, convert_blocks(params), kConvertThreads, 0, params,
                    stream);
    });
  });
}

void dequantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    dispatch_flag(vectorizable(params, sizeof(Elem)), [&](auto vectorized) {
      launch_kernel(fp8_dequantize_kernel<Elem, vectorized>, convert_blocks(params), kConvertThreads, 0, params,
                    stream);
    });
  });
}

}  // namespace flashattn_ext::cuda
