// Decoding on Hopper, the host side: which calls the kernel takes, their
// split into work items over the SMs, and the launch. The kernel and its
// tile config: decode_sm90_kernel.cuh.
#include <algorithm>

#include "cuda/decode_common.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/sm90/decode_sm90_kernel.cuh"
#include "cuda/sm90/descriptors.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace {

using namespace decode_kernel_code;

// The kernel's launch, or false where it does not take the call.
template <typename Cfg>
bool prepare_launch(const DecodeParams& params, ElementType type, DecodeKernelParams& kp) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  const AttentionProblem& p = params.problem;
  const bool paged = params.block_table.data != nullptr;
  // (The merge writes 4 columns of out at once: 8 bytes, aligned where the
  // out the glue allocates is.)
  const TensorView4d& out = params.out;
  const bool out_rows_aligned = reinterpret_cast<uintptr_t>(out.data) % 8 == 0 && out.stride_col == 1 &&
                                out.stride_batch % 4 == 0 && out.stride_head % 4 == 0 && out.stride_row % 4 == 0;
  if (params.k_cache.stride_col != 1 || params.v_cache.stride_col != 1 || !out_rows_aligned) return false;
  // A copy walks the nearer of heads and rows in memory first (a paged
  // cache's heads, a contiguous (batch, heads, keys, dim) cache's rows).
  kp.heads_inner = params.k_cache.stride_head < params.k_cache.stride_row;
  if (kp.heads_inner != (params.v_cache.stride_head < params.v_cache.stride_row)) return false;
  // Key/value heads an item takes: a power of two dividing them whose query
  // rows fit the item's (Cfg::kRows). Where a cache row holds the heads side
  // by side, the most (one copy reads their rows together) that leave units
  // enough to cover the SMs in chunks (at B = 1, 8 key heads and 8k keys, 8
  // units of one head in 16 chunks, not 2 units of 4 heads, which left 100
  // SMs idle: 1.3x the time); where each head's rows lie apart, the fewest
  // whose box fills the swizzle's 8 lines (each head's keys then one stream:
  // at 8k-32k keys, B = 64, 8 key heads, 0.2-0.6% faster on an H100 and
  // 1-1.6% on an H200).
  const int64_t rows_per_head = p.heads_q / p.heads_kv * p.len_q;
  const int64_t sms = multiprocessor_count(), most_chunks = std::max<int64_t>(p.len_k / kMinKeysPerChunk, 1);
  const int64_t block_size = paged ? params.block_size : Cfg::kBlockN;  // (a contiguous cache's tile: one box)
  auto box_rows = [&](int heads_log2) { return std::min(block_size, int64_t{Cfg::kBlockN >> heads_log2}); };
  auto box_fills_swizzle = [&](int heads_log2) { return (box_rows(heads_log2) << heads_log2) * Cfg::kColBlocks >= 8; };
  kp.heads_log2 = 0;
  while (p.heads_kv % (int64_t{2} << kp.heads_log2) == 0 && rows_per_head << (kp.heads_log2 + 1) <= Cfg::kRows &&
         (kp.heads_inner ? p.batch * (p.heads_kv >> (kp.heads_log2 + 1)) * most_chunks >= sms
                         : !box_fills_swizzle(kp.heads_log2))) {
    ++kp.heads_log2;
  }
  // A paged cache's blocks tile the tile or the other way round, and each copy
  // starts a 1024-byte period of the swizzle.
  const int64_t tile_keys = Cfg::kBlockN >> kp.heads_log2;
  kp.box_rows = static_cast<int>(box_rows(kp.heads_log2));
  if ((tile_keys % block_size != 0 && block_size % tile_keys != 0) || !box_fills_swizzle(kp.heads_log2)) {
    return false;
  }
  kp.call = params;
  const CacheElement element = Cfg::kFp8Cache                  ? CacheElement::kE4M3
                               : type == ElementType::kBFloat16 ? CacheElement::kBFloat16
                                                                : CacheElement::kFloat16;
  const int64_t rows = paged ? params.block_size : p.len_k, outer = paged ? params.num_blocks : p.batch;
  for (auto [map, cache] : {std::pair{&kp.k_map, &params.k_cache}, std::pair{&kp.v_map, &params.v_cache}}) {
    if (!encode_cache_tensor_map(map, *cache, element, kHeadDim, rows, p.heads_kv, outer, 1 << kp.heads_log2,
                                 kp.box_rows, kp.heads_inner)) {
      return false;
    }
  }
  // Persistent blocks, one an SM, take the items in turn: units whole while
  // every SM gets one, and the units left over split into the fewest chunks
  // whose items spread over the SMs within 5% of the best split's evenness
  // (evenest_chunks; each chunk at least kMinKeysPerChunk keys; fewer would
  // spend more on the partial results than on the keys). Left whole, the
  // units left over would leave SMs idle while they run: at 8k keys, 8 key
  // heads, B = 100 (8 units of 800 left over on 132 SMs) took 6% longer, B =
  // 70 (32 of 560) 5%. (All units split alike cost more than they balanced, 2%
  // at 2 chunks and 7-16% at 4: a chunk's partial result and its arrival cost
  // its SM about 4 us.)
  const int64_t units = p.batch * (p.heads_kv >> kp.heads_log2);
  const int64_t left_over = units % sms;
  int64_t chunks = 1;
  if (left_over > 0) {
    const int64_t most = std::min(most_chunks, ceil_div(4 * sms, left_over));
    chunks = decoding::evenest_chunks(left_over, sms, most);
  }
  const int64_t split_units = chunks > 1 ? left_over : 0, items = units + split_units * (chunks - 1);
  if (items >= (int64_t{1} << 31)) return false;
  kp.items = static_cast<int>(items);
  kp.whole_units = static_cast<int>(units - split_units);
  kp.split_units = static_cast<int>(split_units);
  kp.chunks = static_cast<int>(chunks);
  kp.rows = static_cast<int>(rows_per_head << kp.heads_log2);
  // Where every item gets a block of its own (one block an SM fits: the
  // shared memory), split units' chunks merge after a grid barrier, each a
  // share: no counters to zero, no chunk left to merge them all alone.
  kp.one_wave = split_units > 0 && items <= sms;
  return true;
}

// The tile config of a call: its head dim (64 or 128; an FP8 cache's rows are
// whole 128-byte lines at 128 only), its cache's element size, and one row
// group where a key/value head's query rows fit one mma tile, else two (an
// FP8 cache's up to 8 query rows: the keys as the mma's rows).
template <typename Fn>
bool dispatch_tile_config(const DecodeParams& params, Fn&& fn) {
  const AttentionProblem& p = params.problem;
  if (p.head_dim != p.head_dim_v || p.batch <= 0 || p.heads_kv <= 0 || p.len_q <= 0) return false;
  const int64_t rows_per_head = p.heads_q / p.heads_kv * p.len_q;
  auto with_rows = [&](auto head_dim, auto cache_bytes) {
    constexpr int kHeadDim = decltype(head_dim)::value, kCacheBytes = decltype(cache_bytes)::value;
    if (rows_per_head <= decoding::kRows) return fn(DecodeTileConfig<kHeadDim, 1, kCacheBytes>{});
    if (rows_per_head <= 2 * decoding::kRows) return fn(DecodeTileConfig<kHeadDim, 2, kCacheBytes>{});
    return false;
  };
  if (params.k_scale != nullptr) {
    if (p.head_dim != 128 || params.mask.data != nullptr) return false;  // (a mask comes only with 16-bit caches)
    // (Not for paged caches of blocks under 32 keys: the keys-as-rows item's
    // heads are half as many, and at GQA 4 and 16-key blocks each copy of its
    // stages was 16 runs of 256 bytes, read at 1.27x bf16's tokens per second
    // on an H200 where the query rows as the mma's rows read at 1.52x.)
    const bool small_blocks = params.block_table.data != nullptr && params.block_size < 32;
    if (rows_per_head <= decoding::kRows / 2 && !small_blocks) return fn(DecodeTileConfig<128, 1, 1, true>{});
    return with_rows(std::integral_constant<int, 128>{}, std::integral_constant<int, 1>{});
  }
  if (p.head_dim == 64) return with_rows(std::integral_constant<int, 64>{}, std::integral_constant<int, 2>{});
  if (p.head_dim == 128) return with_rows(std::integral_constant<int, 128>{}, std::integral_constant<int, 2>{});
  return false;
}

}  // namespace

bool decode_attention(const DecodeParams& params, ElementType type, const DecodePartialsAllocator& allocate,
                      cudaStream_t stream) {
  bool launched = false;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    dispatch_tile_config(params, [&](auto config) {
      using Cfg = decltype(config);
      DecodeKernelParams kp;
      if (!prepare_launch<Cfg>(params, type, kp)) return false;
      // Split units' partial results, and their arrival counters unless one_wave.
      auto attach_partials = [&] {
        const DecodePartials buffers =
            kp.split_units > 0
                ? allocate(int64_t{kp.split_units} * kp.rows * kp.chunks, kp.one_wave ? 0 : kp.split_units)
                : DecodePartials{};
        kp.out_partial = buffers.out;
        kp.lse_partial = buffers.lse;
        kp.arrivals = buffers.arrivals;
      };
      attach_partials();
      decoding::dispatch_score_term(params, [&](auto term) {
        const auto kernel = decode_kernel<Elem, Cfg, decltype(term)::value>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(std::min(kp.items, multiprocessor_count()));
        config.blockDim = dim3(Cfg::kThreads);
        config.dynamicSmemBytes = Cfg::kSmemBytes;
        config.stream = stream;
        cudaLaunchAttribute cooperative;  // (all blocks resident at once, and the grid's barrier)
        cooperative.id = cudaLaunchAttributeCooperative;
        cooperative.val.cooperative = 1;
        config.attrs = &cooperative;
        config.numAttrs = kp.one_wave ? 1 : 0;
        if (cudaLaunchKernelEx(&config, kernel, kp) == cudaErrorCooperativeLaunchTooLarge) {
          // Fewer blocks fit at once than the SMs suggested (a process
          // limited to part of the GPU): the last chunk to finish merges.
          (void)cudaGetLastError();
          kp.one_wave = false;
          attach_partials();
          config.numAttrs = 0;
          cudaLaunchKernelEx(&config, kernel, kp);
        }
      });
      return launched = true;
    });
  });
  return launched;
}

}  // namespace flashattn_ext::cuda::sm90
