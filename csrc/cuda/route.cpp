// The routing table of the CUDA ops (route.h).
#include "cuda/route.h"

#include <ATen/cuda/CUDAContext.h>

#include "cuda/flash_cuda.h"
#include "fallback.h"

namespace flashattn_ext::cuda {
namespace {

// Why no hand-written kernel can take a call, or nothing where one can.
std::optional<std::string> kernel_gap(const at::Tensor& q, const AttentionProblem& p) {
  if (fallback_requested()) return std::string("FLASHATTN_EXT_KERNELS=aten asks for the ATen fallback");
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) {
    return c10::str("the CUDA kernels take float16 and bfloat16, not ", q.scalar_type());
  }
  if (p.head_dim % 8 != 0 || p.head_dim > kMaxHeadDim) {
    return c10::str("the CUDA kernels take head dims that are multiples of 8 up to ", kMaxHeadDim, ", not ",
                    p.head_dim);
  }
  if (p.head_dim_v % 8 != 0 || p.head_dim_v > kMaxHeadDim) {
    return c10::str("the CUDA kernels take value head dims that are multiples of 8 up to ", kMaxHeadDim, ", not ",
                    p.head_dim_v);
  }
  return std::nullopt;
}

// Whether a dense forward has a decoding step's shape, which the decode
// kernels take: the query rows of a key/value head (its group's heads times
// the query tokens) fit kDecodeRouteRows, and the call has nothing they lack
// (dropout; an additive mask, or a bool one beside causal, a window or ALiBi;
// a causal mask, window or ALiBi aligned top-left where len_q != len_k,
// since theirs align bottom-right). They read each key/value head's keys once
// for its whole group and split long ones over the SMs (flash-decoding),
// where the dense kernels read them once a query head into mostly empty
// tiles: 2.9x faster for a one-token step of B = 16, GQA 32:8, 4k keys (issue
// 44). A bool mask (transformers' decoding steps with a static cache, or a
// padded batch) is read a pair at a time, and keys past the last one it shows
// are not read (mask_key_extents). The backward needs only out and lse, which
// these kernels give as the dense ones do.
bool takes_decode_kernels(const FwdParams& params) {
  const AttentionProblem& p = params.problem;
  if (kernels_requested("dense")) return false;
  const bool plain = !p.is_causal && !p.has_window() && p.alibi_slopes == nullptr;
  const bool aligned = p.causal_lower_right || p.len_q == p.len_k || plain;
  const bool mask_taken = params.mask_kind == MaskKind::kNone ||
                          (params.mask_kind == MaskKind::kBool && plain &&
                           (params.mask.stride_col == 1 || p.len_k <= 1));
  constexpr int64_t kLimit = int64_t{1} << 31;  // (the decode kernels' 32-bit indices)
  return mask_taken && params.dropout.p == 0.0 && aligned && p.heads_kv > 0 && p.head_dim_v == p.head_dim &&
         p.heads_q / p.heads_kv * p.len_q <= kDecodeRouteRows && p.len_k < kLimit && p.batch < kLimit;
}

// Why a call that the Hopper kernels do not take runs the sm80 ones.
std::string why_not_sm90(const at::Tensor& q, const char* pass) {
  if (kernels_requested("sm80")) return "FLASHATTN_EXT_KERNELS=sm80 asks for the sm80 kernels";
  if (!use_sm90_kernels(q)) return "the Hopper kernels need an H100 / H200 and a build for 9.0a";
  return c10::str("the Hopper ", pass, " does not cover the call (sm90::", pass, "_covers)");
}

// Rows 5 and 6 of the table.
Route without_sm90(const at::Tensor& q, const AttentionProblem& p, const char* pass) {
  if (auto feature = hopper_only_feature(p)) return {Family::kAten, *feature};
  return {Family::kSm80, why_not_sm90(q, pass)};
}

}  // namespace

const char* family_name(Family family) {
  switch (family) {
    case Family::kAten: return "aten";
    case Family::kDecode: return "decode";
    case Family::kSm90: return "sm90";
    case Family::kSm80: return "sm80";
    case Family::kBySequence: return "by_sequence";
  }
  return "unknown";
}

bool use_sm90_kernels(const at::Tensor& q) {
#ifdef FLASHATTN_EXT_HAS_SM90A
  if (kernels_requested("sm80")) return false;
  return at::cuda::getDeviceProperties(q.device().index())->major == 9;
#else
  (void)q;
  return false;
#endif
}

// Which backwards the Hopper kernels take in deterministic mode (sm90::deterministic_backward_covers).
constexpr const char* kDeterministicHopperBackward =
    "in deterministic mode the backward up to head dim 128 and, unless causal, as many blocks of 128 keys as the "
    "GPU has SMs";

std::optional<std::string> hopper_only_feature(const AttentionProblem& p) {
  if (p.head_dim_v != p.head_dim) {
    return c10::str("of the CUDA kernels only the Hopper ones take value head dims other than the query's (an "
                    "H100 or H200: queries and keys of 136 to 192, values of 72 to 128, as MLA's 192 / 128, without "
                    "attn_mask, dropout, softcap, ALiBi or a packed batch; the backward not in deterministic mode), "
                    "not ", p.head_dim_v, " and ", p.head_dim);
  }
  if (p.alibi_slopes != nullptr) {
    return std::string("of the CUDA kernels only the Hopper ones take ALiBi (an H100 or H200, without attn_mask, "
                       "dropout or softcap; ") + kDeterministicHopperBackward + ")";
  }
  if (p.softcap > 0.0) {
    return std::string("of the CUDA kernels only the Hopper ones take softcap (an H100 or H200, without attn_mask "
                       "or dropout; ") + kDeterministicHopperBackward + ")";
  }
  if (p.has_window()) {
    return std::string("of the CUDA kernels only the Hopper ones take a sliding window (an H100 or H200; the "
                       "backward not in deterministic mode)");
  }
  return std::nullopt;
}

Route route_forward(const at::Tensor& q, const FwdParams& params) {
  if (auto gap = kernel_gap(q, params.problem)) return {Family::kAten, *gap};
  if (takes_decode_kernels(params)) {
    return {Family::kDecode, "a decoding step's shape: a key/value head's query rows fit two 16-row tiles"};
  }
  if (use_sm90_kernels(q) && sm90::forward_covers(params)) return {Family::kSm90, "the Hopper forward covers it"};
  return without_sm90(q, params.problem, "forward");
}

Route route_backward(const at::Tensor& q, const BwdParams& params) {
  if (auto gap = kernel_gap(q, params.problem)) return {Family::kAten, *gap};
  if (at::globalContext().deterministicAlgorithms()) {
    if (use_sm90_kernels(q) && sm90::deterministic_backward_covers(params)) {
      return {Family::kSm90, "deterministic mode: the Hopper backward, its key blocks adding dQ in a fixed order"};
    }
    if (auto feature = hopper_only_feature(params.problem)) return {Family::kAten, *feature};
    return {Family::kSm80, "deterministic mode: the sm80 kernels' separate dQ pass"};
  }
  if (use_sm90_kernels(q) && sm90::backward_covers(params)) return {Family::kSm90, "the Hopper backward covers it"};
  return without_sm90(q, params.problem, "backward");
}

Route route_packed_forward(const at::Tensor& q, const FwdParams& params) {
  if (auto gap = kernel_gap(q, params.problem)) return {Family::kBySequence, *gap};
  if (!use_sm90_kernels(q) || !sm90::forward_covers(params)) return {Family::kBySequence, why_not_sm90(q, "forward")};
  return {Family::kSm90, "the Hopper forward covers the packed batch"};
}

Route route_packed_backward(const at::Tensor& q, const BwdParams& params) {
  if (auto gap = kernel_gap(q, params.problem)) return {Family::kBySequence, *gap};
  if (at::globalContext().deterministicAlgorithms()) {
    return {Family::kBySequence, "deterministic mode: the sm80 kernels' separate dQ pass, a sequence at a time"};
  }
  const AttentionProblem& p = params.problem;
  if (!use_sm90_kernels(q) || !sm90::backward_covers(params) || sm90::backward_chunk_pairs(p) != p.batch * p.heads_kv) {
    return {Family::kBySequence, why_not_sm90(q, "backward")};
  }
  return {Family::kSm90, "the Hopper backward covers the packed batch"};
}

}  // namespace flashattn_ext::cuda
