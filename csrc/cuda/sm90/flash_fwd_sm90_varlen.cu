// The Hopper forward's instantiations for a packed batch (varlen: sequences of
// different lengths in one launch, without an attn_mask, dropout, softcap or
// ALiBi): a translation unit of their own, so that they compile in parallel
// with the rest.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90::forward_kernel {

bool launch_varlen_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    constexpr MaskKind kNone = MaskKind::kNone;
    // The tile shapes of the dense calls: a window takes the causal calls' (its
    // edges cross the tiles as the diagonal does); head dim 256 has one.
    auto launch = [&](auto head_dim, auto causal, auto window) {
      constexpr int kHeadDim = decltype(head_dim)::value;
      constexpr bool kCausal = decltype(causal)::value, kWindow = decltype(window)::value;
      launched = launch_forward<Elem, kHeadDim, kCausal, false, kNone, kWindow, false, false, true>(params, stream);
    };
    using Dim64 = std::integral_constant<int, 64>;
    using Dim128 = std::integral_constant<int, 128>;
    using Dim256 = std::integral_constant<int, 256>;
    dispatch_flag(p.has_window(), [&](auto window) {
      if (p.head_dim > 128) {
        launch(Dim256{}, std::true_type{}, window);
      } else if constexpr (decltype(window)::value) {
        p.head_dim <= 64 ? launch(Dim64{}, std::true_type{}, window) : launch(Dim128{}, std::true_type{}, window);
      } else {
        dispatch_flag(p.is_causal, [&](auto causal) {
          p.head_dim <= 64 ? launch(Dim64{}, causal, window) : launch(Dim128{}, causal, window);
        });
      }
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90::forward_kernel

namespace flashattn_ext::cuda::sm90 {

int64_t varlen_forward_block_rows(const AttentionProblem& p) {
  // (The tile's rows depend on the head dim alone.)
  static_assert(FwdTileConfig<256, 80, 0>::kBlockM == FwdTileConfig<128, 128, 0>::kBlockM);
  return p.head_dim <= 64 ? FwdTileConfig<64, 128, 0>::kBlockM : FwdTileConfig<128, 128, 0>::kBlockM;
}

}  // namespace flashattn_ext::cuda::sm90
