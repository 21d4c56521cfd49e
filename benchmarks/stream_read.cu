// How fast a Hopper GPU streams 2 GiB out of its memory, read in the ways a
// memory-bound kernel can: plain 16-byte loads, 1-d bulk copies into a ring
// of shared memory, and tiled copies (tensor maps, 128-byte swizzle) of
// 64-column halves of 256-byte rows or of whole rows. The decode kernel
// (csrc/cuda/sm90/decode_sm90.cu) copies whole rows because of this: on an
// H100, boxes of 16 to 64 rows read 2.51-2.98 TB/s as halves and 3.06-3.10 as
// whole rows, as fast as plain loads (3.07) and 1-d bulk copies of 8 KiB and
// more (3.08-3.11) (benchmarks/results/records/2026-11-26_varlen-without-the-host-read-decode-at-the.md).
//
// A standalone program (no torch):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icsrc benchmarks/stream_read.cu -o /tmp/stream_read
//   /tmp/stream_read
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda/ptx.cuh"

namespace ptx = flashattn_ext::cuda::ptx;

constexpr size_t kBytes = size_t(2) << 30;
constexpr int kRingBytes = 192 << 10;
constexpr int kConsumers = 4;  // warps that wait for each stage and hand it back
constexpr int kMaxStages = 64;

// One block an SM: warp kConsumers's lane 0 fills the ring, stage by stage,
// with `copies` copies of `copy_bytes` (copy(i, c, dst, bar) issues copy c of
// stage i); the consumer warps read a word of each stage and hand it back.
template <typename Copy>
__device__ void stream_through_ring(int64_t steps, int copies, int copy_bytes, Copy copy, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char ring_raw[];
  unsigned char* ring = ring_raw + (1024 - ptx::smem_addr(ring_raw) % 1024) % 1024;  // (the swizzle's period)
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  const int stage_bytes = copies * copy_bytes, stages = min(kMaxStages, kRingBytes / stage_bytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kConsumers);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (warp == kConsumers) {
    if (lane != 0) return;
    for (int64_t i = 0; i < steps; ++i) {
      const int s = i % stages;
      ptx::mbarrier_wait(&empty[s], ((i / stages) & 1) ^ 1);
      ptx::mbarrier_arrive_expect_tx(&full[s], stage_bytes);
      for (int c = 0; c < copies; ++c) copy(i, c, ring + size_t(s) * stage_bytes + c * copy_bytes, &full[s]);
    }
    return;
  }
  unsigned acc = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const int s = i % stages;
    ptx::mbarrier_wait(&full[s], (i / stages) & 1);
    acc ^= reinterpret_cast<const unsigned*>(ring + size_t(s) * stage_bytes)[threadIdx.x];
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&empty[s]);
  }
  if (acc == 0x12345678) *sink = acc;  // (never: keeps the reads)
}

// Block b reads bytes [b * share, (b + 1) * share) in 1-d copies of `chunk`.
__global__ void bulk_stream(const char* src, int chunk, unsigned* sink) {
  const size_t share = kBytes / gridDim.x / chunk * chunk;
  const char* begin = src + share * blockIdx.x;
  stream_through_ring(share / chunk, 1, chunk, [&](int64_t i, int, void* dst, uint64_t* bar) {
    ptx::bulk_load(dst, begin + i * chunk, chunk, bar);
  }, sink);
}

// The 2 GiB as K and V, each (rows, 256-byte rows) of bfloat16, through a 5-d
// map (64 cols, column blocks, 1, rows, K or V): `halves` copies a row's
// 64-column halves apart (2 copies each of K and V a stage), else a copy
// takes whole rows (1 each).
__global__ void tiled_stream(const __grid_constant__ CUtensorMap map, int64_t rows, int box_rows, bool halves,
                             unsigned* sink) {
  const int64_t share = rows / gridDim.x / box_rows * box_rows, row0 = share * blockIdx.x;
  const int copies = halves ? 4 : 2, copy_bytes = box_rows * (halves ? 128 : 256);
  stream_through_ring(share / box_rows, copies, copy_bytes, [&](int64_t i, int c, void* dst, uint64_t* bar) {
    const int half = halves ? c % 2 : 0, kv = halves ? c / 2 : c;
    ptx::tma_load_5d(dst, &map, bar, 0, half, 0, static_cast<int>(row0 + i * box_rows), kv);
  }, sink);
}

__global__ void load_stream(const uint4* src, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) acc ^= __ldcs(src + i).x;
  if (acc == 0x12345678) *sink = acc;
}

template <typename Launch>
double gbps(Launch launch, double bytes) {
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 15; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(end);
    cudaEventSynchronize(end);
    float t;
    cudaEventElapsedTime(&t, start, end);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return bytes / ms[ms.size() / 2] / 1e6;
}

int main() {
  char* src;
  unsigned* sink;
  cudaMalloc(&src, kBytes);
  cudaMalloc(&sink, 4);
  cudaMemset(src, 1, kBytes);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int threads = (kConsumers + 1) * 32, smem = kRingBytes + 1024;
  cudaFuncSetAttribute(bulk_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(tiled_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);

  for (int blocks : {4 * sms, 16 * sms}) {
    printf("plain 16-byte loads, %d blocks of 256 threads: %.0f GB/s\n", blocks,
           gbps([&] { load_stream<<<blocks, 256>>>(reinterpret_cast<const uint4*>(src), kBytes / 16, sink); }, kBytes));
  }
  for (int chunk : {4096, 8192, 16384, 32768}) {
    const double bytes = double(kBytes / sms / chunk * chunk) * sms;
    printf("1-d bulk copies of %5d bytes: %.0f GB/s\n", chunk,
           gbps([&] { bulk_stream<<<sms, threads, smem>>>(src, chunk, sink); }, bytes));
  }
  void* encode_fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode_fn, 12000, cudaEnableDefault, &found);
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(encode_fn);
  const int64_t rows = kBytes / 2 / 256;
  for (bool halves : {true, false}) {
    for (int box_rows : {16, 32, 64}) {
      CUtensorMap map;
      const cuuint64_t dims[5] = {64, 2, 1, cuuint64_t(rows), 2};
      const cuuint64_t strides[4] = {128, cuuint64_t(rows) * 256, 256, cuuint64_t(rows) * 256};
      const cuuint32_t box[5] = {64, halves ? 1u : 2u, 1, cuuint32_t(box_rows), 1};
      const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
      if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, src, dims, strides, box, element_strides,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        printf("tensor map refused\n");
        continue;
      }
      const double bytes = double(rows / sms / box_rows * box_rows) * sms * 2 * 256;
      printf("tiled copies of %s, %2d rows a box: %.0f GB/s\n", halves ? "64-column halves" : "whole rows     ",
             box_rows, gbps([&] { tiled_stream<<<sms, threads, smem>>>(map, rows, box_rows, halves, sink); }, bytes));
    }
  }
  printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
