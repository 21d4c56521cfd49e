// Dropout's random state on the device: the {seed, offset} a call draws, and
// the keep mask itself (for the dropout_mask op and the ATen fallback).
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"

namespace flashattn_ext::cuda {
namespace {

__global__ void write_rng_state_kernel(const PhiloxSource source, int64_t* rng_state) {
  if (source.captured) {
    rng_state[0] = *source.seed_ptr;
    rng_state[1] = static_cast<int64_t>(static_cast<uint64_t>(*source.offset_ptr) + source.offset_intragraph);
  } else {
    rng_state[0] = static_cast<int64_t>(source.seed);
    rng_state[1] = static_cast<int64_t>(source.offset);
  }
  rng_state[2] = source.bits;
}

constexpr int kMaskThreads = 256;

// One thread per (head, query row, key).
__global__ void __launch_bounds__(kMaskThreads) dropout_mask_kernel(const DropoutMaskShape shape,
                                                                   const DropoutParams dropout, bool* mask) {
  const int64_t rows = shape.row_end - shape.row_begin;
  const int64_t index = int64_t(blockIdx.x) * kMaskThreads + threadIdx.x;
  if (index >= shape.batch * shape.heads * rows * shape.len_k) return;
  const int64_t key = index % shape.len_k, query = shape.row_begin + (index / shape.len_k) % rows;
  const int64_t bh = index / (shape.len_k * rows);
  const int bits = dropout_bits_of(dropout.rng_state);
  const uint32_t number = dropout_number(static_cast<uint64_t>(dropout.rng_state[0]),
                                         static_cast<uint64_t>(dropout.rng_state[1]), bits, bh, query, key,
                                         shape.len_q, shape.len_k);
  mask[index] = number >= dropout_threshold(dropout.p, bits);
}

}  // namespace

void write_rng_state(const PhiloxSource& source, int64_t* rng_state, cudaStream_t stream) {
  write_rng_state_kernel<<<1, 1, 0, stream>>>(source, rng_state);
}

void dropout_mask(const DropoutMaskShape& shape, const DropoutParams& dropout, bool* mask, cudaStream_t stream) {
  const int64_t elements = shape.batch * shape.heads * (shape.row_end - shape.row_begin) * shape.len_k;
  if (elements == 0) return;
  dropout_mask_kernel<<<static_cast<unsigned>(ceil_div(elements, kMaskThreads)), kMaskThreads, 0, stream>>>(
      shape, dropout, mask);
}

}  // namespace flashattn_ext::cuda
