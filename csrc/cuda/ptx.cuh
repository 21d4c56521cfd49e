// Thin wrappers over the PTX instructions the kernels use, one each, named
// after the instruction. Fragment layouts follow the PTX ISA's description of
// mma.m16n8k16 (warp-level matrix multiply-accumulate).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn_ext::cuda::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// cp.async.cg.shared.global: copy 16 bytes global -> shared without staging in
// registers; src_bytes = 0 writes zeros instead (rows or columns out of range).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes));
}

// cp.async.cg.shared.global.L2::256B: as cp_async_16, with a hint to the L2 to
// fetch the 256 bytes around the piece (streams read once: +1-3% bandwidth in decoding).
__device__ __forceinline__ void cp_async_16_l2_prefetch_256(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes));
}

// cp.async.commit_group: close the group of cp.async issued so far.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// cp.async.wait_group N: wait until at most N groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 b16 matrices; lanes
// 8i..8i+7 give the row addresses (shared-space, see smem_addr) of matrix i,
// and register i of each lane receives its two elements of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: the same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}

// stmatrix.sync.aligned.m8n8.x4.shared.b16: the inverse of ldmatrix_x4: four
// 8x8 b16 matrices, register i of each lane holding its two elements of matrix
// i (the layout of an mma accumulator's 8x8 pieces); lanes 8i..8i+7 give the
// row addresses of matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_row, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// stmatrix.sync.aligned.m8n8.x4.trans.shared.b16: the same, each matrix
// stored transposed (row i of the stored matrix: column i of the fragment).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_row, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// movmatrix.sync.aligned.m8n8.trans.b16: an 8x8 b16 matrix held as an mma
// fragment (lane i: row i / 4, elements 2 (i % 4) and the next) transposed,
// in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(x));
  return d;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D = A B + D
// with A 16x16 (4 registers), B 16x8 (2 registers), D 16x8 in float (4 registers).
template <typename Elem>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// red.global.add.v4.f32: adds four floats to four adjacent floats in global
// memory (16-byte aligned) without returning the old values; the vector form
// needs sm_90, older GPUs issue four scalar red.global.add.f32.
__device__ __forceinline__ void red_add_v4_f32(float* gmem, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem + 1), "f"(b) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem + 2), "f"(c) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem + 3), "f"(d) : "memory");
#endif
}

// prmt.b32 (default mode): byte i of the result is byte (selector nibble i &
// 7) of {b, a} (a's bytes 0-3, b's 4-7), or with the nibble's bit 3 set that
// byte's top bit repeated over all eight.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// Two float8 e4m3 values (the low byte first) as two halves (low half
// first), exactly: e4m3's values are all fp16's (sm_89 on).
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint16_t pair) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"(pair));
  return d;
}

// Four floats rounded to float8 e4m3 (saturating to +-448) in one register,
// x0 in the low byte. cvt.rn.satfinite.e4m3x2.f32 puts its first source in
// the upper byte of its 16-bit result.
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  uint32_t d;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(d)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return d;
}

// Two floats rounded to one register of two 16-bit elements (low half first).
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two bfloat16 products at once, each rounded to nearest.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One register of two 16-bit elements to two floats (low half first): pack2's inverse.
template <typename Elem>
__device__ __forceinline__ float2 unpack2(uint32_t v);

template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return {__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u)};  // bfloat16: a float's high half
}

template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// One 16-bit element to float (torch builds with the implicit conversions off).
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// A float rounded to one 16-bit element.
template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// tanh.approx.f32: tanh(x) to a relative error of about 2^-11 (MUFU.TANH).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// lg2.approx.ftz.f32: log2(x).
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ex2.approx.ftz.f32: 2^x, the fast exponential the softmax uses.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------
// Hopper (sm_90): mbarriers, the tensor memory accelerator (TMA), warpgroup
// matrix multiply (wgmma, sm_90a) and register reallocation (setmaxnreg, sm_90a).
// Shared-memory addresses are shared-space (see smem_addr).

// mbarrier.init.shared::cta.b64: a barrier whose phase completes after `count`
// arrivals and the transaction bytes announced for it.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// fence.mbarrier_init.release.cluster: barrier initializations become visible
// to the copy engine and to other threads (then synchronize the block).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// mbarrier.arrive.expect_tx.shared::cta.b64: arrive, and make the phase also
// wait for `bytes` more bytes of asynchronous copies.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// mbarrier.arrive.shared::cta.b64: one arrival.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// mbarrier.try_wait.parity.shared::cta.b64: whether the phase of the given
// parity has completed (a fresh barrier counts the phase before it, parity 1,
// as complete); it may suspend the thread for a while before saying no.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes:
// the copy engine loads the box at coordinates (c0, c1, c2, c3) (innermost
// first) of the tensor map (a __grid_constant__ kernel parameter) into shared
// memory, and counts its bytes on the barrier; out-of-range elements read 0.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const void* tensor_map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes: the copy
// engine loads `bytes` contiguous bytes (a multiple of 16, both addresses
// 16-byte aligned) into shared memory and counts them on the barrier.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// createpolicy.fractional.L2::evict_first: a cache policy under which the
// lines a load brings into L2 go first when L2 needs room (data read once).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint:
// tma_load_4d's five-dimensional form, under an L2 cache policy
// (evict_first_policy).
__device__ __forceinline__ void tma_load_5d(void* smem_dst, const void* tensor_map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3, int c4, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
      "{%2, %3, %4, %5, %6}], [%7], %8;\n" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_addr(bar)),
      "l"(policy)
      : "memory");
}

// cp.async.bulk.tensor.4d.global.shared::cta.bulk_group: the copy engine
// stores a box from shared memory at coordinates (c0, c1, c2, c3) of the tensor
// map; elements outside the tensor are not written. Completion is tracked by
// bulk groups (bulk_commit_group, bulk_wait_group_read).
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: the copy engine
// adds `bytes` (a multiple of 16) of floats from shared memory to global memory
// (both 16-byte aligned), element by element; completion is tracked by bulk
// groups (bulk_commit_group, bulk_wait_group_read, bulk_wait_group).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

// cp.async.bulk.commit_group: close the group of bulk copies issued so far.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// cp.async.bulk.wait_group.read kPending: wait until all but the kPending most
// recent bulk groups have finished reading their shared-memory sources (which
// may then be overwritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// cp.async.bulk.wait_group kPending: wait until all but the kPending most
// recent bulk groups have completed (their writes made).
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// fence.proxy.async.global: orders this thread's global-memory accesses
// through the copy engine (bulk copies and reductions) with its ordinary ones,
// both ways (a bulk reduction completed before a release, an acquire before a
// bulk reduction).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ld.acquire.gpu.global.s32: a load after which this thread's later memory
// accesses see what the writer released before its store (red_release_add).
__device__ __forceinline__ int load_acquire(const int* address) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// red.release.gpu.global.add.s32: adds `value` once this thread's earlier
// memory accesses are visible to the GPU.
__device__ __forceinline__ void red_release_add(int* address, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(address), "r"(value) : "memory");
}

// prefetch.tensormap: fetch a tensor map into the cache before its first use.
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// setmaxnreg.{inc,dec}.sync.aligned.u32: the warpgroup's registers per thread
// grow or shrink to kRegs (a multiple of 8 in [24, 256]).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// bar.sync id, threads: wait at named barrier id until `threads` threads
// (a multiple of 32) have arrived or synced there.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// bar.arrive id, threads: count this warp at named barrier id without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// wgmma.fence.sync.aligned: orders this warpgroup's register writes before the
// wgmma that reads them (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// wgmma.commit_group.sync.aligned: close the group of wgmma issued so far.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// wgmma.wait_group.sync.aligned N: wait until at most N groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of x across an asynchronous
// wgmma that owns it (no instruction).
__device__ __forceinline__ void fence_register(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_register(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}, A and B
// from shared memory (descriptors): D = A B (+ D if accumulate) for a
// warpgroup, D 64 x N in float, N / 2 registers a thread laid out as mma.sync's
// 16 x 8 accumulator tiles: d[4j..4j+3] is tile j (columns 8j..8j+7) of the
// thread's warp's 16 rows. kTransA / kTransB: the operand is stored M- / N-major
// (transposed) instead of K-major.
template <typename Elem, int N, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate);

// The same with A from registers (4 a thread, laid out as mma.sync's m16n8k16
// A fragment for the warp's 16 rows); B as in wgmma_ss.
template <typename Elem, int N, int kTransB = 0>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate);

#define FLASHATTN_WGMMA_ACC8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLASHATTN_WGMMA_ACC16 FLASHATTN_WGMMA_ACC8(0), FLASHATTN_WGMMA_ACC8(8)
#define FLASHATTN_WGMMA_ACC24 FLASHATTN_WGMMA_ACC16, FLASHATTN_WGMMA_ACC8(16)
#define FLASHATTN_WGMMA_ACC32 FLASHATTN_WGMMA_ACC16, FLASHATTN_WGMMA_ACC8(16), FLASHATTN_WGMMA_ACC8(24)
#define FLASHATTN_WGMMA_ACC40 FLASHATTN_WGMMA_ACC32, FLASHATTN_WGMMA_ACC8(32)
#define FLASHATTN_WGMMA_ACC64                                                                                   \
  FLASHATTN_WGMMA_ACC32, FLASHATTN_WGMMA_ACC8(32), FLASHATTN_WGMMA_ACC8(40), FLASHATTN_WGMMA_ACC8(48), \
      FLASHATTN_WGMMA_ACC8(56)
#define FLASHATTN_WGMMA_ACC88 \
  FLASHATTN_WGMMA_ACC64, FLASHATTN_WGMMA_ACC8(64), FLASHATTN_WGMMA_ACC8(72), FLASHATTN_WGMMA_ACC8(80)
#define FLASHATTN_WGMMA_ACC96 FLASHATTN_WGMMA_ACC88, FLASHATTN_WGMMA_ACC8(88)
#define FLASHATTN_WGMMA_ACC128                                                                                 \
  FLASHATTN_WGMMA_ACC64, FLASHATTN_WGMMA_ACC8(64), FLASHATTN_WGMMA_ACC8(72), FLASHATTN_WGMMA_ACC8(80),          \
      FLASHATTN_WGMMA_ACC8(88), FLASHATTN_WGMMA_ACC8(96), FLASHATTN_WGMMA_ACC8(104), FLASHATTN_WGMMA_ACC8(112), \
      FLASHATTN_WGMMA_ACC8(120)
#define FLASHATTN_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FLASHATTN_WGMMA_D24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}"
#define FLASHATTN_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASHATTN_WGMMA_D40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FLASHATTN_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

#define FLASHATTN_WGMMA_D88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define FLASHATTN_WGMMA_D96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define FLASHATTN_WGMMA_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// One specialization of wgmma_ss and wgmma_rs per (element type, N); the
// operands after the N / 2 accumulators are numbered from N / 2 (written out:
// A0 = N / 2, A1 = N / 2 + 1, ...).
#define FLASHATTN_WGMMA(ELEM, TYPE, N, D_REGS, ACC, A0, A1, A2, A3, A4, A5, A6)                                  \
  template <int kTransA, int kTransB>                                                                            \
  struct WgmmaSS<ELEM, N, kTransA, kTransB> {                                                                    \
    static __device__ __forceinline__ void run(float(&d)[N / 2], uint64_t desc_a, uint64_t desc_b,               \
                                               bool accumulate) {                                                \
      asm volatile(                                                                                              \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" A2 ", 0;\n"                                                       \
          "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D_REGS ", %" A0 ", %" A1          \
          ", p, 1, 1, %" A3 ", %" A4 ";\n}\n"                                                                    \
          : ACC                                                                                                  \
          : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));                         \
    }                                                                                                            \
  };                                                                                                             \
  template <int kTransB>                                                                                         \
  struct WgmmaRS<ELEM, N, kTransB> {                                                                             \
    static __device__ __forceinline__ void run(float(&d)[N / 2], const uint32_t(&a)[4], uint64_t desc_b,         \
                                               bool accumulate) {                                                \
      asm volatile(                                                                                              \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" A5 ", 0;\n"                                                       \
          "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D_REGS ", {%" A0 ", %" A1 ", %" A2 \
          ", %" A3 "}, %" A4 ", p, 1, 1, %" A6 ";\n}\n"                                                          \
          : ACC                                                                                                  \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB));        \
    }                                                                                                            \
  };

// (A class template per form, since function templates cannot be partially specialized.)
template <typename Elem, int N, int kTransA, int kTransB>
struct WgmmaSS;
template <typename Elem, int N, int kTransB>
struct WgmmaRS;

// wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3 (Elem __nv_fp8_e4m3): a
// k32 step, both operands K-major (8-bit wgmma has no transpose), so the
// forms take no transpose immediates; the A fragment is 4 registers of 4
// bytes (a0: row lane / 4, k 4 (lane % 4) .. + 3, byte i the k-th + i; a1:
// row + 8; a2, a3: the same at k + 16).
#define FLASHATTN_WGMMA_E4M3(N, D_REGS, ACC, A0, A1, A2, A3, A4, A5)                                             \
  template <>                                                                                                    \
  struct WgmmaSS<__nv_fp8_e4m3, N, 0, 0> {                                                                       \
    static __device__ __forceinline__ void run(float(&d)[N / 2], uint64_t desc_a, uint64_t desc_b,               \
                                               bool accumulate) {                                                \
      asm volatile(                                                                                              \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" A2 ", 0;\n"                                                       \
          "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " D_REGS ", %" A0 ", %" A1 ", p, 1, 1;\n}\n"  \
          : ACC                                                                                                  \
          : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));                                                     \
    }                                                                                                            \
  };                                                                                                             \
  template <>                                                                                                    \
  struct WgmmaRS<__nv_fp8_e4m3, N, 0> {                                                                          \
    static __device__ __forceinline__ void run(float(&d)[N / 2], const uint32_t(&a)[4], uint64_t desc_b,         \
                                               bool accumulate) {                                                \
      asm volatile(                                                                                              \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %" A5 ", 0;\n"                                                       \
          "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " D_REGS ", {%" A0 ", %" A1 ", %" A2         \
          ", %" A3 "}, %" A4 ", p, 1, 1;\n}\n"                                                                    \
          : ACC                                                                                                  \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));                      \
    }                                                                                                            \
  };

FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 32, FLASHATTN_WGMMA_D16, FLASHATTN_WGMMA_ACC16, "16", "17", "18", "19", "20", "21", "22")
FLASHATTN_WGMMA(__half, "f16", 32, FLASHATTN_WGMMA_D16, FLASHATTN_WGMMA_ACC16, "16", "17", "18", "19", "20", "21", "22")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 48, FLASHATTN_WGMMA_D24, FLASHATTN_WGMMA_ACC24, "24", "25", "26", "27", "28", "29", "30")
FLASHATTN_WGMMA(__half, "f16", 48, FLASHATTN_WGMMA_D24, FLASHATTN_WGMMA_ACC24, "24", "25", "26", "27", "28", "29", "30")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 64, FLASHATTN_WGMMA_D32, FLASHATTN_WGMMA_ACC32, "32", "33", "34", "35", "36", "37", "38")
FLASHATTN_WGMMA(__half, "f16", 64, FLASHATTN_WGMMA_D32, FLASHATTN_WGMMA_ACC32, "32", "33", "34", "35", "36", "37", "38")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 80, FLASHATTN_WGMMA_D40, FLASHATTN_WGMMA_ACC40, "40", "41", "42", "43", "44", "45", "46")
FLASHATTN_WGMMA(__half, "f16", 80, FLASHATTN_WGMMA_D40, FLASHATTN_WGMMA_ACC40, "40", "41", "42", "43", "44", "45", "46")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 128, FLASHATTN_WGMMA_D64, FLASHATTN_WGMMA_ACC64, "64", "65", "66", "67", "68", "69", "70")
FLASHATTN_WGMMA(__half, "f16", 128, FLASHATTN_WGMMA_D64, FLASHATTN_WGMMA_ACC64, "64", "65", "66", "67", "68", "69", "70")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 176, FLASHATTN_WGMMA_D88, FLASHATTN_WGMMA_ACC88, "88", "89", "90", "91", "92", "93", "94")
FLASHATTN_WGMMA(__half, "f16", 176, FLASHATTN_WGMMA_D88, FLASHATTN_WGMMA_ACC88, "88", "89", "90", "91", "92", "93", "94")
FLASHATTN_WGMMA(__nv_bfloat16, "bf16", 256, FLASHATTN_WGMMA_D128, FLASHATTN_WGMMA_ACC128, "128", "129", "130", "131", "132", "133", "134")
FLASHATTN_WGMMA(__half, "f16", 256, FLASHATTN_WGMMA_D128, FLASHATTN_WGMMA_ACC128, "128", "129", "130", "131", "132", "133", "134")
FLASHATTN_WGMMA_E4M3(128, FLASHATTN_WGMMA_D64, FLASHATTN_WGMMA_ACC64, "64", "65", "66", "67", "68", "69")
FLASHATTN_WGMMA_E4M3(192, FLASHATTN_WGMMA_D96, FLASHATTN_WGMMA_ACC96, "96", "97", "98", "99", "100", "101")

#undef FLASHATTN_WGMMA_E4M3

#undef FLASHATTN_WGMMA
#undef FLASHATTN_WGMMA_D16
#undef FLASHATTN_WGMMA_D32
#undef FLASHATTN_WGMMA_D24
#undef FLASHATTN_WGMMA_D64
#undef FLASHATTN_WGMMA_D88
#undef FLASHATTN_WGMMA_D96
#undef FLASHATTN_WGMMA_D128
#undef FLASHATTN_WGMMA_D40
#undef FLASHATTN_WGMMA_ACC128
#undef FLASHATTN_WGMMA_ACC88
#undef FLASHATTN_WGMMA_ACC96
#undef FLASHATTN_WGMMA_ACC64
#undef FLASHATTN_WGMMA_ACC32
#undef FLASHATTN_WGMMA_ACC40
#undef FLASHATTN_WGMMA_ACC24
#undef FLASHATTN_WGMMA_ACC16
#undef FLASHATTN_WGMMA_ACC8

template <typename Elem, int N, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  WgmmaSS<Elem, N, kTransA, kTransB>::run(d, desc_a, desc_b, accumulate);
}
template <typename Elem, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  WgmmaRS<Elem, N, kTransB>::run(d, a, desc_b, accumulate);
}

// fence.proxy.async.shared::cta: this thread's ordinary shared-memory writes
// become visible to the asynchronous units (wgmma, the copy engine); then a
// barrier orders them before another thread's wgmma.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace flashattn_ext::cuda::ptx
