// The Hopper forward's instantiations at head dim 256 (head dims 129 to 256,
// zero-padded), without an attn_mask: a translation unit of their own, so that
// they compile in parallel with the rest.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::forward_kernel {

bool launch_hdim256_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    // (80-key tiles, causal or not: one kernel for both. Softcap, ALiBi: no dropout.)
    dispatch_flag(params.problem.has_window(), [&](auto window) {
      constexpr bool kWindow = decltype(window)::value;
      if (params.problem.softcap > 0.0) {
        launched = launch_forward<Elem, 256, true, false, MaskKind::kNone, kWindow, true>(params, stream);
        return;
      }
      if (params.problem.alibi_slopes != nullptr) {  // (no dropout)
        launched = launch_forward<Elem, 256, true, false, MaskKind::kNone, kWindow, false, true>(params, stream);
        return;
      }
      dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
        constexpr bool kDropout = decltype(dropout)::value;
        launched = launch_forward<Elem, 256, true, kDropout, MaskKind::kNone, kWindow>(params, stream);
      });
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::forward_kernel
