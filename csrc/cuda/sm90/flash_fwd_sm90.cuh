// The Hopper forward kernel (sm_90a): persistent, one thread block per SM,
// each taking (block of query rows, head, batch) tiles from a tile scheduler
// (the first from its block index, the next from an atomic counter, in the
// order of heaviest_first_position for causal calls), split by role into
// warpgroups.
//  - The producer warpgroup gives most of its registers away (setmaxnreg), and
//    one of its threads fetches the tiles, hands each to the consumers through
//    shared memory, and drives the copy engine: a tile's Q once, then K and V
//    tiles into a ring of shared-memory stages, each completed on an mbarrier
//    ("full") and handed back by the consumers on another ("empty"). The ring
//    runs on across tiles, and the next tile's Q loads as soon as the
//    consumers' last Q K^T of the current one is done: its first tiles are in
//    shared memory while the consumers write the current one's output.
//  - Consumer warpgroups of 64 query rows each (two, three at head dim 64) run
//    the algorithm with wgmma: S = Q K^T with both operands in shared memory,
//    the online softmax in registers, O += P V with P from registers. Each
//    overlaps its own work: the QK^T of tile j and the P V of tile j - 1 are in
//    flight together while the softmax of tile j waits only for the first; and
//    the consumers take turns to issue them (ping-pong), so that one's softmax
//    hides under the others' GEMMs.
// Scores of tiles that cross the causal diagonal or the end of the keys are
// masked; those tiles come last in the loop. With a sliding window a tile's
// key tiles start at the window's first, and its edges are masked as the
// diagonal is; with softcapping the scores are capped as they come in. An
// attn_mask's tile of each key tile comes with K (one row of it where the mask
// repeats over queries, such as a key-padding mask), and each consumer applies
// it to its scores as soon as they are in; its block map lets a tile skip the
// key tiles it hides and run unmasked on those it hides none of. With dropout,
// the probabilities are dropped after the rows' sums and before P V. At head dim 128 the output leaves through shared
// memory and the copy engine: the consumers round it into the K buffer of the
// tile's last stage, which the producer refills only once the copy engine has
// read it (out_free); at 64 and 256 each thread stores its registers. The
// log-sum-exp is written from registers. A packed batch (varlen) is one grid
// over every sequence's query blocks, in an order built on the device
// (tile_order, cuda::plan_packed_forward); each tile reads its sequence's rows
// and lengths from cu_seqlens, and the copy engine stores only the 64-row
// boxes that lie in the sequence (the other consumers store their registers).
#include <algorithm>
#include <cmath>

#include "cuda/attn_mask.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/accumulators.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/sm90/tile_config.h"
#include "cuda/tile_order.cuh"
#include "cuda/views.cuh"
#include "cuda/visibility.cuh"

// The kernel template and its launch, instantiated by flash_fwd_sm90.cu
// (no attn_mask) and flash_fwd_sm90_masked.cu, which compile in parallel.
namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// What the kernel reads: the call, and tensor maps of q, k, v, out and the
// attn_mask. Passed as a __grid_constant__ parameter: the copy engine reads
// the maps in place.
struct FwdKernelParams {
  FwdParams call;
  CUtensorMap q_map, k_map, v_map, out_map, mask_map;
  int tiles;         // (block of query rows, head, batch) tiles (a packed batch: at most)
  int order_chunks;  // causal: heaviest_first_position's chunks
  MaskTileShape mask;
  // Not causal: the tiles in grid_position_heads_first's order (an attn_mask
  // with rows of its own that every head shares, such as an (L, S) mask),
  // else in grid_position's.
  bool heads_first;
};

// Where a tile of the forward lies, and which key tiles its consumers run:
// n_blocks of them from key block first_block on (those its rows see, through
// the causal diagonal and a sliding window, less the blocks an attn_mask's
// block map hides); n_blocks == kNoTileLeft: no tile is left. The producer works it out
// (integer divisions) and hands it to the consumers. row0 and the key blocks
// count from the tile's sequence's first row and key: in a packed batch
// (varlen) those are rows q_start and k_start of the packed tensors, and the
// sequence has len_q queries and len_k keys (a dense call: 0 and the call's).
struct FwdTile {
  int row0, head, kv_head, batch, first_block, n_blocks;
  int q_start, k_start, len_q, len_k;
};
constexpr int kNoTileLeft = -1;

// The mbarriers of one block and the tile the producer hands the consumers, in shared memory.
template <int kStages>
struct FwdSharedState {
  uint64_t q_full, q_empty;
  uint64_t k_full[kStages], v_full[kStages];    // the copy engine filled the stage
  uint64_t k_empty[kStages], v_empty[kStages];  // every consumer thread is done reading it
  uint64_t out_free[kStages];  // the copy engine has read the output in the stage's K buffer (one arrival a consumer)
  uint64_t tile_full[2], tile_empty[2];         // tile[slot] was written / read by every consumer thread
  FwdTile tile[2];  // the producer runs at most one tile ahead: two slots
  // With an attn_mask: the key block whose K the stage holds, times 2, plus 1
  // where the mask hides none of its keys (written before k_full's arrival).
  int stage_block[kStages];
  // With dropout: its seed, offset and threshold, read from rng_state once
  // (device memory: a load in each tile would hold up the tile's Philox calls,
  // and registers are short).
  DropoutState dropout;
};

// Rescales (with the row's factor) and adds: the two rows of a thread are
// e / 2 == 0 and e / 2 == 1 of each 4-register accumulator tile.
template <int kRegs>
__device__ __forceinline__ void scale_rows(float (&acc)[kRegs], const float (&factor)[2]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] *= factor[(i / 2) % 2];
}

// The max of each of a thread's two rows of a score tile (registers 4 j +
// 2 half and 4 j + 2 half + 1), over four independent chains of fmaxf each.
template <int kRegs>
__device__ __forceinline__ void rows_max(const float (&s)[kRegs], float (&row_max)[2]) {
  static_assert(kRegs % 8 == 0, "two 4-register tiles a chain to start from");
  float chain[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int c = 0; c < 4; ++c) chain[half][c] = s[4 * (c / 2) + 2 * half + c % 2];
  }
#pragma unroll
  for (int j = 2; j < kRegs / 4; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& c = chain[half][(j % 2) * 2 + e];
        c = fmaxf(c, s[4 * j + 2 * half + e]);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_max[half] = fmaxf(fmaxf(chain[half][0], chain[half][1]), fmaxf(chain[half][2], chain[half][3]));
  }
}

// S = Q K^T over keys [kBegin, kEnd) of a tile, into those keys' registers of
// s (a narrower accumulator's layout is a prefix of the wider one's).
template <typename Elem, typename Cfg, int kBegin, int kEnd, int kRegs>
__device__ __forceinline__ void issue_score_keys(float (&s)[kRegs], uint64_t q_desc, uint64_t k_desc) {
  auto& s_keys = *reinterpret_cast<float(*)[(kEnd - kBegin) / 2]>(&s[kBegin / 2]);
  const uint64_t keys_desc = desc_advance(k_desc, kBegin * kSwizzleRowBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    ptx::wgmma_ss<Elem, kEnd - kBegin>(s_keys, desc_advance(q_desc, k_major_step_bytes(Cfg::kQColBlockBytes, kk)),
                                       desc_advance(keys_desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk)), kk > 0);
  }
}

// O += P V over keys [kBegin, kEnd) of a tile.
template <typename Elem, typename Cfg, int kBegin, int kEnd>
__device__ __forceinline__ void issue_pv_keys(float (&o)[Cfg::kHeadDim / 2], const uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                              uint64_t v_desc) {
#pragma unroll
  for (int kk = kBegin / 16; kk < kEnd / 16; ++kk) {
    ptx::wgmma_rs<Elem, Cfg::kHeadDim, 1>(o, pa[kk], desc_advance(v_desc, n_major_step_bytes(kk)), true);
  }
}

// A tile's two GEMMs over its first kKeys keys, issued as one wgmma group
// each (not waited for).
template <typename Elem, typename Cfg, int kKeys>
__device__ __forceinline__ void issue_scores(float (&s)[kKeys / 2], uint64_t q_desc, uint64_t k_desc) {
  ptx::wgmma_fence();
  if constexpr (kKeys == Cfg::kBlockN) {
    issue_score_keys<Elem, Cfg, 0, kKeys>(s, q_desc, k_desc);
  } else {  // narrow: 48 keys, and the rest (64 of 112) in a second width
    issue_score_keys<Elem, Cfg, 0, 48>(s, q_desc, k_desc);
    if constexpr (kKeys > 48) issue_score_keys<Elem, Cfg, 48, kKeys>(s, q_desc, k_desc);
  }
  ptx::wgmma_commit();
}
template <typename Elem, typename Cfg, int kKeys>
__device__ __forceinline__ void issue_pv(float (&o)[Cfg::kHeadDim / 2], const uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                         uint64_t v_desc) {
  ptx::wgmma_fence();
  issue_pv_keys<Elem, Cfg, 0, kKeys>(o, pa, v_desc);
  ptx::wgmma_commit();
}

// packed_pairs: a packed batch's (sequence, query block) pairs, as the plan
// kernel counted them (kVarlen only).
template <typename Cfg, bool kWindow, bool kVarlen>
__device__ __forceinline__ FwdTile fwd_tile(const FwdKernelParams& kp, int tile, int packed_pairs) {
  const AttentionProblem& p = kp.call.problem;
  const int m_blocks = static_cast<int>(ceil_div(p.len_q, Cfg::kBlockM)), heads = static_cast<int>(p.heads_q);
  FwdTile t;
  if constexpr (kVarlen) {
    // Heads outermost, each head's (sequence, query block) pairs in the order
    // of tile_order: the tiles that run together read the same head's keys and
    // values from L2, and the grid ends with light ones.
    const PackedSequences& packed = kp.call.packed;
    t.head = tile / packed_pairs;
    const int pair = tile - t.head * packed_pairs;
    t.batch = packed.tile_order[2 * pair];
    const SequenceSpan queries = sequence_span(packed.cu_seqlens_q, packed.total_q, p.len_q, t.batch);
    const SequenceSpan keys = sequence_span(packed.cu_seqlens_k, packed.total_k, p.len_k, t.batch);
    t.q_start = queries.start;
    t.k_start = keys.start;
    t.len_q = queries.length;
    t.len_k = keys.length;
    t.row0 = packed.tile_order[2 * pair + 1] * Cfg::kBlockM;
  } else {
    const int pairs = kp.tiles / m_blocks;
    const GridPosition position = p.is_causal ? heaviest_first_position(tile, m_blocks, heads, pairs, kp.order_chunks)
                                  : kp.heads_first ? grid_position_heads_first(tile, m_blocks, heads)
                                                   : grid_position(tile, m_blocks, heads);
    t.row0 = static_cast<int>((m_blocks - 1 - position.block) * Cfg::kBlockM);  // longest causal rows first
    t.head = static_cast<int>(position.head);
    t.batch = static_cast<int>(position.batch);
    t.q_start = t.k_start = 0;
    t.len_q = static_cast<int>(p.len_q);
    t.len_k = static_cast<int>(p.len_k);
  }
  t.kv_head = t.head / static_cast<int>(p.heads_q / p.heads_kv);
  if constexpr (kWindow || kVarlen) {
    const Visibility seen(p, t.len_q, t.len_k);
    const int64_t key_begin = seen.key_begin(t.row0);
    const int64_t key_end = seen.key_end(min(int64_t{t.len_q}, t.row0 + int64_t{Cfg::kBlockM}) - 1);
    t.first_block = static_cast<int>(key_begin / Cfg::kBlockN);
    t.n_blocks = key_end > key_begin ? static_cast<int>(ceil_div(key_end, Cfg::kBlockN)) - t.first_block : 0;
  } else {
    t.first_block = 0;
    t.n_blocks = static_cast<int>(ceil_div(visible_key_end(p, causal_offset(p), t.row0, Cfg::kBlockM), Cfg::kBlockN));
  }
  return t;
}

// kWindow: a sliding window (the problem's window_left / window_right): key
// tiles from the window's first, its edges masked as the causal diagonal is.
// kSoftcap: logit softcapping (the problem's softcap; no attn_mask). kAlibi:
// ALiBi's bias (the problem's alibi_slopes; no attn_mask or softcap). kVarlen:
// a packed batch (the call's packed; no attn_mask or dropout). Template flags,
// so that the calls without them keep the code they had.
template <typename Elem, typename Cfg, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap, bool kAlibi,
          bool kVarlen>
__global__ void __launch_bounds__(Cfg::kThreads, 1) attention_forward_kernel(const __grid_constant__ FwdKernelParams kp) {
  static_assert(Cfg::Mask::kPresent == (kMask != MaskKind::kNone), "a mask tile exactly where there is a mask");
  static_assert(!Cfg::Mask::kPresent || Cfg::kBlockN == kKeyBlockKeys, "the block map's key blocks are the key tiles");
  static_assert(!(kSoftcap && Cfg::Mask::kPresent), "softcapped scores take no attn_mask here");
  static_assert(!(kAlibi && (kSoftcap || Cfg::Mask::kPresent)), "ALiBi's scores take no cap or attn_mask here");
  static_assert(!(kVarlen && (kDropout || Cfg::Mask::kPresent)), "a packed batch takes no attn_mask or dropout here");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = Cfg::kHeadDim, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kKeyRegs = kBlockN / 2;   // a thread's share of its warpgroup's 64 x kBlockN scores
  constexpr int kOutRegs = kHeadDim / 2;  // and of its 64 x kHeadDim output
  constexpr bool kOutThroughSmem = Cfg::kOutThroughSmem;
  constexpr int kOutBoxBytes = 64 * kSwizzleRowBytes;  // the out map's box: 64 rows x 64 columns
  const FwdParams& params = kp.call;
  const AttentionProblem& p = params.problem;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = swizzle_aligned(smem_raw);
  unsigned char* s_q = smem;
  unsigned char* s_k = s_q + Cfg::kQBytes;
  unsigned char* s_v = s_k + kStages * Cfg::kKVBytes;
  unsigned char* s_mask = s_v + kStages * Cfg::kKVBytes;
  auto* shared = reinterpret_cast<FwdSharedState<kStages>*>(s_mask + kStages * Cfg::Mask::kBytes);
  static_assert(Cfg::kQBytes + kStages * (2 * Cfg::kKVBytes + Cfg::Mask::kBytes) + sizeof(FwdSharedState<kStages>) +
                        1024 <=
                    Cfg::kSmemBytes,
                "the shared state fits after the tiles");
  constexpr int kConsumerThreads = Cfg::kConsumers * kWarpgroupThreads;

  // Read from lane 0: the compiler then knows it is the same across the warp
  // and keeps what derives from it (the wgmma descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / kWarpgroupThreads, 0);
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&shared->q_full, 1);
    ptx::mbarrier_init(&shared->q_empty, kConsumerThreads);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&shared->k_full[s], 1);
      ptx::mbarrier_init(&shared->v_full[s], 1);
      ptx::mbarrier_init(&shared->k_empty[s], kConsumerThreads);
      ptx::mbarrier_init(&shared->v_empty[s], kConsumerThreads);
      ptx::mbarrier_init(&shared->out_free[s], Cfg::kConsumers);
    }
    for (int slot = 0; slot < 2; ++slot) {
      ptx::mbarrier_init(&shared->tile_full[slot], 1);
      ptx::mbarrier_init(&shared->tile_empty[slot], kConsumerThreads);
    }
    ptx::fence_barrier_init();
    if constexpr (kDropout) shared->dropout = dropout_state(params.dropout);
  }
  __syncthreads();

  // Producer and consumers step through the same sequence of tiles (round r's
  // in slot r % 2) and the same ring of K/V stages (the kv-th tile loaded or
  // read overall in stage kv % kStages). A fresh barrier's preceding phase
  // counts as complete, so the first waits for an "empty" pass at once.
  if (warpgroup == 0) {
    // Producer.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&kp.q_map);
    ptx::prefetch_tensor_map(&kp.k_map);
    ptx::prefetch_tensor_map(&kp.v_map);
    if constexpr (Cfg::Mask::kPresent) ptx::prefetch_tensor_map(&kp.mask_map);
    const int mask_tile_bytes = kp.mask.tile_bytes(Cfg::Mask::kColBlocks);
    int tile = blockIdx.x;
    // (A packed batch's were counted on the device.)
    const int packed_pairs = kVarlen ? *params.packed.tile_pairs : 0;
    const int tiles = kVarlen ? packed_pairs * static_cast<int>(p.heads_q) : kp.tiles;
    // Bit s: stage s's K buffer holds an output not yet read (out_waits: the
    // parity of its next out_free phase).
    uint32_t out_held = 0, out_waits = 0;
    for (int round = 0, kv = 0, q_round = 0;; ++round) {
      const int slot = round % 2;
      FwdTile t;
      t.n_blocks = kNoTileLeft;
      if (tile < tiles) t = fwd_tile<Cfg, kWindow, kVarlen>(kp, tile, packed_pairs);
      // The tile's key blocks; the consumers are handed those that the mask
      // does not hide (its block map: the other blocks are skipped).
      const int key_blocks = t.n_blocks;
      const bool mapped = Cfg::Mask::kPresent && params.mask_blocks.visibility != nullptr && t.n_blocks > 0;
      auto visibility = [&](int n_block) {
        return mapped ? tile_visibility(params.mask_blocks, t.batch, t.head, t.row0, kBlockM, p.len_q, n_block)
                      : BlockVisibility::kPartial;
      };
      if (mapped) {
        int shown = 0;
#pragma unroll 4
        for (int n_block = t.first_block; n_block < t.first_block + key_blocks; ++n_block) {
          shown += visibility(n_block) != BlockVisibility::kHidden;
        }
        t.n_blocks = shown;
      }
      ptx::mbarrier_wait(&shared->tile_empty[slot], ((round / 2) & 1) ^ 1);
      shared->tile[slot] = t;
      ptx::mbarrier_arrive(&shared->tile_full[slot]);
      if (t.n_blocks == kNoTileLeft) return;
      const int next_tile = gridDim.x + atomicAdd(params.tile_counter, 1);  // used only at the end
      // (A packed batch is batch 0 of its tensors, its sequences at rows q_start and k_start.)
      const int head = t.head, kv_head = t.kv_head, batch = kVarlen ? 0 : t.batch;
      if (t.n_blocks > 0) {
        ptx::mbarrier_wait(&shared->q_empty, (q_round++ & 1) ^ 1);
        ptx::mbarrier_arrive_expect_tx(&shared->q_full, Cfg::kQBytes);
        for (int c = 0; c < Cfg::kColBlocks; ++c) {
          ptx::tma_load_4d(s_q + c * Cfg::kQColBlockBytes, &kp.q_map, &shared->q_full, c * kSwizzleCols,
                           t.q_start + t.row0, head, batch);
        }
      }
      for (int n_block = t.first_block; n_block < t.first_block + key_blocks; ++n_block) {
        const BlockVisibility seen = visibility(n_block);
        if (seen == BlockVisibility::kHidden) continue;
        const bool unmasked = seen == BlockVisibility::kVisible;  // (no mask tile to load)
        const int stage = kv % kStages;
        const uint32_t parity = (kv / kStages) & 1;
        const int key_row = t.k_start + n_block * kBlockN;
        ptx::mbarrier_wait(&shared->k_empty[stage], parity ^ 1);
        if (out_held >> stage & 1) {
          ptx::mbarrier_wait(&shared->out_free[stage], out_waits >> stage & 1);
          out_held ^= 1u << stage;
          out_waits ^= 1u << stage;
        }
        if constexpr (Cfg::Mask::kPresent) shared->stage_block[stage] = 2 * n_block + unmasked;
        ptx::mbarrier_arrive_expect_tx(&shared->k_full[stage], Cfg::kKVBytes + (unmasked ? 0 : mask_tile_bytes));
        for (int c = 0; c < Cfg::kColBlocks; ++c) {
          ptx::tma_load_4d(s_k + stage * Cfg::kKVBytes + c * Cfg::kKVColBlockBytes, &kp.k_map, &shared->k_full[stage],
                           c * kSwizzleCols, key_row, kv_head, batch);
        }
        if (Cfg::Mask::kPresent && !unmasked) {
          for (int c = 0; c < Cfg::Mask::kColBlocks; ++c) {
            ptx::tma_load_4d(s_mask + stage * Cfg::Mask::kBytes + c * kp.mask.block_bytes, &kp.mask_map,
                             &shared->k_full[stage], key_row + c * Cfg::Mask::kColBlockCols,
                             kp.mask.rows_full ? t.row0 : 0, head * kp.mask.head_step, batch * kp.mask.batch_step);
          }
        }
        ptx::mbarrier_wait(&shared->v_empty[stage], parity ^ 1);
        ptx::mbarrier_arrive_expect_tx(&shared->v_full[stage], Cfg::kKVBytes);
        for (int c = 0; c < Cfg::kColBlocks; ++c) {
          ptx::tma_load_4d(s_v + stage * Cfg::kKVBytes + c * Cfg::kKVColBlockBytes, &kp.v_map, &shared->v_full[stage],
                           c * kSwizzleCols, key_row, kv_head, batch);
        }
        ++kv;
      }
      if (kOutThroughSmem && t.n_blocks > 0) out_held |= 1u << ((kv - 1) % kStages);
      tile = next_tile;
    }
  }

  // Consumers.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % kWarpSize;
  // This thread's two query rows in the tile: r and r + 8.
  const int tile_row = consumer * 64 + (tid / kWarpSize) * 16 + lane / 4;

  // Descriptors of this warpgroup's 64 rows of Q, of stage 0's K (both
  // K-major) and V (N-major), at their first k16 step; a stage and a step move
  // them by constant offsets.
  const uint64_t q_tile_desc = k_major_desc(ptx::smem_addr(s_q) + consumer * 64 * kSwizzleRowBytes);
  const uint64_t k_tile_desc = k_major_desc(ptx::smem_addr(s_k));
  const uint64_t v_tile_desc = n_major_desc(ptx::smem_addr(s_v), Cfg::kKVColBlockBytes);

  // kv: the K/V tile's place in the ring (see above).
  auto wait_k = [&](int kv) { ptx::mbarrier_wait(&shared->k_full[kv % kStages], (kv / kStages) & 1); };
  auto wait_v = [&](int kv) { ptx::mbarrier_wait(&shared->v_full[kv % kStages], (kv / kStages) & 1); };
  auto release_v = [&](int kv) { ptx::mbarrier_arrive(&shared->v_empty[kv % kStages]); };
  // Where stage kv % kStages's K or V tile starts.
  auto k_stage_desc = [&](int kv) { return desc_advance(k_tile_desc, (kv % kStages) * Cfg::kKVBytes); };
  auto v_stage_desc = [&](int kv) { return desc_advance(v_tile_desc, (kv % kStages) * Cfg::kKVBytes); };

  // Scores are kept in log2 units: exp(x * scale) = exp2(x * scale * log2(e)).
  // The kernel takes positive scales only, so the max of the unscaled scores
  // times the scale is the max of the scaled ones: scaling and subtracting the
  // max fold into one fma.
  const float scale = static_cast<float>(p.scale), scale_log2 = static_cast<float>(p.scale * M_LOG2E);
  // Softcapping: the scores become softcap * tanh(scale * s / softcap), in log2
  // units, as they come in; the softmax then takes them as they are. tanh.approx
  // (FlashAttention's choice): a logit of 10 moves by up to 0.005, one of 50 by
  // 0.025, against probabilities rounded to 16 bits anyway; tanhf ran the
  // forward at 0.47x the speed of no softcap, tanh.approx at 0.72x (H200, bf16,
  // D=128, N=8192). (The decode kernel, bound by memory, keeps tanhf.)
  const float scale_over_cap = kSoftcap ? static_cast<float>(p.scale / p.softcap) : 0.f;
  const float cap_log2 = static_cast<float>(p.softcap * M_LOG2E);
  auto cap_scores = [&](auto& s) {
    if constexpr (kSoftcap) {
#pragma unroll
      for (int i = 0; i < int(sizeof(s) / sizeof(float)); ++i) {
        s[i] = cap_log2 * ptx::tanh_approx(s[i] * scale_over_cap);
      }
    }
  };
  const float softmax_scale = kSoftcap || kAlibi ? 1.f : masked_scores_scale(kMask, scale_log2);

  // attn_mask: this thread's values in a stage's mask tile are those of its
  // two rows (r and r + 8; in a one-row tile, both row 0) at its columns 8 j
  // + 2 (lane % 4) and the next (as its score registers 4 j + 2 half and the
  // next), in 128-byte rows whose 16-byte chunk c lies at chunk c ^ (row % 8).
  // Each column block of a one-row tile starts a 1024-byte swizzle period.
  const unsigned char* mask_thread = s_mask + (kp.mask.rows_full ? tile_row * kSwizzleRowBytes : 0) +
                                     (lane % 4) * 2 * Cfg::Mask::kElemBytes;
  const int mask_half_bytes = kp.mask.rows_full ? 8 * kSwizzleRowBytes : 0;
  const int mask_swizzle_row = kp.mask.rows_full ? lane / 4 : 0;
  // Applies the mask tile of the kv-th K/V tile to s, in log2 units: a bool
  // mask sets the hidden scores to -inf; an additive one's scaled scores plus
  // its values.
  auto apply_attn_mask = [&](auto& s, int kv) {
    constexpr int kRegs = sizeof(s) / sizeof(float);
    constexpr int kEb = Cfg::Mask::kElemBytes;
    const unsigned char* stage_mask = mask_thread + (kv % kStages) * Cfg::Mask::kBytes;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      const int col_byte = 8 * j * kEb;  // the 8-key group's first byte
      const int block = col_byte / kSwizzleRowBytes, chunk = col_byte % kSwizzleRowBytes / 16;
      const int pair_offset = block * kp.mask.block_bytes + (chunk ^ mask_swizzle_row) * 16 + col_byte % 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float& s0 = s[4 * j + 2 * half];
        float& s1 = s[4 * j + 2 * half + 1];
        const unsigned char* pair = stage_mask + pair_offset + half * mask_half_bytes;
        if constexpr (kMask == MaskKind::kBool) {
          const uint32_t keep = *reinterpret_cast<const uint16_t*>(pair);
          mask_score(s0, (keep & 0xff) != 0);
          mask_score(s1, (keep >> 8) != 0);
        } else {
          const float2 bias = ptx::unpack2<Elem>(*reinterpret_cast<const uint32_t*>(pair));
          mask_score(s0, bias.x, scale);
          mask_score(s1, bias.y, scale);
        }
      }
    }
  };

  // The key block of the kv-th K/V tile, the index-th of its query tile's: with
  // an attn_mask the producer says which (the blocks its block map hides are
  // skipped) and whether the mask hides none of its pairs; read after K's
  // wait and before its release.
  struct StageBlock {
    int n_block;
    bool unmasked;
  };
  auto stage_block = [&](int kv, int index, int first_block) {
    if constexpr (Cfg::Mask::kPresent) {
      const int code = shared->stage_block[kv % kStages];
      return StageBlock{code / 2, code % 2 != 0};
    } else {
      return StageBlock{first_block + index, false};
    }
  };
  // The attn_mask of the kv-th K/V tile on its scores, not read where it hides
  // none of the block's keys (an additive mask's values there are all 0).
  auto apply_stage_mask = [&](auto& s, int kv, const StageBlock& block) {
    if constexpr (Cfg::Mask::kPresent) {
      if (!block.unmasked) {
        apply_attn_mask(s, kv);
      } else if constexpr (kMask == MaskKind::kAdditive) {
#pragma unroll
        for (int i = 0; i < int(sizeof(s) / sizeof(float)); ++i) mask_score(s[i], 0.f, scale);
      }
    }
  };

  // Ping-pong: the consumers take turns, in order, to issue a tile's two GEMMs
  // (named barrier 1 + c is consumer c's turn; the one before grants it), so
  // that one's softmax runs while the tensor cores work for the others. The
  // order runs on across tiles (a consumer that is done with a tile must not
  // take two turns before the next one's last): consumer 0 grants itself the
  // first turn, and takes one more at the end that no GEMM follows, so every
  // arrival is waited for.
  constexpr int kTurnThreads = 2 * kWarpgroupThreads;  // the waiting consumer and the granting one
  auto wait_turn = [&] { ptx::named_barrier_sync(1 + consumer, kTurnThreads); };
  auto grant_turn = [&] { ptx::named_barrier_arrive(1 + (consumer + 1) % Cfg::kConsumers, kTurnThreads); };
  if (consumer == 0) ptx::named_barrier_arrive(1, kTurnThreads);

  // Thread 0 of each consumer: the stage whose K buffer holds this consumer's
  // output of the previous tile while the copy engine reads it (-1: none).
  int out_stage = -1;
  auto hand_back_out_stage = [&] {
    if (out_stage >= 0) {
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(&shared->out_free[out_stage]);
      out_stage = -1;
    }
  };

  for (int round = 0, kv = 0, q_round = 0;; ++round) {
    const int slot = round % 2;
    ptx::mbarrier_wait(&shared->tile_full[slot], (round / 2) & 1);
    const FwdTile t = shared->tile[slot];
    ptx::mbarrier_arrive(&shared->tile_empty[slot]);
    if (t.n_blocks == kNoTileLeft) {
      if (consumer == 0) wait_turn();
      hand_back_out_stage();  // shared memory must outlive the copy engine's reads
      break;
    }
    const int64_t row0 = t.row0;
    // The tile's sequence's lengths, and the keys each of its queries sees
    // (the causal diagonal, the window).
    const int64_t len_q = kVarlen ? t.len_q : p.len_q, len_k = kVarlen ? t.len_k : p.len_k;
    const Visibility seen(p, len_q, len_k);
    // ALiBi: the scores scaled, less slope * |i + offset - j| (log2 units), as
    // they come in; the softmax then takes them as they are.
    const float alibi_log2 = kAlibi ? alibi_slope(p, t.batch, t.head) * float(M_LOG2E) : 0.f;
    auto add_alibi = [&](auto& s, int n_block) {
      if constexpr (kAlibi) {
        // i + offset - j at the tile's (0, 0): 32 bits, as the tile coordinates.
        const int corner = static_cast<int>(row0 + seen.offset - int64_t(n_block) * kBlockN);
#pragma unroll
        for (int i = 0; i < int(sizeof(s) / sizeof(float)); ++i) {
          const int c = accumulator_column(i, lane), r = tile_row + accumulator_row_offset(i);
          s[i] = fmaf(s[i], scale_log2, -alibi_log2 * fabsf(static_cast<float>(corner + r - c)));
        }
      }
    };
    const int first_block = kWindow ? t.first_block : 0, n_blocks = t.n_blocks;

    // Frees the K of the tile's index-th key tile; its last Q K^T is its last
    // read of Q: the next tile's may load.
    auto release_k = [&](int index) {
      ptx::mbarrier_arrive(&shared->k_empty[(kv + index) % kStages]);
      if (index == n_blocks - 1) ptx::mbarrier_arrive(&shared->q_empty);
    };
    // Masks keys past the end, right of the causal diagonal or of the window's
    // right edge, and left of its left edge (to -inf): only the tiles for which
    // tile_needs_mask holds have any.
    auto tile_needs_mask = [&](int n_block) {
      const int64_t col0 = int64_t(n_block) * kBlockN;
      const bool crosses_edge = kWindow ? seen.tile_is_partial(row0, kBlockM, col0, kBlockN)
                                        : p.is_causal && col0 + kBlockN - 1 > row0 + seen.offset;
      return col0 + kBlockN > len_k || crosses_edge;
    };
    // In 32-bit tile coordinates: key c of the tile is past the end when c >=
    // keys_left; right of the edge (col0 + c > row0 + r + offset + right) when
    // c - r > right_edge, left of it (col0 + c < row0 + r + offset - left)
    // when c - r < left_edge.
    auto mask_tile = [&](auto& s, int n_block) {
      const int64_t col0 = int64_t(n_block) * kBlockN;
      const int keys_left = static_cast<int>(min(len_k - col0, int64_t(kBlockN)));
      auto in_tile = [](int64_t d) { return static_cast<int>(clamp_index(d, -kBlockM, kBlockN)); };
      const int right_edge = seen.right < 0 ? kBlockN : in_tile(row0 + seen.offset + seen.right - col0);
      const int left_edge = kWindow && seen.left >= 0 ? in_tile(row0 + seen.offset - seen.left - col0) : -kBlockM;
#pragma unroll
      for (int i = 0; i < int(sizeof(s) / sizeof(float)); ++i) {
        const int c = accumulator_column(i, lane), r = tile_row + accumulator_row_offset(i);
        if (c >= keys_left || c - r > right_edge || (kWindow && c - r < left_edge)) s[i] = -INFINITY;
      }
    };

    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    // The online softmax of one tile: turns s into unnormalized probabilities
    // and returns whether any row of the warp moved its running max (only then
    // does the output so far need its rows' rescale factors). It is lazy about
    // the max: a row's running max moves only where the tile's exceeds it by
    // more than kMaxGrowth (log2 units), and the exps are taken against it as
    // it stands otherwise. The probabilities then stay below 2^kMaxGrowth (the
    // same sums and output, against another reference), and most tiles leave
    // the output unscaled: measured 1-3% faster than moving it every tile
    // (H100).
    // The tile's max comes first, from independent chains (rows_max): the
    // compiler keeps the order of fmaxf and of float adds as written, and one
    // chain through a row's scores is latency the exps wait for.
    constexpr float kMaxGrowth = 8.f;
    auto softmax = [&](auto& s, float (&rescale)[2]) {
      constexpr int kRegs = sizeof(s) / sizeof(float);
      float tile_max[2];
      rows_max(s, tile_max);
#pragma unroll
      for (int lanes = 1; lanes <= 2; lanes *= 2) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffff, tile_max[half], lanes));
        }
      }
      bool moved = false;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float new_max = tile_max[half] * softmax_scale;
        rescale[half] = 1.f;
        if (new_max > row_max[half] + kMaxGrowth) {  // (from -inf, a row's first visible key)
          rescale[half] = ptx::exp2_approx(row_max[half] - new_max);
          row_max[half] = new_max;
          moved = true;
        }
        // A row with nothing visible yet keeps max -inf; subtract 0 instead so
        // that exp2(-inf - max) stays 0 rather than NaN.
        const float max_used = row_max[half] == -INFINITY ? 0.f : row_max[half];
        float tile_sum[2] = {0.f, 0.f};  // two chains, as for the max
#pragma unroll
        for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[4 * j + e] = ptx::exp2_approx(fmaf(s[4 * j + e], softmax_scale, -max_used));
            tile_sum[j % 2] += s[4 * j + e];
          }
        }
        row_sum[half] = row_sum[half] * rescale[half] + (tile_sum[0] + tile_sum[1]);
      }
      return __any_sync(0xffffffff, moved);
    };

    // Dropout on the rounded probabilities `probs` of key tile n_block (of its
    // first `keys` keys): after the softmax, whose row sums count every probability,
    // and before P V; the kept ones are scaled with the output. Two 16-key
    // blocks a step (dropout_block_pair_flags), each 16-bit probability ANDed
    // with its mask. (probs is generic: nvcc 13's cicc crashes on an array
    // reference parameter of this generic lambda.)
    auto apply_dropout = [&](auto& probs, int n_block, auto keys) {
      constexpr int kBlocks = decltype(keys)::value / 16;
      auto& frags = *reinterpret_cast<uint32_t(*)[kBlocks][4]>(&probs);
      const DropoutState dropout = shared->dropout;
      const uint64_t group0 = dropout_group(int64_t(t.batch) * p.heads_q + t.head, row0 + tile_row,
                                            int64_t(n_block) * kBlockN + (lane % 4) * 2, p.len_q, p.len_k);
#pragma unroll
      for (int pair = 0; pair < (kBlocks + 1) / 2; ++pair) {
        uint32_t flags[2][2];
        dropout_block_pair_flags<false>(flags, dropout, group0 + 8 * pair, 4, lane);
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          // Register r of a block: query half r % 2, key half r / 2.
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (2 * pair + b < kBlocks) frags[2 * pair + b][r] &= dropout_pair_mask(flags[b], (r % 2) * 2 + r / 2);
          }
        }
      }
    };

    // The rows' final sums: writes the log-sum-exp and sets inv_sum to 1 / sum,
    // times dropout's 1 / (1 - p) (rows that saw no key: -inf and 0).
    float inv_sum[2];
    auto finish_rows = [&] {
      // ((batch, heads_q, len_q); a packed batch's (heads_q, total_q).)
      float* lse = static_cast<float*>(params.lse) +
                   (kVarlen ? t.head * params.packed.total_q + t.q_start : (t.batch * p.heads_q + t.head) * p.len_q);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = row_sum[half];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        inv_sum[half] = sum > 0.f ? (kDropout ? shared->dropout.keep_scale : 1.f) / sum : 0.f;
        const int64_t row = row0 + tile_row + half * 8;
        if (lane % 4 == 0 && row < len_q) {
          lse[row] = sum > 0.f ? (row_max[half] + log2f(sum)) * float(M_LN2) : -INFINITY;
        }
      }
    };

    float o[kOutRegs];
#pragma unroll
    for (int i = 0; i < kOutRegs; ++i) o[i] = 0.f;

    if (n_blocks > 0) {
      // The keys of the tile's last key tile: their GEMMs run narrow where
      // they fit (not in a first tile: a call of a few keys).
      const int last_keys = static_cast<int>(seen.key_end(min(len_q, row0 + kBlockM) - 1) -
                                             int64_t(first_block + n_blocks - 1) * kBlockN);
      const int last_width = !Cfg::kNarrowLastTile || n_blocks == 1 ? kBlockN
                             : last_keys <= Cfg::kNarrowKeys0     ? Cfg::kNarrowKeys0
                             : last_keys <= Cfg::kNarrowKeys1     ? Cfg::kNarrowKeys1
                                                                  : kBlockN;
      using Whole = std::integral_constant<int, kBlockN>;
      using Narrow0 = std::integral_constant<int, Cfg::kNarrowKeys0>;
      using Narrow1 = std::integral_constant<int, Cfg::kNarrowKeys1>;
      ptx::mbarrier_wait(&shared->q_full, q_round++ & 1);
      uint32_t pa[kBlockN / 16][4];
      {
        float s[kKeyRegs];
        wait_k(kv);
        const StageBlock block = stage_block(kv, 0, first_block);
        issue_scores<Elem, Cfg, kBlockN>(s, q_tile_desc, k_stage_desc(kv));
        hand_back_out_stage();
        ptx::wgmma_wait<0>();
        fence_registers(s);
        cap_scores(s);
        add_alibi(s, block.n_block);
        apply_stage_mask(s, kv, block);
        release_k(0);
        if (tile_needs_mask(block.n_block)) mask_tile(s, block.n_block);
        float rescale[2];
        softmax(s, rescale);
        to_fragments<Elem>(s, pa);
        if constexpr (kDropout) apply_dropout(pa, block.n_block, Whole{});
      }
      // The index-th key tile of the tile, index >= 1 (its GEMMs over its first
      // kKeys keys): its scores and the P V of the previous one run together;
      // the softmax needs only the scores (the first group of two).
      auto key_tile = [&](int index, auto keys) {
        constexpr int kKeys = decltype(keys)::value;
        float s[kKeys / 2];
        wait_k(kv + index);
        const StageBlock block = stage_block(kv + index, index, first_block);
        wait_v(kv + index - 1);
        wait_turn();
        issue_scores<Elem, Cfg, kKeys>(s, q_tile_desc, k_stage_desc(kv + index));
        issue_pv<Elem, Cfg, kBlockN>(o, pa, v_stage_desc(kv + index - 1));
        grant_turn();
        ptx::wgmma_wait<1>();
        fence_registers(s);
        cap_scores(s);
        add_alibi(s, block.n_block);
        apply_stage_mask(s, kv + index, block);
        release_k(index);
        // The softmax sits in the branches of its own if: the compiler schedules
        // each basic block on its own, and in one shared with the wait for P V
        // below it hoists that wait (a free instruction to it) above the
        // softmax, which then no longer runs under P V.
        float rescale[2];
        bool rescale_o;
        if (kKeys < kBlockN || tile_needs_mask(block.n_block)) {
          mask_tile(s, block.n_block);
          rescale_o = softmax(s, rescale);
        } else {
          rescale_o = softmax(s, rescale);
        }
        ptx::wgmma_wait<0>();
        fence_registers(o);
        release_v(kv + index - 1);
        if (rescale_o) scale_rows(o, rescale);
        to_fragments<Elem>(s, *reinterpret_cast<uint32_t(*)[kKeys / 16][4]>(&pa));
        if constexpr (kDropout) apply_dropout(pa, block.n_block, keys);
      };
      const int whole_tiles = last_width == kBlockN ? n_blocks : n_blocks - 1;
      for (int index = 1; index < whole_tiles; ++index) key_tile(index, Whole{});
      if constexpr (Cfg::kNarrowLastTile) {
        if (last_width == Narrow0::value) key_tile(n_blocks - 1, Narrow0{});
        if (last_width == Narrow1::value) key_tile(n_blocks - 1, Narrow1{});
      }
      wait_v(kv + n_blocks - 1);
      const uint64_t last_v_desc = v_stage_desc(kv + n_blocks - 1);
      if (Cfg::kNarrowLastTile && last_width == Narrow0::value) {
        issue_pv<Elem, Cfg, Narrow0::value>(o, pa, last_v_desc);
      } else if (Cfg::kNarrowLastTile && last_width == Narrow1::value) {
        issue_pv<Elem, Cfg, Narrow1::value>(o, pa, last_v_desc);
      } else {
        issue_pv<Elem, Cfg, kBlockN>(o, pa, last_v_desc);
      }
      finish_rows();  // under the last P V
      ptx::wgmma_wait<0>();
      fence_registers(o);
      release_v(kv + n_blocks - 1);
      kv += n_blocks;
    } else {
      finish_rows();
    }

    // In a packed batch the copy engine stores a consumer's 64 rows only where
    // they all lie in the sequence (its box would write the next one's).
    const bool box_in_sequence = !kVarlen || row0 + consumer * 64 + 64 <= len_q;
    if (kOutThroughSmem && n_blocks > 0 && box_in_sequence) {
      // Once every consumer's last Q K^T has read the last stage's K buffer
      // (its "empty" phase completed), each rounds its 64 rows into it,
      // 128-byte swizzled as the out map's boxes, and one thread has the copy
      // engine store them (clipping rows past the end and columns past the head
      // dim). That thread hands the buffer back when the copy engine has read
      // it, after the next tile's first Q K^T is issued.
      const int last = kv - 1;
      ptx::mbarrier_wait(&shared->k_empty[last % kStages], (last / kStages) & 1);
      unsigned char* s_out = s_k + (last % kStages) * Cfg::kKVBytes + consumer * Cfg::kColBlocks * kOutBoxBytes;
      const uint32_t out_addr = ptx::smem_addr(s_out);
      // stmatrix of 16 columns (two 8-column pieces) by this warp's 16 rows:
      // lane group m = lane / 8 addresses matrix m: rows + 8 (m % 2), piece + m / 2.
      const int m = lane / 8, row = (tid / kWarpSize) * 16 + (m % 2) * 8 + lane % 8;
#pragma unroll
      for (int j = 0; j < kOutRegs / 8; ++j) {
        const uint32_t frag[4] = {ptx::pack2<Elem>(o[8 * j] * inv_sum[0], o[8 * j + 1] * inv_sum[0]),
                                  ptx::pack2<Elem>(o[8 * j + 2] * inv_sum[1], o[8 * j + 3] * inv_sum[1]),
                                  ptx::pack2<Elem>(o[8 * j + 4] * inv_sum[0], o[8 * j + 5] * inv_sum[0]),
                                  ptx::pack2<Elem>(o[8 * j + 6] * inv_sum[1], o[8 * j + 7] * inv_sum[1])};
        const int piece = 2 * j + m / 2;  // the row's 16-byte piece
        ptx::stmatrix_x4(out_addr + (piece / 8) * kOutBoxBytes + row * kSwizzleRowBytes + ((piece % 8) ^ (row % 8)) * 16,
                         frag);
      }
      ptx::fence_proxy_async();
      ptx::named_barrier_sync(1 + Cfg::kConsumers + consumer, kWarpgroupThreads);
      if (tid == 0) {
        const int out_row = static_cast<int>(row0) + consumer * 64;
        if (out_row < len_q) {
          for (int c = 0; c < Cfg::kColBlocks; ++c) {
            ptx::tma_store_4d(&kp.out_map, s_out + c * kOutBoxBytes, c * kSwizzleCols, t.q_start + out_row, t.head,
                              kVarlen ? 0 : t.batch);
          }
        }
        ptx::bulk_commit_group();
        out_stage = last % kStages;
      }
    } else {
      // The producer waits for every consumer's hand-back of the last stage's
      // K buffer: one that stores its registers hands it back unused.
      if (kOutThroughSmem && n_blocks > 0 && tid == 0) out_stage = (kv - 1) % kStages;
      // Each thread stores its registers (with no key seen, zeros). Columns past
      // the head dim (padded to the kernel's) are not stored; the check is per
      // thread, so it is made only where there are such columns.
      const int dim = static_cast<int>(p.head_dim);
      const bool padded = dim < kHeadDim;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = row0 + tile_row + half * 8;
        if (row >= len_q) continue;
        const int cols0 = (lane % 4) * 2;  // this thread's columns of the row: 8 j + cols0 and the next
        Elem* out_row = head_ptr<Elem>(params.out, kVarlen ? 0 : t.batch, t.head) +
                        (t.q_start + row) * params.out.stride_row + cols0;
#pragma unroll
        for (int j = 0; j < kOutRegs / 4; ++j) {
          if (!padded || j * 8 + cols0 < dim) {
            *reinterpret_cast<uint32_t*>(out_row + j * 8) =
                ptx::pack2<Elem>(o[4 * j + 2 * half] * inv_sum[half], o[4 * j + 2 * half + 1] * inv_sum[half]);
          }
        }
      }
    }
  }
#endif
}

// The tile scheduler counts tiles in an int (with room for the grid's last fetches past the end).
constexpr int64_t kMaxTiles = int64_t{1} << 30;

// kCausal picks the tile shape (fwd_block_n); the kernel reads the call's
// causal flag and window from params.
template <typename Elem, int kHeadDim, bool kCausal, bool kDropout, MaskKind kMask, bool kWindow = false,
          bool kSoftcap = false, bool kAlibi = false, bool kVarlen = false>
bool launch_forward(const FwdParams& params, cudaStream_t stream) {
  constexpr bool kMasked = kMask != MaskKind::kNone;
  constexpr int kMaskElemBytes = mask_elem_bytes(kMask);
  using Cfg = FwdTileConfig<kHeadDim, fwd_block_n(kHeadDim, kCausal, kMasked), kMaskElemBytes>;
  const AttentionProblem& p = params.problem;
  FwdKernelParams kp;
  kp.call = params;
  constexpr bool kBFloat16 = std::is_same_v<Elem, __nv_bfloat16>;
  const MappedShape shape = mapped_shape(p, params.packed, std::max(Cfg::kBlockM, Cfg::kBlockN));
  if (!shape.fits) return false;
  const int64_t rows_q = shape.rows_q, rows_k = shape.rows_k;
  auto map = [&](CUtensorMap* m, const TensorView4d& t, int64_t rows, int64_t heads, int box_rows) {
    return encode_tensor_map(m, t, shape.tensors, rows, heads, kBFloat16, box_rows);
  };
  if (!map(&kp.q_map, params.q, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.k_map, params.k, rows_k, p.heads_kv, Cfg::kBlockN) ||
      !map(&kp.v_map, params.v, rows_k, p.heads_kv, Cfg::kBlockN) ||
      (Cfg::kOutThroughSmem && !map(&kp.out_map, params.out, rows_q, p.heads_q, 64))) {
    return false;
  }
  if (kMasked && !encode_mask_tiles(&kp.mask_map, &kp.mask, params.mask, kMaskElemBytes, p, Cfg::kBlockM)) {
    return false;
  }
  // Tiles that run together then read the mask's rows once from memory, not once
  // a head: at N = 16384 an (L, S) bfloat16 mask is 512 MiB, read 16 times at 16 heads.
  kp.heads_first = kMasked && kp.mask.rows_full && kp.mask.head_step == 0 && p.heads_q > 1;
  auto kernel = attention_forward_kernel<Elem, Cfg, kDropout, kMask, kWindow, kSoftcap, kAlibi, kVarlen>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  const int64_t m_blocks = ceil_div(p.len_q, Cfg::kBlockM);
  const int64_t tiles = (kVarlen ? params.packed.max_tile_pairs : m_blocks * p.batch) * p.heads_q;
  if (kVarlen && tiles == 0) return true;  // (no query in any sequence)
  if (tiles > kMaxTiles) return false;
  const int sms = multiprocessor_count();
  kp.tiles = static_cast<int>(tiles);
  const int64_t kv_bytes_per_head = p.len_k * p.head_dim * 2 * int64_t{sizeof(Elem)};  // K and V, streamed
  kp.order_chunks = heaviest_first_chunks(p.heads_q * p.batch, m_blocks, kv_bytes_per_head, sms);
  const int64_t blocks = std::min<int64_t>(tiles, sms);  // one block an SM (shared memory)
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
  return true;
}

// The masked instantiations' dispatch (flash_fwd_sm90_masked.cu): a call
// with an attn_mask and without dropout that forward_covers.
bool launch_masked_forward(const FwdParams& params, ElementType type, cudaStream_t stream);
// Head dim 256's dispatch (flash_fwd_sm90_hdim256.cu): a call of head dim
// 129 to 256 without an attn_mask that forward_covers.
bool launch_hdim256_forward(const FwdParams& params, ElementType type, cudaStream_t stream);
// A packed batch's dispatch (flash_fwd_sm90_varlen.cu): a call with params.packed
// that forward_covers.
bool launch_varlen_forward(const FwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
