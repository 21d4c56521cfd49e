// The Hopper forward's instantiations for a packed batch (varlen: sequences of
// different lengths in one launch, without an attn_mask, dropout, softcap or
// ALiBi): a translation unit of their own, so that they compile in parallel
// with the rest; and the order of their tiles.
#include <algorithm>
#include <numeric>

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

std::vector<int32_t> varlen_tile_order(const AttentionProblem& p, const std::vector<int64_t>& starts_q,
                                       const std::vector<int64_t>& starts_k) {
  // The tiles' rows: kBlockM of the kernel that runs the call (it depends on the head dim alone).
  const int64_t rows = p.head_dim <= 64 ? FwdTileConfig<64, 128, 0>::kBlockM : FwdTileConfig<128, 128, 0>::kBlockM;
  // A tile's work: the keys its rows see, plus its fixed costs (Q's load, the
  // output's store) counted as a key tile's.
  constexpr int64_t kTileCostKeys = 128;
  struct Pair {
    int32_t sequence, block;
    int64_t cost, sequence_cost;
  };
  std::vector<Pair> pairs;
  for (size_t b = 0; b + 1 < starts_q.size(); ++b) {
    const int64_t len_q = starts_q[b + 1] - starts_q[b], len_k = starts_k[b + 1] - starts_k[b];
    const Visibility seen(p, len_q, len_k);
    const size_t first = pairs.size();
    int64_t sequence_cost = 0;
    for (int64_t row0 = 0; row0 < len_q; row0 += rows) {
      const int64_t keys = std::max<int64_t>(0, seen.key_end(std::min(len_q, row0 + rows) - 1) - seen.key_begin(row0));
      pairs.push_back({static_cast<int32_t>(b), static_cast<int32_t>(row0 / rows), keys + kTileCostKeys, 0});
      sequence_cost += keys + kTileCostKeys;
    }
    for (size_t i = first; i < pairs.size(); ++i) pairs[i].sequence_cost = sequence_cost;
  }
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& a, const Pair& b) {
    return a.sequence_cost != b.sequence_cost ? a.sequence_cost > b.sequence_cost
                                              : a.sequence != b.sequence ? a.sequence < b.sequence : a.cost > b.cost;
  });
  std::vector<int32_t> order;
  order.reserve(2 * pairs.size());
  for (const Pair& pair : pairs) {
    order.push_back(pair.sequence);
    order.push_back(pair.block);
  }
  return order;
}

}  // namespace flashattn_ext::cuda::sm90
