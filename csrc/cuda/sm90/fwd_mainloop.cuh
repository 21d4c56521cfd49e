// The Hopper forward's consumer mainloop: a consumer warpgroup's 64 query
// rows of a tile against its key tiles, with wgmma: S = Q K^T with both
// operands in shared memory, the score modifiers (fwd_score_modifiers.cuh),
// the online softmax in registers (fwd_softmax.cuh), dropout, and O += P V
// with P from registers. Each consumer overlaps its own work: the Q K^T of
// key tile j and the P V of tile j - 1 are in flight together while the
// softmax of tile j waits only for the first; and the consumers take turns to
// issue them (ping-pong), so that one's softmax hides under the others'
// GEMMs. Tiles that cross the causal diagonal, a window's edges or the end of
// the keys come last and are masked. With e4m3 operands (FwdFp8TileConfig)
// the GEMMs take k32 steps, V comes transposed, P is rounded to e4m3 and the
// descales enter the softmax's scale and the rows' 1 / sum.
#pragma once

#include <type_traits>

#include "cuda/dropout_flags.cuh"
#include "cuda/ptx.cuh"
#include "cuda/score_modifiers.cuh"
#include "cuda/sm90/accumulators.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/sm90/fwd_score_modifiers.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/sm90/fwd_softmax.cuh"
#include "cuda/sm90/tile_config.h"

namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

// The k extent of one wgmma: 16 for 16-bit elements, 32 for e4m3 (32 bytes
// of a K-major row either way).
template <typename Elem>
constexpr int kStepK = 32 / int(sizeof(Elem));
template <typename Elem>
constexpr bool kIsE4M3 = std::is_same_v<Elem, __nv_fp8_e4m3>;

// S = Q K^T over keys [kBegin, kEnd) of a tile, into those keys' registers of
// s (a narrower accumulator's layout is a prefix of the wider one's).
template <typename Elem, typename Cfg, int kBegin, int kEnd, int kRegs>
__device__ __forceinline__ void issue_score_keys(float (&s)[kRegs], uint64_t q_desc, uint64_t k_desc) {
  auto& s_keys = *reinterpret_cast<float(*)[(kEnd - kBegin) / 2]>(&s[kBegin / 2]);
  const uint64_t keys_desc = desc_advance(k_desc, kBegin * kSwizzleRowBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / kStepK<Elem>; ++kk) {
    ptx::wgmma_ss<Elem, kEnd - kBegin>(s_keys, desc_advance(q_desc, k_major_step_bytes(Cfg::kQColBlockBytes, kk)),
                                       desc_advance(keys_desc, k_major_step_bytes(Cfg::kKVColBlockBytes, kk)), kk > 0);
  }
}

// The probabilities of a key tile as A fragments: one per k step.
template <typename Elem, typename Cfg>
using ProbFragments = uint32_t[Cfg::kBlockN / kStepK<Elem>][4];

// O += P V over keys [kBegin, kEnd) of a tile: V N-major (16-bit), or
// transposed and K-major (e4m3: a k32 step is 32 bytes along its rows).
template <typename Elem, typename Cfg, int kBegin, int kEnd>
__device__ __forceinline__ void issue_pv_keys(float (&o)[Cfg::kHeadDimV / 2], const ProbFragments<Elem, Cfg>& pa,
                                              uint64_t v_desc) {
  constexpr int kStep = kStepK<Elem>;
#pragma unroll
  for (int kk = kBegin / kStep; kk < kEnd / kStep; ++kk) {
    if constexpr (Cfg::kValuesTransposed) {
      constexpr int kStepsInBlocks = Cfg::kColBlocksV * Cfg::kColBlockCols / kStep;
      if (kk < kStepsInBlocks) {
        ptx::wgmma_rs<Elem, Cfg::kHeadDimV>(
            o, pa[kk], desc_advance(v_desc, k_major_step_bytes(Cfg::kVtColBlockBytes, kk)), true);
      } else {  // the tail's 64-byte rows
        const uint64_t tail_desc = as_swizzle64_k_major(desc_advance(v_desc, Cfg::kVtTailOffset));
        ptx::wgmma_rs<Elem, Cfg::kHeadDimV>(o, pa[kk], desc_advance(tail_desc, (kk - kStepsInBlocks) * 32), true);
      }
    } else {
      ptx::wgmma_rs<Elem, Cfg::kHeadDimV, 1>(o, pa[kk], desc_advance(v_desc, n_major_step_bytes(kk)), true);
    }
  }
}

// The probabilities s rounded to A fragments.
template <typename Elem, int kRegs, int kSteps>
__device__ __forceinline__ void to_prob_fragments(const float (&s)[kRegs], uint32_t (&frags)[kSteps][4]) {
  if constexpr (kIsE4M3<Elem>) {
    to_e4m3_fragments(s, frags);
  } else {
    to_fragments<Elem>(s, frags);
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
__device__ __forceinline__ void issue_pv(float (&o)[Cfg::kHeadDimV / 2], const ProbFragments<Elem, Cfg>& pa,
                                         uint64_t v_desc) {
  ptx::wgmma_fence();
  issue_pv_keys<Elem, Cfg, 0, kKeys>(o, pa, v_desc);
  ptx::wgmma_commit();
}

// A consumer thread's view of the kernel: its rows, its descriptors of the
// stages, the ring's barriers, its turns, and the mainloop of a tile (tile).
template <typename Elem, typename Cfg, bool kDropout, MaskKind kMask, bool kWindow, bool kSoftcap, bool kAlibi,
          bool kVarlen>
struct FwdMainloop {
  static_assert(!kIsE4M3<Elem> || (!kDropout && !Cfg::Mask::kPresent && !kSoftcap && !kAlibi && !kVarlen),
                "e4m3 operands: no dropout, attn_mask, softcap, ALiBi or packed batch (yet)");
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  static constexpr int kKeyRegs = kBlockN / 2;           // a thread's share of its warpgroup's 64 x kBlockN scores
  static constexpr int kOutRegs = Cfg::kHeadDimV / 2;    // and of its 64 x kHeadDimV output
  // Ping-pong: the consumers take turns, in order, to issue a tile's two GEMMs
  // (named barrier 1 + c is consumer c's turn; the one before grants it), so
  // that one's softmax runs while the tensor cores work for the others. The
  // order runs on across tiles (a consumer that is done with a tile must not
  // take two turns before the next one's last): consumer 0 grants itself the
  // first turn (at construction), and takes one more at the end that no GEMM
  // follows, so every arrival is waited for.
  static constexpr int kTurnThreads = 2 * kWarpgroupThreads;  // the waiting consumer and the granting one

  const FwdKernelParams& kp;
  FwdSharedState<kStages>* const shared;
  const int consumer, tid, lane;
  // This thread's two query rows in the tile: r and r + 8.
  const int tile_row;
  // Descriptors of this warpgroup's 64 rows of Q, of stage 0's K (both
  // K-major) and V (N-major), at their first k16 step; a stage and a step move
  // them by constant offsets.
  const uint64_t q_tile_desc, k_tile_desc, v_tile_desc;
  const FwdScoreModifiers<Elem, Cfg, kMask, kSoftcap> modifiers;

  __device__ __forceinline__ FwdMainloop(const FwdKernelParams& kp, const FwdBuffers& smem,
                                         FwdSharedState<kStages>* shared, int consumer)
      : kp(kp),
        shared(shared),
        consumer(consumer),
        tid(threadIdx.x % kWarpgroupThreads),
        lane(tid % kWarpSize),
        tile_row(consumer * 64 + (tid / kWarpSize) * 16 + lane / 4),
        q_tile_desc(k_major_desc(ptx::smem_addr(smem.q) + consumer * 64 * kSwizzleRowBytes)),
        k_tile_desc(k_major_desc(ptx::smem_addr(smem.k))),
        v_tile_desc(Cfg::kValuesTransposed ? k_major_desc(ptx::smem_addr(smem.v))
                                           : n_major_desc(ptx::smem_addr(smem.v), Cfg::kKVColBlockBytes)),
        modifiers(kp, smem.mask, tile_row, lane) {
    if (consumer == 0) ptx::named_barrier_arrive(1, kTurnThreads);
  }

  __device__ __forceinline__ void wait_turn() const { ptx::named_barrier_sync(1 + consumer, kTurnThreads); }
  __device__ __forceinline__ void grant_turn() const {
    ptx::named_barrier_arrive(1 + (consumer + 1) % Cfg::kConsumers, kTurnThreads);
  }

  // kv: the K/V tile's place in the ring (see produce_tiles).
  __device__ __forceinline__ void wait_k(int kv) const {
    ptx::mbarrier_wait(&shared->k_full[kv % kStages], (kv / kStages) & 1);
  }
  __device__ __forceinline__ void wait_v(int kv) const {
    ptx::mbarrier_wait(&shared->v_full[kv % kStages], (kv / kStages) & 1);
  }
  __device__ __forceinline__ void release_v(int kv) const { ptx::mbarrier_arrive(&shared->v_empty[kv % kStages]); }
  // Where stage kv % kStages's K or V tile starts.
  __device__ __forceinline__ uint64_t k_stage_desc(int kv) const {
    return desc_advance(k_tile_desc, (kv % kStages) * Cfg::kKBytes);
  }
  __device__ __forceinline__ uint64_t v_stage_desc(int kv) const {
    return desc_advance(v_tile_desc, (kv % kStages) * Cfg::kVBytes);
  }
  // The key block of the kv-th K/V tile, the index-th of its query tile's;
  // read after K's wait and before its release.
  __device__ __forceinline__ StageBlock stage_block(int kv, int index, int first_block) const {
    if constexpr (Cfg::Mask::kPresent) {
      const int code = shared->stage_block[kv % kStages];
      return StageBlock{code / 2, code % 2 != 0};
    } else {
      return StageBlock{first_block + index, false};
    }
  }

  // Dropout on the rounded probabilities `frags` of key tile n_block (of its
  // first kKeys keys) of tile t: after the softmax, whose row sums count every
  // probability, and before P V; the kept ones are scaled with the output. Two
  // 16-key blocks a step (dropout_block_pair_flags), each 16-bit probability
  // ANDed with its mask.
  template <int kBlocks>
  __device__ __forceinline__ void apply_dropout(uint32_t (&frags)[kBlocks][4], const FwdTile& t, int64_t row0,
                                                int n_block) const {
    const AttentionProblem& p = kp.call.problem;
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
  }

  // The tile t's mainloop, its K/V tiles from the kv-th of the ring on (kv
  // moves past them; q_round counts the tiles with keys, whose Q loads): o
  // gets its rows' output, unnormalized, and inv_sum their factors (1 / sum,
  // times dropout's 1 / (1 - p)); the log-sum-exp is written. Between its
  // first Q K^T's issue and its wait, epilogue.hand_back_out_stage() frees
  // the previous tile's output buffer.
  template <typename Epilogue>
  __device__ __forceinline__ void tile(const FwdTile& t, int& kv, int& q_round, float (&o)[kOutRegs],
                                       float (&inv_sum)[2], Epilogue& epilogue) const {
    const FwdParams& params = kp.call;
    const AttentionProblem& p = params.problem;
    const int64_t row0 = t.row0;
    // The tile's sequence's lengths, and the keys each of its queries sees
    // (the causal diagonal, the window).
    const int64_t len_q = kVarlen ? t.len_q : p.len_q, len_k = kVarlen ? t.len_k : p.len_k;
    const Visibility seen(p, len_q, len_k);
    const FwdTileModifiers<Cfg, kWindow, kAlibi> tile_modifiers{
        p,    seen, row0, len_k, tile_row, lane, modifiers.scale_log2,
        kAlibi ? alibi_slope_log2(p, t.batch, t.head) : 0.f};
    const int first_block = kWindow ? t.first_block : 0, n_blocks = t.n_blocks;

    // Frees the K of the tile's index-th key tile; its last Q K^T is its last
    // read of Q: the next tile's may load.
    auto release_k = [&](int index) {
      ptx::mbarrier_arrive(&shared->k_empty[(kv + index) % kStages]);
      if (index == n_blocks - 1) ptx::mbarrier_arrive(&shared->q_empty);
    };
    // The scores of the kv-th K/V tile, key block `block`, as the softmax takes them.
    auto modify_scores = [&](auto& s, int kv_index, const StageBlock& block) {
      modifiers.cap(s);
      tile_modifiers.add_alibi(s, block.n_block);
      modifiers.apply_stage_mask(s, kv_index, block);
    };
    // e4m3: the scores and the output times their operands' descales (per
    // batch and key/value head), the scores' in the softmax's scale.
    float qk_descale = 1.f, v_descale = 1.f;
    if constexpr (kIsE4M3<Elem>) {
      const int64_t pair = int64_t(t.batch) * p.heads_kv + t.kv_head;
      qk_descale = kp.q_descale[pair] * kp.k_descale[pair];
      v_descale = kp.v_descale[pair];
    }
    FwdOnlineSoftmax<kIsE4M3<Elem>> softmax{modifiers.softmax_scale(kSoftcap || kAlibi) * qk_descale};
    // ((batch, heads_q, len_q); a packed batch's (heads_q, total_q).)
    auto finish_rows = [&] {
      float* lse = static_cast<float*>(params.lse) +
                   (kVarlen ? t.head * params.packed.total_q + t.q_start : (t.batch * p.heads_q + t.head) * p.len_q);
      softmax.finish(inv_sum, kDropout ? shared->dropout.keep_scale : 1.f, lse, row0 + tile_row, len_q, lane);
      if constexpr (kIsE4M3<Elem>) inv_sum[0] *= v_descale, inv_sum[1] *= v_descale;
    };

#pragma unroll
    for (int i = 0; i < kOutRegs; ++i) o[i] = 0.f;

    if (n_blocks > 0) {
      // The keys of the tile's last key tile: their GEMMs run narrow where
      // they fit (not in a first tile: a call of a few keys).
      const int last_keys =
          static_cast<int>(seen.key_end_of_rows(row0, kBlockM) - int64_t(first_block + n_blocks - 1) * kBlockN);
      const int last_width = !Cfg::kNarrowLastTile || n_blocks == 1 ? kBlockN
                             : last_keys <= Cfg::kNarrowKeys0     ? Cfg::kNarrowKeys0
                             : last_keys <= Cfg::kNarrowKeys1     ? Cfg::kNarrowKeys1
                                                                  : kBlockN;
      using Whole = std::integral_constant<int, kBlockN>;
      using Narrow0 = std::integral_constant<int, Cfg::kNarrowKeys0>;
      using Narrow1 = std::integral_constant<int, Cfg::kNarrowKeys1>;
      ptx::mbarrier_wait(&shared->q_full, q_round++ & 1);
      ProbFragments<Elem, Cfg> pa;
      {
        float s[kKeyRegs];
        wait_k(kv);
        const StageBlock block = stage_block(kv, 0, first_block);
        issue_scores<Elem, Cfg, kBlockN>(s, q_tile_desc, k_stage_desc(kv));
        epilogue.hand_back_out_stage();
        ptx::wgmma_wait<0>();
        fence_registers(s);
        modify_scores(s, kv, block);
        release_k(0);
        if (tile_modifiers.needs_mask(block.n_block)) tile_modifiers.mask(s, block.n_block);
        float rescale[2];
        softmax.step(s, rescale);
        to_prob_fragments<Elem>(s, pa);
        if constexpr (kDropout) apply_dropout(pa, t, row0, block.n_block);
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
        modify_scores(s, kv + index, block);
        release_k(index);
        // The softmax sits in the branches of its own if: the compiler schedules
        // each basic block on its own, and in one shared with the wait for P V
        // below it hoists that wait (a free instruction to it) above the
        // softmax, which then no longer runs under P V.
        float rescale[2];
        bool rescale_o;
        if (kKeys < kBlockN || tile_modifiers.needs_mask(block.n_block)) {
          tile_modifiers.mask(s, block.n_block);
          rescale_o = softmax.step(s, rescale);
        } else {
          rescale_o = softmax.step(s, rescale);
        }
        ptx::wgmma_wait<0>();
        fence_registers(o);
        release_v(kv + index - 1);
        if (rescale_o) scale_rows(o, rescale);
        auto& probs = *reinterpret_cast<uint32_t(*)[kKeys / kStepK<Elem>][4]>(&pa);
        to_prob_fragments<Elem>(s, probs);
        if constexpr (kDropout) apply_dropout(probs, t, row0, block.n_block);
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
  }
};

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
