// The Hopper forward's entry point: which calls it covers, and the kernel's
// instantiations without an attn_mask at head dims up to 128
// (flash_fwd_sm90.cuh has the kernel; flash_fwd_sm90_masked.cu the
// instantiations with a mask, flash_fwd_sm90_hdim256.cu those of head dim 256,
// flash_fwd_sm90_mla.cu those of values of another head dim,
// flash_fwd_sm90_varlen.cu those of a packed batch).
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90 {

bool forward_covers(const FwdParams& params) {
  const AttentionProblem& p = params.problem;
  const bool masked = params.mask_kind != MaskKind::kNone;
  // Head dims up to 256, up to 128 with a mask (no room for its tiles at 256);
  // softcap, and ALiBi, without a mask or dropout (and not both); a packed
  // batch with none of them (a sliding window is fine).
  const bool plain = !masked && params.dropout.p == 0.0;
  const bool varlen_covered =
      !params.packed.present() || (plain && p.softcap == 0.0 && p.alibi_slopes == nullptr);
  return varlen_covered && values_head_dim_covered(params) && !(p.softcap > 0.0 && !plain) &&
         !(p.alibi_slopes != nullptr && !(plain && p.softcap == 0.0)) && p.scale > 0.0 &&
         p.head_dim <= (masked ? 128 : 256) && p.len_q > 0 && p.len_k > 0 && p.heads_q > 0 && p.batch > 0;
}

bool attention_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  if (params.tile_counter == nullptr || !forward_covers(params)) return false;
  if (params.mask_kind != MaskKind::kNone) return forward_kernel::launch_masked_forward(params, type, stream);
  if (params.packed.present()) return forward_kernel::launch_varlen_forward(params, type, stream);
  const AttentionProblem& p = params.problem;
  if (p.head_dim_v != p.head_dim) return forward_kernel::launch_mla_forward(params, type, stream);
  if (p.head_dim > 128) return forward_kernel::launch_hdim256_forward(params, type, stream);
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    // Softcap or ALiBi (not both, no dropout: forward_covers): the causal
    // calls' 128-key tiles, as a window's.
    if (p.softcap > 0.0 || p.alibi_slopes != nullptr) {
      dispatch_flag(p.has_window(), [&](auto window) {
        dispatch_flag(p.alibi_slopes != nullptr, [&](auto alibi) {
          constexpr bool kWindow = decltype(window)::value, kAlibi = decltype(alibi)::value, kSoftcap = !kAlibi;
          constexpr MaskKind kNone = MaskKind::kNone;
          using forward_kernel::launch_forward;
          launched = p.head_dim <= 64
                         ? launch_forward<Elem, 64, true, false, kNone, kWindow, kSoftcap, kAlibi>(params, stream)
                         : launch_forward<Elem, 128, true, false, kNone, kWindow, kSoftcap, kAlibi>(params, stream);
        });
      });
      return;
    }
    dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
      constexpr bool kDropout = decltype(dropout)::value;
      constexpr MaskKind kNone = MaskKind::kNone;
      if (p.has_window()) {  // the causal calls' 128-key tiles: the window's edges cross them as the diagonal does
        launched = p.head_dim <= 64
                       ? forward_kernel::launch_forward<Elem, 64, true, kDropout, kNone, true>(params, stream)
                       : forward_kernel::launch_forward<Elem, 128, true, kDropout, kNone, true>(params, stream);
        return;
      }
      dispatch_flag(p.is_causal, [&](auto causal) {
        constexpr bool kCausal = decltype(causal)::value;
        launched = p.head_dim <= 64 ? forward_kernel::launch_forward<Elem, 64, kCausal, kDropout, kNone>(params, stream)
                                    : forward_kernel::launch_forward<Elem, 128, kCausal, kDropout, kNone>(params, stream);
      });
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90
