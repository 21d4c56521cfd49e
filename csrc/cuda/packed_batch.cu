// A packed batch's (varlen's) work on the device around the Hopper kernels:
// its bounds are checked and the forward's tiles ordered here, from cu_seqlens
// where they lie, so that a call does not read them back to the host. Such a
// read waits for the device to finish all earlier work, and the device then
// idles while the host prepares the launch: 4-5% of a forward of 75k tokens
// in 16 sequences (H100), and no host running ahead of the device in training.
// Each kernel is one block (the work is a few loads a sequence).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"

namespace flashattn_ext::cuda {
namespace {

constexpr int kThreads = 1024;
// Sequences are ordered by their work, bucketed by its log2 in 1/16ths (6%
// apart): the order only balances the grid, and a counting sort in shared
// memory takes any number of sequences.
constexpr int kBucketsPerOctave = 16;
constexpr int kBuckets = 64 * kBucketsPerOctave;
// A tile's work: the keys its rows see, plus its fixed costs (Q's load, the
// output's store) counted as a key tile's.
constexpr int64_t kTileCostKeys = 128;

// Sequence b's rows as cu_seqlens give them (not clamped: bounds_are_valid
// judges them). The difference wraps rather than overflows (bounds of any
// value): bounds that pass bounds_are_valid's test through wrapped
// differences in [0, longest] from 0 to the total are those same bounds.
__device__ int64_t sequence_rows(const IndexView& cu_seqlens, int64_t b) {
  const auto end = static_cast<uint64_t>(cu_seqlens.at(0, b + 1));
  const auto begin = static_cast<uint64_t>(cu_seqlens.at(0, b));
  return static_cast<int64_t>(end - begin);
}

// Whether cu_seqlens hold a packed batch's bounds: from 0 to the packed rows,
// not decreasing, no sequence longer than the longest the call gave (the
// kernels clamp to them: bad bounds would silently drop rows). Every thread
// of the block calls it and gets the answer.
__device__ bool bounds_are_valid(const AttentionProblem& p, const PackedSequences& packed) {
  bool valid = packed.cu_seqlens_q.at(0, 0) == 0 && packed.cu_seqlens_k.at(0, 0) == 0 &&
               packed.cu_seqlens_q.at(0, p.batch) == packed.total_q &&
               packed.cu_seqlens_k.at(0, p.batch) == packed.total_k;
  for (int64_t b = threadIdx.x; b < p.batch && valid; b += blockDim.x) {
    const int64_t len_q = sequence_rows(packed.cu_seqlens_q, b), len_k = sequence_rows(packed.cu_seqlens_k, b);
    valid = len_q >= 0 && len_k >= 0 && len_q <= p.len_q && len_k <= p.len_k;
  }
  return __syncthreads_and(valid);
}

// Fills the packed (rows, heads, cols) tensor seen as the (1, heads, rows,
// cols) view t with NaN, the block's threads striding over it.
template <typename T>
__device__ void fill_nan(const TensorView4d& t, int64_t heads, int64_t rows, int64_t cols, T nan) {
  for (int64_t i = threadIdx.x; i < heads * rows * cols; i += blockDim.x) {
    const int64_t col = i % cols, head = i / cols % heads, row = i / (cols * heads);
    static_cast<T*>(t.data)[head * t.stride_head + row * t.stride_row + col * t.stride_col] = nan;
  }
}

// The inclusive prefix sum of `value` over the block's threads (Hillis-Steele
// in `scan`, a slot a thread), and in `total` the sum of all.
__device__ int64_t inclusive_scan(int64_t value, int64_t* scan, int64_t& total) {
  __syncthreads();  // (a previous scan's reads are done)
  scan[threadIdx.x] = value;
  __syncthreads();
  for (int step = 1; step < blockDim.x; step *= 2) {
    const int64_t before = threadIdx.x >= step ? scan[threadIdx.x - step] : 0;
    __syncthreads();
    scan[threadIdx.x] += before;
    __syncthreads();
  }
  total = scan[blockDim.x - 1];
  return scan[threadIdx.x];
}

// A quiet NaN, in float and in Elem.
__device__ float float_nan() { return __int_as_float(0x7fffffff); }
template <typename Elem>
__device__ Elem elem_nan() {
  return ptx::from_float<Elem>(float_nan());
}

struct PlanParams {
  FwdParams call;
  int64_t block_rows;
  int32_t* tile_order;
  int32_t* tile_pairs;
  int* tile_counter;
  int32_t* sequence_bucket;  // (batch,) scratch
  int32_t* sorted;           // (batch,) scratch: the sequences, the most work first
};

template <typename Elem>
__global__ void __launch_bounds__(kThreads) plan_packed_forward_kernel(const PlanParams params) {
  const FwdParams& call = params.call;
  const AttentionProblem& p = call.problem;
  const PackedSequences& packed = call.packed;
  if (!bounds_are_valid(p, packed)) {
    // (A call cannot raise here: the kernel plans no tile, and the results are NaN.)
    if (threadIdx.x == 0) *params.tile_pairs = 0;
    fill_nan(call.out, p.heads_q, packed.total_q, p.head_dim_v, elem_nan<Elem>());
    fill_nan(TensorView4d{call.lse, 0, packed.total_q, 1, 0}, p.heads_q, packed.total_q, 1, float_nan());
    return;
  }
  static_assert(kBuckets == kThreads, "a bucket a thread");
  __shared__ int bucket_next[kBuckets];  // counts, then each bucket's next place in `sorted`
  __shared__ int64_t scan[kThreads];
  bucket_next[threadIdx.x] = 0;
  __syncthreads();
  // Each sequence's work, bucketed (the most work in bucket 0).
  for (int64_t b = threadIdx.x; b < p.batch; b += blockDim.x) {
    const int64_t len_q = sequence_rows(packed.cu_seqlens_q, b), len_k = sequence_rows(packed.cu_seqlens_k, b);
    const Visibility seen(p, len_q, len_k);
    int64_t cost = 0;
    for (int64_t row0 = 0; row0 < len_q; row0 += params.block_rows) {
      const int64_t last = min(len_q, row0 + params.block_rows) - 1;
      cost += max(int64_t{0}, seen.key_end(last) - seen.key_begin(row0)) + kTileCostKeys;
    }
    const int level = cost > 0 ? static_cast<int>(kBucketsPerOctave * log2f(static_cast<float>(cost))) : 0;
    const int bucket = kBuckets - 1 - min(level, kBuckets - 1);
    params.sequence_bucket[b] = bucket;
    atomicAdd(&bucket_next[bucket], 1);
  }
  __syncthreads();
  int64_t counted;  // (every sequence)
  const int count = bucket_next[threadIdx.x];
  bucket_next[threadIdx.x] = static_cast<int>(inclusive_scan(count, scan, counted) - count);
  __syncthreads();
  // (Within a bucket in no set order: the order changes no result.)
  for (int64_t b = threadIdx.x; b < p.batch; b += blockDim.x) {
    params.sorted[atomicAdd(&bucket_next[params.sequence_bucket[b]], 1)] = static_cast<int32_t>(b);
  }
  __syncthreads();
  // The sequences' pairs, in that order, after the tiles of those before them.
  int64_t written = 0;
  for (int64_t first = 0; first < p.batch; first += blockDim.x) {
    const int64_t index = first + threadIdx.x;
    const int32_t b = index < p.batch ? params.sorted[index] : 0;
    const int64_t tiles = index < p.batch ? ceil_div(sequence_rows(packed.cu_seqlens_q, b), params.block_rows) : 0;
    int64_t round_tiles;
    const int64_t end = inclusive_scan(tiles, scan, round_tiles);
    // The sequence's blocks from the last: a causal sequence's heaviest first.
    int32_t* pair = params.tile_order + 2 * (written + end - tiles);
    for (int64_t t = 0; t < tiles; ++t, pair += 2) {
      pair[0] = b;
      pair[1] = static_cast<int32_t>(tiles - 1 - t);
    }
    written += round_tiles;
  }
  if (threadIdx.x == 0) {
    *params.tile_pairs = static_cast<int32_t>(written);
    *params.tile_counter = 0;
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads) poison_gradients_kernel(const BwdParams params) {
  const AttentionProblem& p = params.problem;
  const PackedSequences& packed = params.packed;
  if (bounds_are_valid(p, packed)) return;
  const Elem nan = elem_nan<Elem>();
  fill_nan(params.dq, p.heads_q, packed.total_q, p.head_dim, nan);
  fill_nan(params.dk, p.heads_kv, packed.total_k, p.head_dim, nan);
  fill_nan(params.dv, p.heads_kv, packed.total_k, p.head_dim_v, nan);
}

// The workspace: the tile counter, the pair count, then the pairs, then the scratch.
constexpr int64_t kCounterInts = 2;

int64_t max_packed_tile_pairs(const FwdParams& params, int64_t block_rows) {
  // Each sequence's last block may be partial: at most one more block a sequence.
  return ceil_div(params.packed.total_q, block_rows) + params.problem.batch;
}

}  // namespace

int64_t packed_forward_plan_ints(const FwdParams& params, int64_t block_rows) {
  return kCounterInts + 2 * max_packed_tile_pairs(params, block_rows) + 2 * params.problem.batch;
}

void plan_packed_forward(FwdParams& params, int64_t block_rows, int32_t* workspace, ElementType type,
                         cudaStream_t stream) {
  const int64_t max_pairs = max_packed_tile_pairs(params, block_rows);
  PlanParams plan;
  plan.block_rows = block_rows;
  plan.tile_counter = workspace;
  plan.tile_pairs = workspace + 1;
  plan.tile_order = workspace + kCounterInts;
  plan.sequence_bucket = plan.tile_order + 2 * max_pairs;
  plan.sorted = plan.sequence_bucket + params.problem.batch;
  params.tile_counter = plan.tile_counter;
  params.packed.tile_pairs = plan.tile_pairs;
  params.packed.tile_order = plan.tile_order;
  params.packed.max_tile_pairs = max_pairs;
  plan.call = params;
  dispatch_element_type(type, [&](auto elem) {
    plan_packed_forward_kernel<decltype(elem)><<<1, kThreads, 0, stream>>>(plan);
  });
}

void poison_gradients_of_bad_bounds(const BwdParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    poison_gradients_kernel<decltype(elem)><<<1, kThreads, 0, stream>>>(params);
  });
}

}  // namespace flashattn_ext::cuda
