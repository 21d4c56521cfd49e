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
// The roles' files: fwd_tile_scheduler.cuh (which tile next), fwd_producer.cuh
// (the copy engine's loads), fwd_mainloop.cuh (a consumer's tile, with
// fwd_score_modifiers.cuh and fwd_softmax.cuh), fwd_epilogue.cuh (the output's
// store); fwd_shared.cuh has what they share.
#pragma once

#include <algorithm>
#include <cmath>

#include "cuda/dropout_flags.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/sm90/descriptors.cuh"
#include "cuda/sm90/fwd_epilogue.cuh"
#include "cuda/sm90/fwd_mainloop.cuh"
#include "cuda/sm90/fwd_producer.cuh"
#include "cuda/sm90/fwd_shared.cuh"
#include "cuda/sm90/fwd_tile_scheduler.cuh"
#include "cuda/sm90/tile_config.h"
#include "cuda/tile_order.cuh"

// The kernel template and its launch, instantiated by flash_fwd_sm90.cu
// (no attn_mask) and flash_fwd_sm90_masked.cu, which compile in parallel.
namespace flashattn_ext::cuda::sm90 {
namespace forward_kernel {

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
  constexpr int kStages = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem_base = swizzle_aligned(smem_raw);
  FwdBuffers smem;
  smem.q = smem_base;
  smem.k = smem.q + Cfg::kQBytes;
  smem.v = smem.k + kStages * Cfg::kKBytes;
  smem.mask = smem.v + kStages * Cfg::kVBytes;
  auto* shared = reinterpret_cast<FwdSharedState<kStages>*>(smem.mask + kStages * Cfg::Mask::kBytes);
  static_assert(Cfg::kQBytes + kStages * (Cfg::kKBytes + Cfg::kVBytes + Cfg::Mask::kBytes) + sizeof(FwdSharedState<kStages>) +
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
    if constexpr (kDropout) shared->dropout = dropout_state(kp.call.dropout);
  }
  __syncthreads();

  if (warpgroup == 0) {
    // The producer warpgroup gives its registers to the consumers; one thread loads.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    produce_tiles<Cfg, kWindow, kVarlen>(kp, smem, shared);
    return;
  }

  // Consumers: each tile handed over (round r's in slot r % 2), its mainloop
  // and its output.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const FwdMainloop<Elem, Cfg, kDropout, kMask, kWindow, kSoftcap, kAlibi, kVarlen> mainloop(kp, smem, shared,
                                                                                              consumer);
  FwdEpilogue<FwdOutElem<Elem>, Cfg, kVarlen> epilogue{kp,       shared,        smem.k, consumer, mainloop.tid, mainloop.lane,
                                           mainloop.tile_row};
  for (int round = 0, kv = 0, q_round = 0;; ++round) {
    const int slot = round % 2;
    ptx::mbarrier_wait(&shared->tile_full[slot], (round / 2) & 1);
    const FwdTile t = shared->tile[slot];
    ptx::mbarrier_arrive(&shared->tile_empty[slot]);
    if (t.n_blocks == kNoTileLeft) {
      if (consumer == 0) mainloop.wait_turn();
      epilogue.hand_back_out_stage();  // shared memory must outlive the copy engine's reads
      break;
    }
    float o[Cfg::kHeadDimV / 2], inv_sum[2];
    mainloop.tile(t, kv, q_round, o, inv_sum, epilogue);
    epilogue.store(t, kv, o, inv_sum);
  }
#endif
}

// kCausal picks the tile shape (fwd_block_n); the kernel reads the call's
// causal flag and window from params. kHeadDimV: the values' (and the
// output's) head dim.
template <typename Elem, int kHeadDim, bool kCausal, bool kDropout, MaskKind kMask, bool kWindow = false,
          bool kSoftcap = false, bool kAlibi = false, bool kVarlen = false, int kHeadDimV = kHeadDim>
bool launch_forward(const FwdParams& params, cudaStream_t stream) {
  constexpr bool kMasked = kMask != MaskKind::kNone;
  constexpr int kMaskElemBytes = mask_elem_bytes(kMask);
  using Cfg = FwdTileConfig<kHeadDim, fwd_block_n(kHeadDim, kCausal, kMasked, kHeadDimV), kMaskElemBytes, kHeadDimV>;
  const AttentionProblem& p = params.problem;
  FwdKernelParams kp;
  kp.call = params;
  const MappedShape shape = mapped_shape(p, params.packed, std::max(Cfg::kBlockM, Cfg::kBlockN));
  if (!shape.fits) return false;
  const int64_t rows_q = shape.rows_q, rows_k = shape.rows_k;
  auto map = [&](CUtensorMap* m, const TensorView4d& t, int64_t cols, int64_t rows, int64_t heads, int box_rows) {
    return encode_tensor_map(m, t, cols, rows, heads, shape.tensors.batch, map_element<Elem>(), box_rows);
  };
  if (!map(&kp.q_map, params.q, p.head_dim, rows_q, p.heads_q, Cfg::kBlockM) ||
      !map(&kp.k_map, params.k, p.head_dim, rows_k, p.heads_kv, Cfg::kBlockN) ||
      !map(&kp.v_map, params.v, p.head_dim_v, rows_k, p.heads_kv, Cfg::kBlockN) ||
      (Cfg::kOutThroughSmem && !map(&kp.out_map, params.out, p.head_dim_v, rows_q, p.heads_q, 64))) {
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
  const int64_t kv_bytes_per_head = p.len_k * (p.head_dim + p.head_dim_v) * int64_t{sizeof(Elem)};  // K and V, streamed
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
// MLA's dispatch (flash_fwd_sm90_mla.cu): a call whose values' head dim is
// not the queries' that forward_covers (192 / 128, zero-padded).
bool launch_mla_forward(const FwdParams& params, ElementType type, cudaStream_t stream);
// A packed batch's dispatch (flash_fwd_sm90_varlen.cu): a call with params.packed
// that forward_covers.
bool launch_varlen_forward(const FwdParams& params, ElementType type, cudaStream_t stream);
// The e4m3 forward's launch (flash_fwd_sm90_fp8.cu): a call that fp8_forward_covers.
bool launch_fp8_forward(const Fp8FwdParams& params, cudaStream_t stream);

}  // namespace forward_kernel
}  // namespace flashattn_ext::cuda::sm90
