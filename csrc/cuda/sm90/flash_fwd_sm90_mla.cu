// The Hopper forward's instantiations for values of another head dim than the
// queries': MLA's prefill, queries and keys of head dim 192 (136 to 192,
// zero-padded) with values of 128 (72 to 128), without an attn_mask, dropout,
// softcap, ALiBi or a packed batch (forward_covers). A translation unit of its
// own, so that it compiles in parallel with the rest.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::forward_kernel {

bool launch_mla_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    // (128-key tiles, causal or not: one kernel for both.)
    dispatch_flag(params.problem.has_window(), [&](auto window) {
      constexpr bool kWindow = decltype(window)::value;
      launched = launch_forward<Elem, 192, true, false, MaskKind::kNone, kWindow, false, false, false, 128>(params,
                                                                                                         stream);
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::forward_kernel
