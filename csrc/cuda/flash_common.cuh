// Pieces shared by the forward and backward kernels: tile loads into padded
// shared memory and the index arithmetic of a flattened grid.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/flash_cuda.h"
#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda {

constexpr int kWarpSize = 32;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared-memory rows hold kHeadDim elements plus 8 of padding: the 16-byte
// shift per row puts the 8 rows that one ldmatrix phase reads in 8 different
// bank groups, so the reads are free of bank conflicts for any head dim.
template <int kHeadDim>
__host__ __device__ constexpr int smem_stride() {
  return kHeadDim + 8;
}

// Start an asynchronous copy of rows [row0, row0 + kRows) of one head into
// shared memory; rows at or past len, and columns at or past dim, read as 0.
// Each thread copies one fixed 16-byte column chunk of every kRowsPerPass-th
// row, so that a row step is one pointer increment: the index arithmetic of a
// flat loop over all chunks took more instructions than the copies themselves.
template <int kRows, int kHeadDim, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* head, int64_t stride_row, int64_t row0,
                                                int64_t len, int dim) {
  constexpr int kChunks = kHeadDim / 8;                                      // 16-byte chunks per row
  constexpr int kChunkSlots = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;  // threads per row, a power of two
  constexpr int kRowsPerPass = kThreads / kChunkSlots;
  static_assert(kChunks <= 32 && kThreads % kChunkSlots == 0 && kRows % kRowsPerPass == 0,
                "the tile must split into whole passes of the block's threads");
  const int r = threadIdx.x / kChunkSlots;
  const int c = (threadIdx.x % kChunkSlots) * 8;
  if (c >= kHeadDim) return;  // a slot past the row (head dim 96)
  // This thread's rows it * kRowsPerPass < rows_left exist.
  const int rows_left = static_cast<int>(min(len - row0 - r, int64_t(kRows)));
  const Elem* src = head + (row0 + r) * stride_row + c;
  Elem* dst = smem + r * smem_stride<kHeadDim>() + c;
  // Unrolled by up to 4: the hoisted addresses of 8 passes made the head-dim-128 forward spill.
  constexpr int kPasses = kRows / kRowsPerPass;
#pragma unroll(kPasses <= 4 ? kPasses : 4)
  for (int it = 0; it < kPasses; ++it) {
    const bool valid = it * kRowsPerPass < rows_left && c < dim;
    ptx::cp_async_16(dst + it * kRowsPerPass * smem_stride<kHeadDim>(), valid ? src : head, valid);
    src += kRowsPerPass * stride_row;
  }
}

// The place of tile `index` in a flattened grid ordered (block, head, batch),
// blocks fastest: blocks_per_head blocks for each of heads heads of each batch.
// (A non-persistent kernel's tile is its thread block: index blockIdx.x.)
struct GridPosition {
  int64_t block, head, batch;
};
__device__ __forceinline__ GridPosition grid_position(int64_t index, int64_t blocks_per_head, int64_t heads) {
  return {index % blocks_per_head, (index / blocks_per_head) % heads, index / (blocks_per_head * heads)};
}
// The same grid ordered (head, block, batch), heads fastest: the tiles that
// run together are the same few blocks of every head (they share an attn_mask
// that repeats over heads, read once from memory and then from L2).
__device__ __forceinline__ GridPosition grid_position_heads_first(int64_t index, int64_t blocks_per_head,
                                                                  int64_t heads) {
  return {(index / heads) % blocks_per_head, index % heads, index / (blocks_per_head * heads)};
}

// The same grid in the order for causal calls, whose block 0 of a head has the
// most work: the (batch, head) pairs in `chunks` chunks of consecutive pairs,
// their sizes differing by at most one, and within a chunk block 0 of every
// pair first, then block 1, ... So the tiles that run together read the same
// few heads from L2, and each chunk ends with light tiles. The counts fit in
// 32 bits (the launches check): a 32-bit division is a few instructions, a
// 64-bit one a call.
__device__ __forceinline__ GridPosition heaviest_first_position(int index, int blocks_per_head, int heads, int pairs,
                                                                int chunks) {
  const int small = pairs / chunks, big = pairs % chunks;  // `big` chunks of small + 1 pairs come first
  const int big_tiles = big * (small + 1) * blocks_per_head;
  const bool in_big = index < big_tiles;
  const int size = in_big ? small + 1 : small;
  const int local = in_big ? index : index - big_tiles;
  const int chunk = local / (size * blocks_per_head), rest = local - chunk * size * blocks_per_head;
  const int pair = (in_big ? 0 : big * (small + 1)) + chunk * size + rest % size;
  return {rest / size, pair % heads, pair / heads};
}

// How many chunks the forward's heaviest_first_position makes of `pairs`
// pairs, whose streamed tensors (K and V) take bytes_per_head each. A chunk
// holds enough pairs to fill about kL2ChunkBytes of L2, and enough that its
// work keeps all `sms` SMs busy for four times its heaviest tile: a pair's
// blocks get lighter linearly, so its work is about blocks_per_head / 2
// heaviest tiles. With fewer, the heavy tiles of the last chunk start late and
// run on alone.
constexpr int64_t kL2ChunkBytes = int64_t{24} << 20;  // about half the H100's L2
inline int heaviest_first_chunks(int64_t pairs, int64_t blocks_per_head, int64_t bytes_per_head, int sms) {
  const int64_t for_l2 = std::max<int64_t>(1, kL2ChunkBytes / std::max<int64_t>(bytes_per_head, 1));
  const int64_t for_balance = ceil_div(4 * int64_t{sms}, std::max<int64_t>(blocks_per_head, 1));
  const int64_t per_chunk = std::max<int64_t>(1, std::min(pairs, std::max(for_l2, for_balance)));
  return static_cast<int>(ceil_div(pairs, per_chunk));
}

// The same for the Hopper backward, whose blocks are not persistent: chunks of
// about one wave of blocks (sms / blocks_per_head pairs, rounded). Measured on
// the H100 against the forward's rule (bf16, causal, head dims 64 and 128, N
// 1024 to 16384, GQA 1:1 and 4:1): 1.28x faster at N = 2048 with GQA 4:1
// (the forward's rule made one chunk there, and the blocks that ran together
// were 4 key blocks of each of 32 head groups), 1.2x at N = 1024, 1.14x at
// N = 4096 with GQA 4:1, elsewhere the same within the run's noise.
inline int one_wave_chunks(int64_t pairs, int64_t blocks_per_head, int sms) {
  blocks_per_head = std::max<int64_t>(blocks_per_head, 1);
  const int64_t per_chunk = (2 * int64_t{sms} + blocks_per_head) / (2 * blocks_per_head);
  return static_cast<int>(ceil_div(pairs, std::clamp<int64_t>(per_chunk, 1, std::max<int64_t>(pairs, 1))));
}

// The current device's SM count, asked of the driver once per device.
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int device = 0, count = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices) count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    if (device < kMaxDevices) counts[device].store(count, std::memory_order_relaxed);
  }
  return std::max(count, 1);
}

// The float32 dQ accumulator of the atomic backwards (both families): shaped
// (batch, heads_q, len_q rounded up to kDqAccumRowMultiple, dq_accum_cols of
// the specialized head dim), zero-filled, and scaled and rounded into dq by
// convert_dq_accum. The columns of each group of 16 are permuted so that a
// lane's values of two adjacent n8 accumulator tiles lie side by side: one
// red.global.add.v4 adds them, half the atomic instructions of pairs (which
// crowd the memory queue). Column nt * 8 + q * 2 + e of a group (nt < 2, q < 4,
// e < 2) is kept at q * 4 + nt * 2 + e.
constexpr int kDqAccumRowMultiple = 64;
// dq_accum's floats a row for a head dim that dispatch_head_dim specializes:
// whole 64-column slices (the Hopper backward runs head dims 65 to 96 in its
// 128 kernel), so both families' layouts have one shape.
__host__ __device__ constexpr int dq_accum_cols(int specialized_head_dim) {
  return (specialized_head_dim + 63) / 64 * 64;
}
__host__ __device__ constexpr int dq_accum_column(int col) {
  return col / 16 * 16 + (col / 2) % 4 * 4 + (col / 8) % 2 * 2 + col % 2;
}

// The Hopper backward's dq_accum (DqAccumLayout::kWgmmaTiles) has the same
// shape, but within each kDqAccumRowMultiple-row tile the floats follow the
// register order of wgmma's accumulator, so that its shared-memory stores of
// dQ are conflict-free and the copy engine adds them as they lie. A tile is
// slices of kDqAccumSliceCols columns one after the other (each the 64 x 64
// dQ block of one consumer warpgroup); in a slice, thread t of the warpgroup
// keeps its registers 4j .. 4j + 3 (rows r and r + 8, columns 8j + c and
// 8j + c + 1 of its accumulator) at floats 4 (128 j + t) .. 4 (128 j + t) + 3.
// dq_accum_quad: where quad q of a tile (its floats 4q .. 4q + 3) lies: rows
// row and row + 8, columns col and col + 1.
constexpr int kDqAccumSliceCols = 64;
struct DqAccumQuad {
  int row, col;
};
__host__ __device__ constexpr DqAccumQuad dq_accum_quad(int quad) {
  constexpr int kSliceQuads = kDqAccumRowMultiple * kDqAccumSliceCols / 4;
  const int slice = quad / kSliceQuads, j = quad % kSliceQuads / 128, t = quad % 128;
  return {(t / 32) * 16 + (t % 32) / 4, slice * kDqAccumSliceCols + j * 8 + (t % 4) * 2};
}

// The first element of head (b, h) of a tensor.
template <typename Elem>
__device__ __forceinline__ Elem* head_ptr(const TensorView4d& t, int64_t b, int64_t h) {
  return static_cast<Elem*>(t.data) + b * t.stride_batch + h * t.stride_head;
}

// A packed batch's sequence b: its first row and length in cu_seqlens (clamped
// to the packed rows and the longest length, so that no bound read from memory
// takes the kernel outside its tensors).
struct SequenceSpan {
  int start, length;
};
__device__ __forceinline__ SequenceSpan sequence_span(const IndexView& cu_seqlens, int64_t total, int64_t longest,
                                                      int b) {
  const int64_t start = clamp_index(cu_seqlens.at(0, b), 0, total);
  const int64_t end = clamp_index(cu_seqlens.at(0, b + 1), start, total);
  return {static_cast<int>(start), static_cast<int>(min(end - start, longest))};
}

// Causal visibility: query i sees key j iff j <= i + offset (offset 0 for
// top-left alignment, len_k - len_q for bottom-right).
__device__ __forceinline__ int64_t causal_offset(const AttentionProblem& p) {
  return p.causal_lower_right ? p.len_k - p.len_q : 0;
}

// Keys [0, key_end) that some query row of [row0, row0 + rows) sees; offset
// from causal_offset.
__device__ __forceinline__ int64_t visible_key_end(const AttentionProblem& p, int64_t offset, int64_t row0,
                                                   int64_t rows) {
  const int64_t last_row = min(row0 + rows, p.len_q) - 1;
  return p.is_causal ? max(int64_t(0), min(p.len_k, last_row + offset + 1)) : p.len_k;
}

// Query rows that see key 0 and no other (a causal row whose diagonal passes
// through key 0, or any row when there is one key) have probability 1 there,
// so their dS = P (dP - delta) is exactly 0, as SDPA gives; the kernels' is
// not (delta comes from the rounded output), so they zero it for these rows:
// those of rows [row0, row0 + rows), as [begin, end) counted from row0. Not
// with attention sinks (BwdParams::sinks): the sink takes part of the weight.
struct RowRange {
  int begin, end;
  __device__ __forceinline__ bool holds(int row) const { return unsigned(row - begin) < unsigned(end - begin); }
};
__device__ __forceinline__ RowRange rows_seeing_first_key_alone(bool is_causal, int64_t len_k, int64_t offset,
                                                                int64_t row0, int rows) {
  // Causal rows see key 0 from row -offset on; the one row there sees it alone, or all do where it is the only key.
  const int64_t first = is_causal ? -offset - row0 : -row0;
  const int64_t end = len_k == 1 ? rows : is_causal ? first + 1 : 0;
  auto clamp = [&](int64_t row) { return static_cast<int>(max(min(row, int64_t(rows)), int64_t(0))); };
  return {clamp(first), clamp(end)};
}
__device__ __forceinline__ RowRange rows_seeing_first_key_alone(const BwdParams& params, int64_t offset, int64_t row0,
                                                                int rows) {
  if (params.sinks != nullptr) return {0, 0};
  return rows_seeing_first_key_alone(params.problem.is_causal, params.problem.len_k, offset, row0, rows);
}

// A packed batch's dq_accum (the atomic backwards' float32 dQ): each query
// head's rows as a dense call's of one batch element and
// packed_dq_accum_start(total_q, sequences) rows, sequence b's from
// packed_dq_accum_start(its first row, b) on. Each sequence's rows then start
// a tile, and its tiles end before the next sequence's start (the 64 rows a
// sequence adds cover its last tile's padding).
FLASHATTN_EXT_HOST_DEVICE int64_t packed_dq_accum_start(int64_t q_start, int64_t b) {
  return (q_start + kDqAccumRowMultiple - 1) / kDqAccumRowMultiple * kDqAccumRowMultiple + b * kDqAccumRowMultiple;
}

// Rows that an attn_mask leaves one key (any key) are the same case: the
// backward marks them before its kernels run (mark_rows_seeing_one_key) by
// setting their delta to this NaN. Arithmetic never makes it (the GPU's NaNs
// are 0x7fffffff, and a 16-bit NaN widened to float has its low 13 bits 0), so
// a NaN that comes from the inputs is not mistaken for it.
constexpr uint32_t kOneKeyRowDelta = 0x7fc00001u;

__device__ __forceinline__ bool marks_one_key_row(float delta) { return __float_as_uint(delta) == kOneKeyRowDelta; }

// dS = P (dP - delta) of one score; exactly 0 in a row marked kOneKeyRowDelta
// (kMasked: kernels that take an attn_mask, the only ones that see the mark).
// (The Hopper backward zeroes the marked rows of a tile after the fact instead:
// zero_rows_seeing_one_key.)
template <bool kMasked>
__device__ __forceinline__ float score_gradient(float p, float dp, float delta) {
  return kMasked && marks_one_key_row(delta) ? 0.f : p * (dp - delta);
}

// The first query row that sees key col0 or a later one (len_q if none does);
// offset from causal_offset.
__device__ __forceinline__ int64_t first_visible_query(const AttentionProblem& p, int64_t offset, int64_t col0) {
  return p.is_causal ? min(max(col0 - offset, int64_t(0)), p.len_q) : 0;
}

// Lane offsets (in elements) of ldmatrix row addresses in a row-major tile of
// row stride kStride. For A fragments and for B read transposed: lanes 0-15
// give rows 0-15 at column 0, lanes 16-31 the same rows at column 8. For B read
// as is: lanes 0-7 and 16-23 give rows 0-7 and 8-15 at column 0, lanes 8-15
// and 24-31 the same rows at column 8.
template <int kStride>
__device__ __forceinline__ int a_lane_offset(int lane) {
  return (lane % 16) * kStride + (lane / 16) * 8;
}
template <int kStride>
__device__ __forceinline__ int b_lane_offset(int lane) {
  return (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
}

// How an mma operand tile sits in shared memory: kRowMajor keeps its M (for A)
// or N (for B) index along the rows and K along each row; kKMajor keeps K
// along the rows, so ldmatrix reads it transposed.
enum class Operand { kRowMajor, kKMajor };

// This lane's ldmatrix offset (elements) in an A or B operand tile of the given layout.
template <Operand kLayout, int kStride, bool kIsA>
__device__ __forceinline__ int operand_lane_offset(int lane) {
  return (kLayout == Operand::kRowMajor) == kIsA ? a_lane_offset<kStride>(lane) : b_lane_offset<kStride>(lane);
}

// acc += A B for a warp, A (kMTiles x 16 by kK) and B (kK by kNTiles x 8)
// both in shared memory, in the layouts kA and kB with row strides kStrideA
// and kStrideB (elements). a_frag and b_frag are this lane's ldmatrix
// addresses of their (0, 0) elements: the tiles' shared-space addresses plus
// operand_lane_offset, which callers in a loop compute once.
template <typename Elem, int kMTiles, int kNTiles, int kK, Operand kA, int kStrideA, Operand kB, int kStrideB>
__device__ __forceinline__ void mma_smem_fragments(float (&acc)[kMTiles][kNTiles][4], uint32_t a_frag,
                                                   uint32_t b_frag) {
  constexpr int kElemBytes = sizeof(Elem);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if constexpr (kA == Operand::kRowMajor) {
        ptx::ldmatrix_x4(a[mt], a_frag + (mt * 16 * kStrideA + kk * 16) * kElemBytes);
      } else {
        ptx::ldmatrix_x4_trans(a[mt], a_frag + (kk * 16 * kStrideA + mt * 16) * kElemBytes);
      }
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      if constexpr (kB == Operand::kRowMajor) {
        ptx::ldmatrix_x4(b, b_frag + (np * 16 * kStrideB + kk * 16) * kElemBytes);
      } else {
        ptx::ldmatrix_x4_trans(b, b_frag + (kk * 16 * kStrideB + np * 16) * kElemBytes);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The same from the tiles' shared-space addresses a_tile and b_tile.
template <typename Elem, int kMTiles, int kNTiles, int kK, Operand kA, int kStrideA, Operand kB, int kStrideB>
__device__ __forceinline__ void mma_smem_by_smem(float (&acc)[kMTiles][kNTiles][4], uint32_t a_tile,
                                                 uint32_t b_tile, int lane) {
  constexpr int kElemBytes = sizeof(Elem);
  mma_smem_fragments<Elem, kMTiles, kNTiles, kK, kA, kStrideA, kB, kStrideB>(
      acc, a_tile + operand_lane_offset<kA, kStrideA, true>(lane) * kElemBytes,
      b_tile + operand_lane_offset<kB, kStrideB, false>(lane) * kElemBytes);
}

// acc += A B^T with A and B both row-major (kMTiles x 16 and kNTiles x 8 rows
// of kK columns): the pattern of S = Q K^T. a_frag, b_frag as for mma_smem_fragments.
template <typename Elem, int kMTiles, int kNTiles, int kK, int kStride>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kMTiles][kNTiles][4], uint32_t a_frag,
                                                 uint32_t b_frag) {
  mma_smem_fragments<Elem, kMTiles, kNTiles, kK, Operand::kRowMajor, kStride, Operand::kRowMajor, kStride>(acc, a_frag,
                                                                                                         b_frag);
}

// acc += X B for a warp: X is kMTiles x 16 rows of kK columns held as float
// accumulators in registers (rounded to Elem on the way), B is kK rows of kN
// columns, row-major in shared memory and read transposed (b_frag from
// a_lane_offset). The pattern of O += P V: two adjacent n8 accumulator tiles
// are exactly the A fragment of one k16 step.
template <typename Elem, int kMTiles, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_regs_by_rows(float (&acc)[kMTiles][kN / 8][4],
                                                 const float (&x)[kMTiles][kK / 8][4], uint32_t b_frag) {
  constexpr int kElemBytes = sizeof(Elem);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      a[mt][0] = ptx::pack2<Elem>(x[mt][2 * kk][0], x[mt][2 * kk][1]);
      a[mt][1] = ptx::pack2<Elem>(x[mt][2 * kk][2], x[mt][2 * kk][3]);
      a[mt][2] = ptx::pack2<Elem>(x[mt][2 * kk + 1][0], x[mt][2 * kk + 1][1]);
      a[mt][3] = ptx::pack2<Elem>(x[mt][2 * kk + 1][2], x[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, b_frag + (kk * 16 * kStride + np * 16) * kElemBytes);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
        ptx::mma_16x8x16<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The log-sum-exp in log2 units, with rows that see no key (lse = -inf) and rows
// past the end mapped to +inf, so that exp2(s - lse) is 0 for them.
__device__ __forceinline__ float lse_log2(const float* lse, int64_t row, int64_t len) {
  if (row >= len) return INFINITY;
  const float x = lse[row];
  return x == -INFINITY ? INFINITY : x * float(M_LOG2E);
}

// What the attn_mask does to the tile of `rows` queries from row0 (a multiple
// of kMaskBlockRows; rows past len_q do not count) and key block key_block of
// (batch b, query head): the map's blocks combined, hidden or visible where
// they all are, else partial.
__device__ __forceinline__ BlockVisibility tile_visibility(const MaskBlockMap& map, int64_t b, int64_t head,
                                                           int64_t row0, int rows, int64_t len_q,
                                                           int64_t key_block) {
  if (map.visibility == nullptr) return BlockVisibility::kPartial;
  const uint8_t* blocks = map.visibility + b * map.stride_batch + head * map.stride_head + key_block;
  const uint8_t first = blocks[row0 / kMaskBlockRows * map.stride_rows];
  if (map.stride_rows != 0) {
    const int64_t end = (min(row0 + rows, len_q) - 1) / kMaskBlockRows;
    for (int64_t r = row0 / kMaskBlockRows + 1; r <= end; ++r) {
      if (blocks[r * map.stride_rows] != first) return BlockVisibility::kPartial;
    }
  }
  return static_cast<BlockVisibility>(first);
}

// The attn_mask of one (batch, query head), read in place through its strides
// (0 where it broadcasts), one element at a time: rare enough a path that the
// reads need no layout of their own.
template <typename Elem>
struct HeadMask {
  MaskKind kind;
  const char* base;
  int64_t stride_row, stride_col;

  __device__ __forceinline__ HeadMask(MaskKind kind_, const TensorView4d& mask, int64_t b, int64_t h)
      : kind(kind_), stride_row(mask.stride_row), stride_col(mask.stride_col) {
    const int64_t elem_size = kind == MaskKind::kBool ? sizeof(bool) : sizeof(Elem);
    base = static_cast<const char*>(mask.data) + (b * mask.stride_batch + h * mask.stride_head) * elem_size;
  }

  // A score of query row i and key j in log2 units, with the mask applied: -inf
  // where a bool mask is false; plus the additive mask, times log2(e).
  __device__ __forceinline__ float apply(float score, int64_t i, int64_t j) const {
    const int64_t offset = i * stride_row + j * stride_col;
    if (kind == MaskKind::kBool) return reinterpret_cast<const bool*>(base)[offset] ? score : -INFINITY;
    return score + ptx::to_float(reinterpret_cast<const Elem*>(base)[offset]) * float(M_LOG2E);
  }
};

// Writes the gradient of an additive mask for query row i and key j (dS there).
template <typename Elem>
__device__ __forceinline__ void store_mask_grad(const TensorView4d& dmask, int64_t b, int64_t h, int64_t i, int64_t j,
                                                float ds) {
  static_cast<Elem*>(dmask.data)[b * dmask.stride_batch + h * dmask.stride_head + i * dmask.stride_row +
                                 j * dmask.stride_col] = ptx::from_float<Elem>(ds);
}

// Dropout inside the kernels (numbers as in dropout.h), per attention call
// (32 bytes, which the Hopper kernels keep in shared memory: see their tile configs).
struct DropoutState {
  uint64_t seed, offset;
  // dropout_keep_flags' constants for the threshold: see there.
  uint32_t low_bits, carry_add, top_or;
  float keep_scale;  // of a kept probability

  __device__ __forceinline__ bool bytes() const { return low_bits == 0x7F7F7F7Fu; }  // 8-bit numbers, else 16
};
static_assert(sizeof(DropoutState) == 32, "the room the Hopper tile configs keep for it");

__device__ __forceinline__ DropoutState dropout_state(const DropoutParams& dropout) {
  DropoutState state;
  state.seed = static_cast<uint64_t>(dropout.rng_state[0]);
  state.offset = static_cast<uint64_t>(dropout.rng_state[1]);
  const int bits = dropout_bits_of(dropout.rng_state);
  const uint32_t threshold = dropout_threshold(dropout.p, bits), half = 1u << (bits - 1);
  state.low_bits = bits == 8 ? 0x7F7F7F7Fu : 0x7FFF7FFFu;
  state.carry_add = ((threshold <= half ? half : 2 * half) - threshold) * (bits == 8 ? 0x01010101u : 0x00010001u);
  state.top_or = threshold <= half ? ~0u : 0u;
  state.keep_scale = static_cast<float>(dropout_keep_scale(dropout.p));
  return state;
}

// The keep flags of the numbers of one Philox output (four bytes, or two
// 16-bit halves): each number's top bit set iff it is at least the threshold
// t, with no carry between numbers. Where t is at most half the range, n >= t
// iff n's top bit is set or its low bits plus (half - t) carry into it; above,
// iff both, with (2 half - t). One majority of three (a LOP3) after the add.
__device__ __forceinline__ uint32_t dropout_keep_flags(uint32_t numbers, const DropoutState& d) {
  const uint32_t carried = (numbers & d.low_bits) + d.carry_add;
  return (numbers & carried) | ((numbers | carried) & d.top_or);
}

// A lane's dropout decisions for two adjacent 16 x 16 blocks of a score
// fragment whose rows are queries (kKeyRows false: S) or keys (true: S^T):
// flags[b][w] for block b and the lane's columns of parity w (its columns
// 2 * (lane % 4) + w and 8 more); byte qh * 2 + kh's top bit keeps the pair of
// query half qh and key half kh of the block (dropout.h). group is the group
// of the lane's first row and column in block 0, step the group's growth to
// block 1 (4 along a query row, 4 * dropout_quads(len_k) down a key column).
// Every lane of the warp calls it together: lane ^ 4 holds the other rows of
// the lane's groups.
template <bool kKeyRows>
__device__ __forceinline__ void dropout_block_pair_flags(uint32_t (&flags)[2][2], const DropoutState& d,
                                                         uint64_t group, uint64_t step, int lane) {
  const bool odd_rows = (lane / 4) % 2 != 0;
  if (d.bytes()) {
    // One call, for block odd_rows: the lane keeps its rows' two words (of
    // output qp * 2 + kp) and swaps the other two for lane ^ 4's, of the other block.
    const PhiloxOutput numbers =
        dropout_call(d.seed, d.offset, dropout_call_index(group + (odd_rows ? step : 0), 8, 0));
    uint32_t f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = dropout_keep_flags(numbers.x[i], d);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t even = kKeyRows ? f[w * 2] : f[w], odd = kKeyRows ? f[w * 2 + 1] : f[2 + w];
      const uint32_t received = __shfl_xor_sync(0xffffffff, odd_rows ? even : odd, 4);
      flags[0][w] = odd_rows ? received : even;
      flags[1][w] = odd_rows ? odd : received;
    }
  } else {
    // Calls 2 * group + qp, halves kh of outputs kp * 2 + qh: the lane makes
    // its row parity's call (qp with query rows; with key rows its key
    // parity's call, whose other key parity it swaps for lane ^ 4's).
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const PhiloxOutput numbers =
          dropout_call(d.seed, d.offset, dropout_call_index(group + (b ? step : 0), 16, odd_rows));
      uint32_t by_kp[2];  // bytes qh * 2 + kh of the numbers of kp
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        by_kp[kp] = ptx::prmt(dropout_keep_flags(numbers.x[kp * 2], d), dropout_keep_flags(numbers.x[kp * 2 + 1], d),
                              0x7531);
      }
      if constexpr (kKeyRows) {
        const uint32_t received = __shfl_xor_sync(0xffffffff, odd_rows ? by_kp[0] : by_kp[1], 4);
        flags[b][0] = odd_rows ? received : by_kp[0];
        flags[b][1] = odd_rows ? by_kp[1] : received;
      } else {
        flags[b][0] = by_kp[0];
        flags[b][1] = by_kp[1];
      }
    }
  }
}

// Whether byte `byte` (qh * 2 + kh) of a lane's flags word keeps its pair.
__device__ __forceinline__ bool dropout_flag(uint32_t flags, int byte) { return (flags >> (8 * byte + 7)) & 1u; }

// The mask of a lane's two 16-bit elements of columns of parity 0 and 1 (low
// half first) in one of its blocks (flags as dropout_block_pair_flags gives
// them): all ones where kept, zero where dropped. One prmt, top bits repeated.
__device__ __forceinline__ uint32_t dropout_pair_mask(const uint32_t (&flags)[2], int byte) {
  return ptx::prmt(flags[0], flags[1], 0x8888u | byte * 0x0011u | (byte + 4) * 0x1100u);
}

// keep[mt][nt][e]: whether dropout keeps a warp's score fragment element of
// row row0 + mt * 16 + lane / 4 + 8 * (e / 2) and column col0 + nt * 8 + 2 *
// (lane % 4) + e % 2, of head bh (batch * heads_q + head), where the rows are
// queries and the columns keys (kKeyRows false: S) or the other way round
// (S^T). row0 and col0 are multiples of 16.
template <bool kKeyRows, int kMTiles, int kNTiles>
__device__ __forceinline__ void dropout_keep_fragments(bool (&keep)[kMTiles][kNTiles][4], const DropoutState& d,
                                                       const AttentionProblem& p, int64_t bh, int64_t row0,
                                                       int64_t col0, int lane) {
  static_assert(kNTiles % 4 == 0, "pairs of 16-column blocks");
  const uint64_t step = kKeyRows ? 4 * dropout_quads(p.len_k) : 4;  // 16 columns on
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int pair = 0; pair < kNTiles / 4; ++pair) {
      const int64_t row = row0 + mt * 16 + lane / 4, col = col0 + pair * 32 + (lane % 4) * 2;
      uint32_t flags[2][2];
      dropout_block_pair_flags<kKeyRows>(
          flags, d, dropout_group(bh, kKeyRows ? col : row, kKeyRows ? row : col, p.len_q, p.len_k), step, lane);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // Row half e / 2, column half nt, column parity e % 2; the byte is qh * 2 + kh.
            const int byte = kKeyRows ? nt * 2 + e / 2 : (e / 2) * 2 + nt;
            keep[mt][pair * 4 + b * 2 + nt][e] = dropout_flag(flags[b][e % 2], byte);
          }
        }
      }
    }
  }
}

// Calls fn with std::true_type if flag is set, else std::false_type: a kernel
// template argument from a runtime flag.
template <typename Fn>
void dispatch_flag(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Calls fn with the 16-bit element type of the inputs, as a value of that type.
template <typename Fn>
void dispatch_element_type(ElementType type, Fn&& fn) {
  if (type == ElementType::kBFloat16) {
    fn(__nv_bfloat16{});
  } else {
    fn(__half{});
  }
}

// Calls fn with the head dim the kernels are specialized for that serves dim,
// as a std::integral_constant: 64, 96, 128 or 256. Head dims between them run
// in the next larger one, padded with zeros.
template <typename Fn>
void dispatch_head_dim(int64_t dim, Fn&& fn) {
  if (dim <= 64) {
    fn(std::integral_constant<int, 64>{});
  } else if (dim <= 96) {
    fn(std::integral_constant<int, 96>{});
  } else if (dim <= 128) {
    fn(std::integral_constant<int, 128>{});
  } else {
    fn(std::integral_constant<int, 256>{});
  }
}

// Launches a kernel taking one params struct over a flattened 1-d grid (no
// 65535 limit), with its dynamic shared memory; nothing to do for 0 blocks.
template <typename Kernel, typename Params>
void launch_kernel(Kernel kernel, int64_t blocks, int threads, int smem_bytes, const Params& params,
                   cudaStream_t stream) {
  if (blocks == 0) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(params);
}

}  // namespace flashattn_ext::cuda
