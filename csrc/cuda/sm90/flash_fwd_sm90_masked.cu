// The Hopper forward's instantiations with an attn_mask (bool or additive),
// with and without dropout: a translation unit of their own, so that they
// compile in parallel with the rest.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::forward_kernel {

bool launch_masked_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    // (Masked calls take 128-key tiles, causal or not: one kernel for both.)
    dispatch_flag(p.has_window(), [&](auto window) {
      dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
        dispatch_flag(params.mask_kind == MaskKind::kBool, [&](auto bool_mask) {
          constexpr bool kWindow = decltype(window)::value, kDropout = decltype(dropout)::value;
          constexpr MaskKind kMask = decltype(bool_mask)::value ? MaskKind::kBool : MaskKind::kAdditive;
          launched = p.head_dim <= 64 ? launch_forward<Elem, 64, true, kDropout, kMask, kWindow>(params, stream)
                                      : launch_forward<Elem, 128, true, kDropout, kMask, kWindow>(params, stream);
        });
      });
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::forward_kernel
