// The Hopper backward's entry point at head dims up to 256: which calls it
// covers (and which in deterministic mode), the chunks of (batch, key/value
// head) pairs, and the kernel's instantiations without an attn_mask at head
// dims up to 128
// (flash_bwd_sm90_kernel.cuh has the kernel; flash_bwd_sm90_masked.cu the
// instantiations with a mask, flash_bwd_sm90_hdim256.cu head dim 256,
// flash_bwd_sm90_mla.cu MLA's 192 / 128).
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_bwd_sm90_kernel.cuh"

namespace flashattn_ext::cuda::sm90 {

bool backward_covers(const BwdParams& params) {
  const AttentionProblem& p = params.problem;
  // With an attn_mask: head dims up to 128, and no gradient of the mask.
  const bool masked = params.mask_kind != MaskKind::kNone;
  // Softcap: no mask, no dropout.
  const bool softcap_covered = !(p.softcap > 0.0) || (!masked && params.dropout.p == 0.0);
  // ALiBi: no mask, dropout or softcap.
  const bool alibi_covered = p.alibi_slopes == nullptr || (!masked && params.dropout.p == 0.0 && p.softcap == 0.0);
  // A packed batch: head dims up to 128, none of the above but a window.
  const bool varlen_covered = !params.packed.present() || (p.head_dim <= 128 && !masked && params.dropout.p == 0.0 &&
                                                           p.softcap == 0.0 && p.alibi_slopes == nullptr);
  return values_head_dim_covered(params) && softcap_covered && alibi_covered && varlen_covered && p.len_q > 0 &&
         p.len_k > 0 && p.heads_q > 0 && p.batch > 0 && !(masked && (p.head_dim > 128 || params.dmask.data != nullptr));
}

bool deterministic_backward_covers(const BwdParams& params) {
  const AttentionProblem& p = params.problem;
  const int64_t key_blocks = ceil_div(p.len_k, BwdTileConfig<128>::kBlockN);  // (the same at head dim 64)
  // (DqAddOrder's ranks in 32 bits: query tiles times key blocks.)
  const int64_t rank_products = ceil_div(p.len_q, int64_t{64}) * (key_blocks + 1);
  return backward_covers(params) && p.head_dim <= 128 && params.mask_kind == MaskKind::kNone && !p.has_window() &&
         !params.packed.present() && (p.is_causal || key_blocks <= multiprocessor_count()) &&
         rank_products <= int64_t{UINT32_MAX};
}

int deterministic_head_splits(const AttentionProblem& p) {
  const int group = static_cast<int>(p.heads_q / p.heads_kv);
  if (!p.is_causal || group == 1 || p.head_dim != p.head_dim_v) return 1;
  // The group's smallest factor of 2 or 3: at GQA 32:8 (H200) two splits ran
  // at 0.89x the default backward, four at 0.88x (twice the partials'
  // traffic), one at 0.80x.
  for (int splits : {2, 3}) {
    if (group % splits == 0) return splits;
  }
  return 1;
}

int64_t key_grad_partial_floats(const AttentionProblem& p, int splits) {
  return int64_t{splits} * 2 * p.batch * p.heads_kv * p.len_k * p.head_dim;
}

namespace {

constexpr int kPartialSumRows = 8;  // a warp a key row, four columns a lane: head dims up to 128

// dk and dv = the sum of their head_splits float32 partials
// (BwdParams::key_grad_partials), in split order, rounded.
template <typename Elem>
__global__ void __launch_bounds__(kPartialSumRows * kWarpSize) sum_key_grad_partials_kernel(const BwdParams params) {
  const AttentionProblem& p = params.problem;
  const int64_t rows = p.batch * p.heads_kv * p.len_k;  // of dk (and of dv)
  const int64_t row = int64_t{blockIdx.x} * kPartialSumRows + threadIdx.x / kWarpSize;
  const int col = threadIdx.x % kWarpSize * 4;
  if (row >= 2 * rows || col >= p.head_dim) return;
  const int64_t which = row / rows, at = row % rows;  // which: 0 dk, 1 dv
  const float* partial = params.key_grad_partials + (which * rows + at) * p.head_dim + col;
  const int64_t split_floats = 2 * rows * p.head_dim;
  float4 sum = *reinterpret_cast<const float4*>(partial);
  for (int split = 1; split < params.head_splits; ++split) {
    const float4 part = *reinterpret_cast<const float4*>(partial + split * split_floats);
    sum.x += part.x;
    sum.y += part.y;
    sum.z += part.z;
    sum.w += part.w;
  }
  const int64_t key = at % p.len_k, pair = at / p.len_k;
  const TensorView4d& dst = which == 0 ? params.dk : params.dv;
  Elem* out = head_ptr<Elem>(dst, pair / p.heads_kv, pair % p.heads_kv) + key * dst.stride_row + col;
  *reinterpret_cast<uint2*>(out) = make_uint2(ptx::pack2<Elem>(sum.x, sum.y), ptx::pack2<Elem>(sum.z, sum.w));
}

}  // namespace

void sum_key_grad_partials(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  const int64_t rows = 2 * p.batch * p.heads_kv * p.len_k;
  dispatch_element_type(type, [&](auto elem) {
    launch_kernel(sum_key_grad_partials_kernel<decltype(elem)>, ceil_div(rows, int64_t{kPartialSumRows}),
                  kPartialSumRows * kWarpSize, 0, params, stream);
  });
}

int64_t dq_semaphore_ints(const AttentionProblem& p, int64_t pairs) {
  constexpr int64_t kSmallestBlockM = BwdTileConfig<128>::kBlockM;
  static_assert(kSmallestBlockM <= BwdTileConfig<64>::kBlockM, "the smallest query tile");
  return pairs * (p.heads_q / p.heads_kv) * ceil_div(p.len_q, kSmallestBlockM);
}

int64_t backward_chunk_pairs(const AttentionProblem& p) {
  const int64_t pairs = p.batch * p.heads_kv;
  if (p.head_dim <= 128 || pairs <= 1) return pairs;
  // A quarter of the pairs, but at least four waves of blocks: each chunk
  // ends with SMs idle as its last blocks finish. Measured on the H100 (bf16,
  // N 2048 to 16384) against one chunk: a quarter of the workspace for up to
  // 3.3% of the time; eighths of at least two waves were 1 to 5% slower, and 25%
  // at N = 8192 causal, whose last chunk of one pair was one wave of unequal
  // blocks. The chunks then take pairs / chunks pairs each, the first few one
  // more (launch_backward_kernel): no more than this many.
  const int64_t blocks_per_pair = ceil_div(p.len_k, BwdSplitTileConfig<256>::kBlockN);
  const int64_t for_waves = ceil_div(4 * int64_t{multiprocessor_count()}, blocks_per_pair);
  const int64_t chunks = ceil_div(pairs, std::min(pairs, std::max(ceil_div(pairs, 4), for_waves)));
  return ceil_div(pairs, chunks);
}

bool attention_backward(const BwdParams& params, ElementType type, cudaStream_t stream) {
  if (params.dq_accum == nullptr || params.dq_accum_pairs != backward_chunk_pairs(params.problem) ||
      !backward_covers(params) || (params.dq_semaphore != nullptr && !deterministic_backward_covers(params))) {
    return false;
  }
  const AttentionProblem& p = params.problem;
  if (p.head_dim_v != p.head_dim) return backward_kernel::launch_mla_backward(params, type, stream);
  if (p.head_dim > 128) return backward_kernel::launch_hdim256_backward(params, type, stream);
  if (params.mask_kind != MaskKind::kNone) return backward_kernel::launch_masked_backward(params, type, stream);
  using backward_kernel::launch_backward;
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    dispatch_flag(p.has_window(), [&](auto window) {
      // Deterministic mode: dQ added in a fixed order (no window or packed batch).
      dispatch_flag(params.dq_semaphore != nullptr, [&](auto ordered) {
        using Elem = decltype(elem);
        constexpr bool kWindow = decltype(window)::value, kOrdered = decltype(ordered)::value;
        constexpr MaskKind kNone = MaskKind::kNone;
        // The kernel of the call's options at its head dim (64 or 128).
        auto launch = [&](auto dropout, auto softcap, auto alibi, auto varlen) {
          constexpr bool kDropout = decltype(dropout)::value, kSoftcap = decltype(softcap)::value;
          constexpr bool kAlibi = decltype(alibi)::value, kVarlen = decltype(varlen)::value;
          launched = p.head_dim <= 64
                         ? launch_backward<Elem, 64, kDropout, kNone, kWindow, kSoftcap, kAlibi, kVarlen, kOrdered>(
                               params, stream)
                         : launch_backward<Elem, 128, kDropout, kNone, kWindow, kSoftcap, kAlibi, kVarlen, kOrdered>(
                               params, stream);
        };
        using std::false_type, std::true_type;
        if constexpr (kWindow && kOrdered) {
          return;
        } else if (params.packed.present()) {
          if constexpr (!kOrdered) launch(false_type{}, false_type{}, false_type{}, true_type{});
        } else if (p.softcap > 0.0) {
          launch(false_type{}, true_type{}, false_type{}, false_type{});
        } else if (p.alibi_slopes != nullptr) {
          launch(false_type{}, false_type{}, true_type{}, false_type{});
        } else {
          dispatch_flag(params.dropout.p > 0.0,
                        [&](auto dropout) { launch(dropout, false_type{}, false_type{}, false_type{}); });
        }
      });
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90
