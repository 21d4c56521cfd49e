// Tiled flash-attention kernels for the CPU. Element type T is double, float,
// c10::Half or c10::BFloat16; half types accumulate in float.
#pragma once

#include "flash_params.h"

namespace flashattn_ext::cpu {

template <typename T>
void attention_forward(const FwdParams& params);

template <typename T>
void attention_backward(const BwdParams& params);

// Fills mask (contiguous (batch, heads, rows, len_k)) with the keep decisions of dropout.
void dropout_mask(const DropoutMaskShape& shape, const DropoutParams& dropout, bool* mask);

}  // namespace flashattn_ext::cpu
