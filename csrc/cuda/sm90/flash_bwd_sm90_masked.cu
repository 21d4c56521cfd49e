// The Hopper backward's instantiations with an attn_mask (bool or additive),
// with and without dropout: a translation unit of their own, so that they
// compile in parallel with the rest.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_bwd_sm90_kernel.cuh"

namespace flashattn_ext::cuda::sm90::backward_kernel {

bool launch_masked_backward(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_flag(p.has_window(), [&](auto window) {
      dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
        dispatch_flag(params.mask_kind == MaskKind::kBool, [&](auto bool_mask) {
          using Elem = decltype(elem);
          constexpr bool kWindow = decltype(window)::value, kDropout = decltype(dropout)::value;
          constexpr MaskKind kMask = decltype(bool_mask)::value ? MaskKind::kBool : MaskKind::kAdditive;
          launched = p.head_dim <= 64 ? launch_backward<Elem, 64, kDropout, kMask, kWindow>(params, stream)
                                      : launch_backward<Elem, 128, kDropout, kMask, kWindow>(params, stream);
        });
      });
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::backward_kernel
