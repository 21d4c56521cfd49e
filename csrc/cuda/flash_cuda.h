// Entry points of the CUDA kernels, called by the torch glue in ops_cuda.cpp.
// No torch headers: the params structs carry everything.
#pragma once

#include <cuda_runtime.h>

#include "flash_params.h"

namespace flashattn_ext::cuda {

enum class ElementType { kFloat16, kBFloat16 };

// The largest head dim the kernels take; it must be a multiple of 8.
constexpr int kMaxHeadDim = 256;

void attention_forward(const FwdParams& params, ElementType type, cudaStream_t stream);

// Computes delta, then dK and dV (one pass over key blocks) and dQ (one pass
// over query blocks): deterministic, and without a float32 dQ accumulator.
void attention_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace flashattn_ext::cuda
