// Tiled flash-attention kernels for the CPU. Element type T is double, float,
// c10::Half or c10::BFloat16; half types accumulate in float.
#pragma once

#include "flash_params.h"

// X(T) for each element type the kernels are built for: their instantiations
// (forward.cpp, backward.cpp, decode.cpp) take the list from here.
#define FLASHATTN_EXT_CPU_FOR_EACH_TYPE(X) X(double) X(float) X(c10::Half) X(c10::BFloat16)

namespace flashattn_ext::cpu {

template <typename T>
void attention_forward(const FwdParams& params);

template <typename T>
void attention_backward(const BwdParams& params);

// One decoding step (see DecodeParams), key_new and value_new written into the
// caches first; cache_seqlens and block_table in host memory, checked.
template <typename T>
void decode_attention(const DecodeParams& params);

// Fills mask (contiguous (batch, heads, rows, len_k)) with the keep decisions of dropout.
void dropout_mask(const DropoutMaskShape& shape, const DropoutParams& dropout, bool* mask);

}  // namespace flashattn_ext::cpu
