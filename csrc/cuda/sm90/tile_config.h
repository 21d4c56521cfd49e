// Every tile shape and pipeline depth of the Hopper (sm_90a) kernels, in one place.
#pragma once

#include "cuda/dq_accum.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"

namespace flashattn_ext::cuda::sm90 {

constexpr int kWarpgroupThreads = 128;  // four warps: the unit that issues wgmma

// The bytes of an attn_mask element in shared memory: 1 for a bool mask, 2 for
// an additive one (the inputs' 16-bit type), 0 without a mask.
constexpr int mask_elem_bytes(MaskKind kind) {
  return kind == MaskKind::kBool ? 1 : kind == MaskKind::kAdditive ? 2 : 0;
}

// Shared-memory tiles are stored as column blocks of 64 16-bit elements (128
// bytes a row, the width of the copy engine's 128-byte swizzle), one after
// another, so every wgmma operand is a canonical 128-byte-swizzled layout.
constexpr int kSwizzleCols = 64;
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;  // 8 rows: the swizzle pattern's period
// Where 16-byte chunk `chunk` (8 elements) of row `row` lies in such a tile,
// its column blocks kColBlockBytes apart: the swizzle puts chunk c of row r
// at chunk c ^ (r % 8) of the row.
template <int kColBlockBytes>
__device__ __forceinline__ int swizzled_chunk_offset(int row, int chunk) {
  return (chunk / 8) * kColBlockBytes + row * kSwizzleRowBytes + ((chunk % 8) ^ (row % 8)) * 16;
}

// An attn_mask's tile of a stage, as both kernels stage it beside their
// streamed tiles: kRows query rows (only the first used where the mask
// repeats over queries) x kKeys keys, stored as blocks of 128-byte rows
// (kColBlockCols keys each), 128-byte swizzled like the other tiles.
// kElemBytes: the mask's element size (mask_elem_bytes), 0 without a mask:
// no tile.
template <int kRows, int kKeys, int kElemBytes_>
struct MaskTile {
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr bool kPresent = kElemBytes > 0;
  static constexpr int kColBlockCols = kPresent ? kSwizzleRowBytes / kElemBytes : 1;
  static constexpr int kColBlocks = kPresent ? kKeys / kColBlockCols : 0;
  static constexpr int kBytes = kRows * kKeys * kElemBytes;  // room for a whole tile
  static_assert(!kPresent || kKeys % kColBlockCols == 0, "whole mask column blocks");
};

// Keys per streamed K/V tile of the forward: 176 at head dim 128 without the
// causal mask or an attn_mask (FlashAttention-3's choice: the per-tile costs,
// the consumers' turn barrier, the row max and the rescale of O, spread over
// more keys), else 128 (causal: the masked diagonal tiles stay narrow; an
// attn_mask: its tile stages beside K and V, and 128 keys are whole 128-byte
// rows of its shared-memory layout). At head dim 256, 80: two stages of K and
// V beside Q then fill shared memory, and the output (128 registers a thread)
// leaves room for 40 score registers only. At head dim 192 with values of
// 128 (MLA's prefill), 128: two stages fit, and the output takes 64.
constexpr int fwd_block_n(int head_dim, bool causal, bool masked, int head_dim_v) {
  return head_dim > 128 ? (head_dim_v <= 128 ? 128 : 80) : head_dim > 64 && !causal && !masked ? 176 : 128;
}

// Whether the Hopper kernels take the call's values' head dim: the queries'
// own, or MLA's prefill (queries and keys of 136 to 192, values of 72 to 128,
// run as 192 / 128) without an attn_mask, dropout, softcap, ALiBi or a packed
// batch (a window is fine). Forward and backward (FwdParams, BwdParams) take
// the same calls.
template <typename Params>
bool values_head_dim_covered(const Params& params) {
  const AttentionProblem& p = params.problem;
  return p.head_dim_v == p.head_dim ||
         (p.head_dim > 128 && p.head_dim <= 192 && p.head_dim_v > 64 && p.head_dim_v <= 128 &&
          params.mask_kind == MaskKind::kNone && params.dropout.p == 0.0 && p.softcap == 0.0 &&
          p.alibi_slopes == nullptr && !params.packed.present());
}

// The forward: one producer warpgroup loads Q once and streams K and V tiles
// through a ring of kStages shared-memory stages; kConsumers warpgroups of 64
// query rows each compute on them.
// kMaskElemBytes: the attn_mask's element size (1: bool, 2: additive, in the
// inputs' dtype), 0 without one.
template <int kHeadDim_, int kBlockN_, int kMaskElemBytes_ = 0, int kHeadDimV_ = kHeadDim_>
struct FwdTileConfig {
  // Of queries and keys: 64, 128, 192 (with values of 128) or 256; smaller
  // head dims read as zero-padded. Of values and the output: the same, or 128.
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
  // Three consumers at head dim 64, where the softmax's exp2 costs as much as
  // the two GEMMs: with three taking turns, two hide the third's softmax.
  static constexpr int kConsumers = kHeadDim <= 64 ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumers;  // query rows per tile
  static constexpr int kBlockN = kBlockN_;  // keys per streamed tile
  // A row block's last key tile, where it holds fewer keys (len_k not a
  // multiple of kBlockN), runs its two GEMMs over its first 48 or 112 keys
  // where those hold them all: the last tile of 2048 or 4096 keys (112 or 48
  // of 176) then does its keys' work only.
  static constexpr bool kNarrowLastTile = kBlockN == 176;
  static constexpr int kNarrowKeys0 = 48, kNarrowKeys1 = 112;
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  // setmaxnreg: the producer gives its registers to the consumers. The
  // consumers can take only what the producer gave back from the block's launch
  // allocation (the same for every thread: 168 and 128 registers, so that 384
  // and 512 threads fit in 64K), else their setmaxnreg.inc waits forever:
  // (168 - 24) * 128 = (240 - 168) * 256 and (128 - 32) * 128 = (160 - 128) * 384.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;

  static constexpr int kColBlockCols = kSwizzleCols;           // elements of a 128-byte row
  static constexpr bool kValuesTransposed = false;              // V as loaded: (keys, head dim), N-major in P V
  static constexpr int kColBlocks = kHeadDim / kSwizzleCols;    // of Q and K
  static constexpr int kColBlocksV = kHeadDimV / kSwizzleCols;  // of V and the output
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;   // one K tile
  static constexpr int kVBytes = kBlockN * kHeadDimV * 2;  // one V tile
  static constexpr int kQColBlockBytes = kBlockM * kSwizzleRowBytes;
  static constexpr int kKVColBlockBytes = kBlockN * kSwizzleRowBytes;
  // The attn_mask's tile of a stage, for K's scores: read with K and freed with it.
  using Mask = MaskTile<kBlockM, kBlockN, kMaskElemBytes_>;
  // Q, then K and V of every stage, the mask tiles, then the mbarriers and the
  // scheduler's tile slots; the tiles 1024-byte aligned (the swizzle pattern
  // repeats every 1024 bytes), plus slack to align the base. Three stages
  // where they fit (not with 176-key tiles at head dim 128, nor with a mask
  // at head dim 128, nor at 256).
  static constexpr int kStageBytes = kKBytes + kVBytes + Mask::kBytes + 5 * 8;  // K, V, the mask, five mbarriers
  static constexpr int kFixedBytes = kQBytes + 192 + 1024;   // Q, its 2 mbarriers, the tile slots (4 mbarriers, 2 x 10 ints), dropout's state, the slack
  static constexpr int kStages = kFixedBytes + 3 * kStageBytes <= 227 * 1024 ? 3 : 2;
  static constexpr int kSmemBytes = kFixedBytes + kStages * kStageBytes;
  // Whether a tile's output fits in one K buffer, through which the copy engine
  // stores it (at head dim 128; at 64 and 256 it does not, and each thread
  // stores its registers).
  static constexpr bool kOutThroughSmem = kBlockM * kHeadDimV * 2 <= kKBytes;
  static_assert(kHeadDim % kSwizzleCols == 0 && kHeadDimV % kSwizzleCols == 0, "whole 64-column blocks");
  static_assert(kHeadDimV == kHeadDim || (kHeadDim == 192 && kHeadDimV == 128), "values' head dim: the same, or MLA's");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
};

// The FP8 (e4m3) forward at head dim 128 (attention_forward_fp8): the same
// kernel and roles as FwdTileConfig's, with 1-byte Q, K and V. A 128-byte
// swizzled row then holds 128 elements, so Q and K are one column block, and
// a wgmma k32 step is 32 bytes, as a 16-bit k16 step is (k_major_step_bytes
// holds). 8-bit wgmma reads only K-major operands, so V comes transposed
// (fp8_transpose_values: (head dim, keys) rows, keys permuted within each 32,
// see there) and P V reads a tile of it as a K-major B of kHeadDimV rows x
// kBlockN keys: one 128-byte column block at 128 keys; at 192 keys (longer
// tiles spread each tile's fixed cost over more exps, as FA3's e4m3 tiles of
// 224 keys do) a column block and the last 64 keys in 64-byte swizzled rows.
// The output (bfloat16) leaves from registers: a K buffer (1 byte an element)
// does not hold it.
template <int kHeadDim_, int kBlockN_>
struct FwdFp8TileConfig {
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDim_;
  static_assert(kHeadDim == 128, "head dim 128: whole 128-byte rows of e4m3");
  static constexpr int kConsumers = 2;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN == 128 || kBlockN == 192, "whole 128-byte column blocks of the transposed values, or one and a half");
  static constexpr bool kNarrowLastTile = false;
  static constexpr int kNarrowKeys0 = kBlockN, kNarrowKeys1 = kBlockN;
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kColBlockCols = kSwizzleRowBytes;  // 1-byte elements
  static constexpr bool kValuesTransposed = true;
  static constexpr int kColBlocks = kHeadDim / kColBlockCols;        // of Q and K
  static constexpr int kColBlocksV = kBlockN / kColBlockCols;        // of a transposed V tile (its keys)
  static constexpr int kVtTailKeys = kBlockN % kColBlockCols;        // after them, in 64-byte rows
  static constexpr int kQBytes = kBlockM * kHeadDim;
  static constexpr int kKBytes = kBlockN * kHeadDim;
  static constexpr int kVBytes = kBlockN * kHeadDimV;
  static constexpr int kQColBlockBytes = kBlockM * kSwizzleRowBytes;
  static constexpr int kKVColBlockBytes = kBlockN * kSwizzleRowBytes;  // of K
  static constexpr int kVtColBlockBytes = kHeadDimV * kSwizzleRowBytes;  // of a transposed V tile
  static constexpr int kVtTailOffset = kColBlocksV * kVtColBlockBytes;  // where its tail starts
  using Mask = MaskTile<kBlockM, kBlockN, 0>;
  static constexpr int kStageBytes = kKBytes + kVBytes + 5 * 8;
  static constexpr int kFixedBytes = kQBytes + 192 + 1024;
  static constexpr int kStages = 4;  // 32 (48) KiB a stage at 128 (192) keys: four fit
  static constexpr int kSmemBytes = kFixedBytes + kStages * kStageBytes;
  static constexpr bool kOutThroughSmem = false;
  static_assert(kBlockN % 32 == 0, "whole 32-key groups (the permutation of the transposed values)");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
};

// The backward: one block per (kBlockN keys, key/value head, batch). The
// producer warpgroup loads K and V once and streams Q and dO tiles of every
// query head of the group through kStages stages; kConsumers warpgroups of 64
// keys each keep their dK and dV in registers, and each computes one 64 x 64
// block of every tile's dQ = dS K from the dS^T of both.
// kMaskElemBytes: the attn_mask's element size (1: bool, 2: additive), 0
// without one.
template <int kHeadDim_, int kMaskElemBytes_ = 0>
struct BwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;  // 64 or 128
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64 * kConsumers;  // keys per block
  // Queries per streamed tile: 128 at head dim 64, where a tile's GEMMs are
  // small next to its softmax, barriers and waits (64 at 128: registers).
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;
  // The consumers' dQ blocks tile the kBlockM x kHeadDim dQ of a tile: consumer
  // c has row block c % kDqRowBlocks and column block c / kDqRowBlocks.
  static constexpr int kDqRowBlocks = kBlockM / 64;
  static constexpr int kDqBlockFloats = 64 * kDqAccumSliceCols;  // one consumer's dQ of one tile
  static constexpr int kStages = 2;
  // The attn_mask's tile of a stage, for its queries' scores: loaded with Q and freed with it.
  using Mask = MaskTile<kBlockM, kBlockN, kMaskElemBytes_>;
  // dQ block buffers of each consumer for the bulk reduce: with two, the copy
  // engine has a whole tile's time to read one (one where shared memory is
  // short: 128-query tiles, or room for the mask tiles).
  static constexpr int kDqBuffers = kBlockM > 64 || Mask::kPresent ? 1 : 2;
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kColBlocks = kHeadDim / kSwizzleCols;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q or dO tile
  // (As the producer names them where values have another head dim: BwdSplitTileConfig.)
  static constexpr int kColBlocksV = kColBlocks, kKBytes = kKVBytes, kVBytes = kKVBytes, kDoBytes = kQBytes;
  static constexpr int kDqAccumCols = kHeadDim;  // dq_accum's floats a row
  // One dS^T buffer: kBlockN rows (keys) of kBlockM queries, in blocks of 64 columns.
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kKVColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kQColBlockBytes = kBlockM * kSwizzleRowBytes;
  static constexpr int kStatsBytes = kStages * 2 * kBlockM * 4;  // lse and delta of each stage's queries
  // The mbarriers, the stages' query tiles (12 bytes each, 16 kept) and dropout's state (BwdBarriers).
  static constexpr int kBarrierBytes = 8 * (1 + 4 * kStages) + 16 * kStages + 32;
  // K, V, the stages of Q, dO and the mask, the dQ blocks, the stats and the
  // barriers; then the dS^T buffers. The base is 1024-byte aligned (the
  // kernel's __align__), so no slack: with it, a bool mask's 128-query tiles
  // at head dim 64 would not fit (they fit with 888 bytes to spare).
  static constexpr int kSmemBytesBeforeDs = 2 * kKVBytes + kStages * (2 * kQBytes + Mask::kBytes) +
                                            kConsumers * kDqBuffers * kDqBlockFloats * 4 + kStatsBytes + kBarrierBytes;
  // dS^T buffers: with two, tile t's is written while the other consumer may
  // still read t - 1's (see the kernel's kDsReady); one where two do not fit
  // (an additive mask's 128-query tiles at head dim 64), written once both
  // consumers are done with the last (kDsFree).
  static constexpr int kDsBuffers = kSmemBytesBeforeDs + 2 * kDsBytes <= 227 * 1024 ? 2 : 1;
  static constexpr int kSmemBytes = kSmemBytesBeforeDs + kDsBuffers * kDsBytes;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
  static_assert(kHeadDim % kSwizzleCols == 0 && kBlockM % kSwizzleCols == 0, "whole 64-column blocks");
  static_assert(kDqRowBlocks * (kHeadDim / kDqAccumSliceCols) == kConsumers, "one dQ block a consumer");
};

// The backward at head dim 256, where a consumer cannot keep both dK and dV
// of 64 keys in registers (256 registers a thread): one block per kBlockN =
// 64 keys, and both consumers on the same keys, each with half of the columns
// of dK, dV and dQ. Consumer 0 computes S^T = K Q^T and P^T, consumer 1 dP^T
// = V dO^T and dS^T; they hand P^T and dS^T to each other through shared
// memory. dQ goes to dq_accum by float32 atomics from registers (no room for
// its blocks).
template <int kHeadDim_>
struct BwdSplitTileConfig {
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDim_;  // of Q and K; of V and dO
  static_assert(kHeadDim == 256, "head dim 256");
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64;  // keys per block
  static constexpr int kBlockM = 64;  // queries per streamed tile
  static constexpr int kDkCols = kHeadDim / kConsumers;    // a consumer's columns of dK
  static constexpr int kDvCols = kHeadDimV / kConsumers;   // and of dV
  static constexpr int kDqSlices = kHeadDim / kDqAccumSliceCols;
  __device__ static constexpr int dk_col0(int consumer) { return consumer * (kHeadDim - kDkCols); }
  __device__ static constexpr int dq_slice0(int consumer) { return consumer * (kDqSlices / 2); }
  // dq_accum's floats a row: dispatch_head_dim runs head dims past 128 as 256.
  static constexpr int kDqAccumCols = dq_accum_cols(256);
  static constexpr int kStages = 2;
  static constexpr int kDsBuffers = 2;  // as in BwdTileConfig
  using Mask = MaskTile<kBlockM, kBlockN, 0>;  // no attn_mask
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kColBlocks = kHeadDim / kSwizzleCols, kColBlocksV = kHeadDimV / kSwizzleCols;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kHeadDimV * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kDoBytes = kBlockM * kHeadDimV * 2;  // a stage's tiles
  // The P^T buffer and each dS^T buffer: kBlockN rows (keys) of kBlockM queries, one 64-column block.
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kKVColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kQColBlockBytes = kBlockM * kSwizzleRowBytes;
  static constexpr int kStatsBytes = kStages * 2 * kBlockM * 4;  // lse and delta of each stage's queries
  // The mbarriers, the stages' query tiles (12 bytes each, 16 kept) and dropout's state (BwdBarriers).
  static constexpr int kBarrierBytes = 8 * (1 + 4 * kStages) + 16 * kStages + 32;
  // K, V, the stages of Q and dO, P^T, the dS^T buffers, the stats, the barriers; slack to align the base.
  static constexpr int kSmemBytes = kKBytes + kVBytes + kStages * (kQBytes + kDoBytes) +
                                    (1 + kDsBuffers) * kDsBytes + kStatsBytes + kBarrierBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
  static_assert(kBlockM == kSwizzleCols && kBlockM == kDqAccumRowMultiple,
                "a tile: one dS^T column block, one dq_accum tile");
  static_assert(kDkCols <= kHeadDim && 2 * kDkCols >= kHeadDim && kDvCols % kSwizzleCols == 0,
                "dK's columns covered by the two consumers', dV's split in whole column blocks");
};

// The backward at MLA's head dims, queries and keys of 192 with values of 128
// (flash_bwd_sm90_mla.cu; FlashAttention-4's tiles for them): one block per
// kBlockN = 96 keys, each consumer with 48 of them, against streamed tiles of
// 64 queries. A consumer computes its scores with the queries as rows (S = Q
// K^T, 64 x 48: wgmma's M is 64, so 48 keys cannot be the rows) and keeps dK
// and dV transposed (head dim x 48 keys): 72 + 48 registers a thread, beside
// 24 + 24 of S and dP (dK of 48 keys by rows would take 96 + 64). P^T and
// dS^T go through shared memory, as dV^T += dO^T P and dK^T += Q^T dS read
// them (B operands, K-major: rows of 64 queries, a key a row) and dQ = dS K
// reads dS^T (A, M-major). dQ's three 64-column slices: one for consumer 0,
// two for consumer 1, each added to dq_accum by atomics.
struct BwdMlaTileConfig {
  static constexpr int kHeadDim = 192, kHeadDimV = 128;  // of Q and K; of V and dO
  static constexpr int kConsumers = 2;
  static constexpr int kConsumerKeys = 48;
  static constexpr int kBlockN = kConsumers * kConsumerKeys;  // keys per block
  static constexpr int kBlockM = 64;                          // queries per streamed tile
  static constexpr int kDqSlices = kHeadDim / kDqAccumSliceCols;
  __device__ static constexpr int dq_slice0(int consumer) { return consumer; }
  __device__ static constexpr int dq_slice_count(int consumer) { return consumer == 0 ? 1 : kDqSlices - 1; }
  static constexpr int kMostDqSlices = kDqSlices - 1;
  // dq_accum's floats a row: dispatch_head_dim runs head dims past 128 as 256.
  static constexpr int kDqAccumCols = dq_accum_cols(256);
  static constexpr int kStages = 2;
  static constexpr int kDsBuffers = 2;  // tile t's dS^T is written while the other consumer may read t - 1's
  using Mask = MaskTile<kBlockM, kBlockN, 0>;  // no attn_mask
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static constexpr int kColBlocks = kHeadDim / kSwizzleCols, kColBlocksV = kHeadDimV / kSwizzleCols;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kHeadDimV * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kDoBytes = kBlockM * kHeadDimV * 2;  // a stage's tiles
  // The P^T buffer and each dS^T buffer: kBlockN rows (keys) of kBlockM queries, one 64-column block.
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kKVColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kQColBlockBytes = kBlockM * kSwizzleRowBytes;
  static constexpr int kConsumerRowBytes = kConsumerKeys * kSwizzleRowBytes;  // a consumer's rows of K, V, P^T, dS^T
  static constexpr int kStatsBytes = kStages * 2 * kBlockM * 4;  // lse and delta of each stage's queries
  // The mbarriers, the stages' query tiles (12 bytes each, 16 kept) and dropout's state (BwdBarriers).
  static constexpr int kBarrierBytes = 8 * (1 + 4 * kStages) + 16 * kStages + 32;
  // K, V, the stages of Q and dO, P^T, the dS^T buffers, the stats, the barriers; slack to align the base.
  static constexpr int kSmemBytes = kKBytes + kVBytes + kStages * (kQBytes + kDoBytes) +
                                    (1 + kDsBuffers) * kDsBytes + kStatsBytes + kBarrierBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
  static_assert(kBlockM == kSwizzleCols && kBlockM == kDqAccumRowMultiple,
                "a tile: one P^T / dS^T column block, one dq_accum tile");
  static_assert(kConsumerRowBytes % kSwizzleAtomBytes == 0, "a consumer's rows start a swizzle period");
};

// The decode kernel (decode_sm90_kernel.cuh), for caches of kCacheBytes-byte
// elements: the queries' dtype (2), or float8 e4m3 (1). kKeysAsRows (FP8, up
// to 8 query rows an item): the keys are the mma's 16 rows and the query rows
// its 8 columns (S^T = K Q^T, O^T = V^T P^T), not the other way round: at
// GQA 32:8 with one query token, 4 of 16 mma rows were queries, and the
// tensor work and the accumulators of the other 12 bound the FP8 kernel.
template <int kHeadDim_, int kRowGroups_, int kCacheBytes_ = 2, bool kKeysAsRows_ = false>
struct DecodeTileConfig {
  static constexpr int kHeadDim = kHeadDim_;  // of keys and values
  static constexpr int kCacheBytes = kCacheBytes_;
  static constexpr bool kFp8Cache = kCacheBytes == 1;
  static constexpr bool kKeysAsRows = kKeysAsRows_;
  static_assert(!kKeysAsRows || (kFp8Cache && kRowGroups_ == 1), "keys as rows: FP8, one row group");
  // The item's query rows: one 16-row mma tile a row group of consumer warps
  // (two for several query tokens of a GQA group: 8 tokens of 4 heads), or
  // with kKeysAsRows the 8 columns of one.
  static constexpr int kRowGroups = kRowGroups_;
  static constexpr int kRows = kKeysAsRows ? kDecodeTileRows / 2 : kRowGroups * kDecodeTileRows;
  // A row group's warps, 16 pairs of every tile each. An FP8 cache's tile
  // takes half the time to arrive, and one warp an SM sub-partition would
  // leave the tensor cores' and the conversions' latencies unhidden (one
  // row group of 4 warps read at 3.0 TB/s on an H200 where 16-bit caches
  // read at 4.5): eight warps, two a sub-partition, as two row groups have.
  static constexpr int kKeyWarps = kFp8Cache && kRowGroups == 1 ? 8 : 4;
  static constexpr int kConsumers = kKeyWarps * kRowGroups;
  static constexpr int kThreads = (kConsumers + 1) * kWarpSize;  // and the producer warp
  // (key, key/value head) pairs of a stage: 16 a key warp (keys of the
  // item's heads, key-major: 64 keys of one head, 16 keys of 4, ...)
  static constexpr int kBlockN = kKeyWarps * 16;
  static constexpr int kLineCols = kSwizzleRowBytes / kCacheBytes;  // columns of a 128-byte line
  static constexpr int kColBlocks = kHeadDim / kLineCols;           // 128-byte lines of a row
  static_assert(kHeadDim % kLineCols == 0, "rows of whole 128-byte lines");
  static constexpr int kColBlockBytes = kBlockN * kSwizzleRowBytes;
  static constexpr int kTileBytes = kColBlocks * kColBlockBytes;  // K or V of a stage
  // The consumers' results of an item, merged in the block: each one's rows'
  // normalized outputs and log-sum-exps, in float (merge_slot). Rows 4 floats
  // apart beyond the head dim (4 banks), so that a consumer's writes of 8
  // rows' column pairs and the merge's reads of 4 rows' 16-byte pieces take
  // the fewest shared-memory wavefronts (2 and 4; rows a head dim apart took 8
  // and 16).
  static constexpr int kMergeRowFloats = kHeadDim + 4;
  // (and a word that tells the consumers whether their item's chunk is its
  // unit's last to finish)
  // Key warps a row group whose results the buffers hold at once: of eight,
  // the upper four first hand theirs to the lower four, so that half the
  // buffers leave room for more stages (4 of 16 KiB with all eight: 3.3 TB/s).
  static constexpr int kMergeKeyWarps = std::min(kKeyWarps, 4);
  static constexpr int kMergeSlots = kRowGroups * kMergeKeyWarps;
  static constexpr int kMergeBytes = kMergeSlots * kDecodeTileRows * (kMergeRowFloats + 1) * 4 + 16;
  // About 192 KiB of stages, the bytes in flight that keep an SM's share of
  // the memory's bandwidth busy with one block an SM, or what the merge's
  // buffers leave of the shared memory.
  static constexpr int kStages =
      std::min(192 << 10, 227 * 1024 - kMergeBytes - kSwizzleAtomBytes - 256) / (2 * kTileBytes);
  static constexpr int kSmemBytes = kStages * 2 * kTileBytes + 2 * kStages * 8 + kMergeBytes + kSwizzleAtomBytes;

  // Where the result of query row r of the item from key warp `key_warp` (of
  // the first kMergeKeyWarps) of its row group lies among the merge's rows.
  static __device__ __forceinline__ int merge_slot(int key_warp, int r) {
    return (r / kDecodeTileRows * kMergeKeyWarps + key_warp) * kDecodeTileRows + r % kDecodeTileRows;
  }
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
};

}  // namespace flashattn_ext::cuda::sm90
