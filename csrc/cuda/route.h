// The routing table of the CUDA ops: which kernel family takes a call, and
// why. ops_cuda.cpp runs what it says; the kernel_route op lets tests and
// users ask it; the fallback's warning quotes its reason.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "cuda/flash_cuda.h"
#include "flash_params.h"

namespace flashattn_ext::cuda {

enum class Family {
  kAten,        // fallback.cpp's ATen operations (a one-time warning quotes the reason)
  kDecode,      // the decode kernels: sm90/decode_sm90.cu where it takes the call, else sm80/decode.cu
  kSm90,        // the Hopper kernels (sm90/)
  kSm80,        // the mma.sync kernels (sm80/)
  kBySequence,  // a packed batch as one dense call a sequence, each routed as such
};

// "aten", "decode", "sm90", "sm80", "by_sequence".
const char* family_name(Family family);

struct Route {
  Family family;
  std::string reason;
};

// A dense call's forward (FwdParams from prepare_forward) and backward
// (BwdParams from prepare_backward, dq_accum unset), in this order:
//   1. the ATen fallback where the kernels lack the call's dtype or head dims,
//      or FLASHATTN_EXT_KERNELS=aten asks for it;
//   2. (forward) the decode kernels for a decoding step's shape: the query
//      rows of a key/value head fit two 16-row tiles, no dropout, no mask or
//      a bool one alone, the diagonal aligned bottom-right where it matters
//      (FLASHATTN_EXT_KERNELS=dense turns this row off, for comparisons);
//   3. (backward) in deterministic mode, the Hopper kernel where
//      sm90::deterministic_backward_covers, else rows 5 and 6 with the sm80
//      kernels' separate dQ pass;
//   4. the Hopper kernels on an H100 / H200 where they cover the call
//      (sm90::forward_covers, sm90::backward_covers), unless
//      FLASHATTN_EXT_KERNELS=sm80;
//   5. the ATen fallback for a window, softcap, ALiBi or values of another
//      head dim than the queries', which only the Hopper kernels take;
//   6. the sm80 kernels.
// A Hopper kernel may still refuse at launch tensors the copy engine cannot
// address; the call then runs row 5 or 6.
Route route_forward(const at::Tensor& q, const FwdParams& params);
Route route_backward(const at::Tensor& q, const BwdParams& params);

// A packed batch (varlen; the params of packed_forward_params and
// packed_backward_params, nothing allocated yet): the Hopper kernels take it
// whole (kSm90) where they cover it (the backward with a dq_accum for all its
// pairs, not in deterministic mode), else one dense call a sequence
// (kBySequence).
Route route_packed_forward(const at::Tensor& q, const FwdParams& params);
Route route_packed_backward(const at::Tensor& q, const BwdParams& params);

// Whether q's GPU runs the Hopper kernels: compute capability 9.0, a build
// with the 9.0a target, and not turned off with FLASHATTN_EXT_KERNELS=sm80
// (read at every call, so tests and benchmarks can compare the families).
bool use_sm90_kernels(const at::Tensor& q);

// What only the Hopper kernels take (a window, softcap, ALiBi), as the
// reason to give where they do not take the call; nothing otherwise.
std::optional<std::string> hopper_only_feature(const AttentionProblem& p);

// The kernels' element type for a 16-bit tensor (the routes above send them
// float16 and bfloat16 only).
inline ElementType element_type(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16;
}

}  // namespace flashattn_ext::cuda
