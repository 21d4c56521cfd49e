// The pieces every kernel file needs: the warp size and ceil_div, the
// current device's SM count, the dispatchers that turn runtime values (a flag,
// the element type, the head dim) into template arguments, and launch_kernel.
// Included by every .cu under csrc/cuda but sm90/descriptors.cu, and by the
// headers that build on it (tile_order.cuh, decode_common.cuh, the tile configs,
// the Hopper kernels' headers).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_cuda.h"

namespace flashattn_ext::cuda {

constexpr int kWarpSize = 32;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The current device's SM count, asked of the driver once per device.
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int device = 0, count = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices) count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    if (device < kMaxDevices) counts[device].store(count, std::memory_order_relaxed);
  }
  return std::max(count, 1);
}

// Calls fn with std::true_type if flag is set, else std::false_type: a kernel
// template argument from a runtime flag.
template <typename Fn>
void dispatch_flag(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Calls fn with the 16-bit element type of the inputs, as a value of that type.
template <typename Fn>
void dispatch_element_type(ElementType type, Fn&& fn) {
  if (type == ElementType::kBFloat16) {
    fn(__nv_bfloat16{});
  } else {
    fn(__half{});
  }
}

// Calls fn with the head dim the kernels are specialized for that serves dim,
// as a std::integral_constant: 64, 96, 128 or 256. Head dims between them run
// in the next larger one, padded with zeros.
template <typename Fn>
void dispatch_head_dim(int64_t dim, Fn&& fn) {
  if (dim <= 64) {
    fn(std::integral_constant<int, 64>{});
  } else if (dim <= 96) {
    fn(std::integral_constant<int, 96>{});
  } else if (dim <= 128) {
    fn(std::integral_constant<int, 128>{});
  } else {
    fn(std::integral_constant<int, 256>{});
  }
}

// Launches a kernel taking one params struct over a flattened 1-d grid (no
// 65535 limit), with its dynamic shared memory; nothing to do for 0 blocks.
template <typename Kernel, typename Params>
void launch_kernel(Kernel kernel, int64_t blocks, int threads, int smem_bytes, const Params& params,
                   cudaStream_t stream) {
  if (blocks == 0) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(params);
}

}  // namespace flashattn_ext::cuda
