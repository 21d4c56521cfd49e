// Every tile shape and pipeline depth of the mma.sync kernels (Ampere and
// newer), in one place.
#pragma once

#include "cuda/dq_accum.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/mma_tiles.cuh"

namespace flashattn_ext::cuda::sm80 {

// The forward (flash_fwd.cu): kMTiles 16-row mma tiles a warp, kWarps warps,
// kBlockN keys a streamed tile.
template <int kHeadDim_, int kMTiles_, int kWarps_ = 4, int kBlockN_ = 64>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = kMTiles_;  // 16-row mma tiles per warp
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;  // query rows per block
  static constexpr int kBlockN = kBlockN_;               // keys per streamed tile
  static constexpr int kStride = smem_stride<kHeadDim>();
  // One query tile, two key tiles, two value tiles.
  static constexpr int kSmemElems = (kBlockM + 4 * kBlockN) * kStride;
};

// The forward's tiles at each head dim: two 16-row tiles a warp up to head
// dim 128, one above (registers).
template <int kHeadDim>
using FwdTiles = FwdConfig<kHeadDim, kHeadDim <= 128 ? 2 : 1>;

// The default backward (flash_bwd_atomic.cu): dK and dV of a key block, dQ
// added with atomics.
template <int kHeadDim_>
struct AtomicBwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockN = 128;  // keys per block: 4 groups of 32
  static constexpr int kBlockM = kDqAccumRowMultiple;  // queries per streamed tile: 2 groups of 32
  static constexpr int kStride = smem_stride<kHeadDim>();
  static constexpr int kScoreStride = smem_stride<kBlockM>();  // of the P^T and dS^T rows
  // Phase 3 splits the kBlockM x kHeadDim dQ tile over the warps as 2 x 4
  // pieces, or 4 x 2 where a quarter of the columns is no whole ldmatrix (D = 96).
  static constexpr int kDqWarpRows = (kHeadDim / 4) % 16 == 0 ? 2 : 4;
  static constexpr int kDqMTiles = kBlockM / 16 / kDqWarpRows;
  static constexpr int kDqNTiles = kHeadDim / 8 / (kWarps / kDqWarpRows);
  static_assert(kDqNTiles % 2 == 0, "dQ pieces are whole groups of 16 columns (see dq_accum_column)");
  // K, V; two buffers of Q, dO; P^T, dS^T (16-bit elements); two of lse, delta.
  static constexpr int kSmemBytes =
      ((2 * kBlockN + 4 * kBlockM) * kStride + 2 * kBlockN * kScoreStride) * 2 + 4 * kBlockM * sizeof(float);
};

// The deterministic backward's two passes (flash_bwd.cu): rows of each
// streamed tile, and the warps of the dK/dV and dQ kernels (16 rows each).
struct TwoPassBwdTiles {
  static constexpr int kBlockStream = 64;
  static constexpr int kDkdvWarps = 4;
  static constexpr int kDqWarps = 4;
};

// The decode chunk kernel (decode.cu).
template <int kHeadDim_>
struct DecodeConfig {
  static constexpr int kHeadDim = kHeadDim_;  // of keys and values, zero-padded
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRows = kDecodeTileRows;
  static constexpr int kKeysPerWarp = 16;        // each warp takes its own 16 keys of a tile
  static constexpr int kBlockN = kWarps * kKeysPerWarp;  // keys per streamed tile
  static constexpr int kStages = 3;  // tiles in the cp.async ring: two loading while one is used
  static constexpr int kStride = smem_stride<kHeadDim>();
  static constexpr int kSmemElems = (kRows + 2 * kStages * kBlockN) * kStride;
  // Tile loads: threads per row (16-byte pieces, a power of two) and rows per pass of the block.
  static constexpr int kPieces = kHeadDim / 8;
  static constexpr int kPieceSlots = kPieces <= 8 ? 8 : kPieces <= 16 ? 16 : 32;
  static constexpr int kRowsPerPass = kThreads / kPieceSlots;
  static constexpr int kPasses = kBlockN / kRowsPerPass;
};

}  // namespace flashattn_ext::cuda::sm80
