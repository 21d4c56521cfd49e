// Plain description of one attention call, shared by the CPU and CUDA kernels.
// No torch headers here: the torch glue (csrc/ops_*.cpp) fills these structs.
#pragma once

#include <cstdint>

#include "dropout.h"

namespace flashattn_ext {

// A 4-d tensor laid out as (batch, head, row, col), addressed through element
// strides, so views such as (B, N, H, D) transposed to (B, H, N, D) or expanded
// (stride 0) inputs need no copy.
struct TensorView4d {
  void* data = nullptr;
  int64_t stride_batch = 0;
  int64_t stride_head = 0;
  int64_t stride_row = 0;
  int64_t stride_col = 0;
};

// Sizes and options common to the forward and the backward pass.
struct AttentionProblem {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;  // divides heads_q; query head h reads key/value head h / (heads_q / heads_kv)
  int64_t len_q = 0;
  int64_t len_k = 0;
  int64_t head_dim = 0;    // E, shared by query and key
  int64_t head_dim_v = 0;  // Ev, of value and out
  double scale = 1.0;      // applied to Q K^T before the softmax
  bool is_causal = false;
  // Causal alignment: top-left (SDPA's is_causal) lets query i see keys j <= i;
  // bottom-right lets it see keys j <= i + (len_k - len_q).
  bool causal_lower_right = false;
  // Sliding window: query i sees keys j with i + d - window_left <= j <= i + d +
  // window_right, d the diagonal's offset as for causal (0, or len_k - len_q
  // with causal_lower_right); -1 leaves that side unbounded.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // Logit softcapping: the scaled scores s become softcap * tanh(s / softcap)
  // before attn_mask is added; 0 turns it off.
  double softcap = 0.0;
  // ALiBi: -slope * |i + d - j| is added to the (softcapped) scores of query i
  // and key j, d the diagonal's offset as for the window, before attn_mask;
  // slope = alibi_slopes[b * alibi_stride_batch + h * alibi_stride_head]
  // (float32, on the inputs' device), nullptr: none.
  const float* alibi_slopes = nullptr;
  int64_t alibi_stride_batch = 0;
  int64_t alibi_stride_head = 0;

  FLASHATTN_EXT_HOST_DEVICE bool has_window() const { return window_left >= 0 || window_right >= 0; }
};

// How attn_mask enters the scores: kBool hides the pairs where it is false;
// kAdditive is added to the scaled scores (and has the inputs' dtype).
enum class MaskKind : int { kNone, kBool, kAdditive };

// Which dims of an attn_mask, seen as (batch, heads_q, len_q, len_k), hold
// values of their own: not those of stride 0 or size 1, where it repeats one.
struct MaskDims {
  bool batch, heads, rows;
};
inline MaskDims mask_dims(const TensorView4d& mask, const AttentionProblem& p) {
  return {mask.stride_batch != 0 && p.batch > 1, mask.stride_head != 0 && p.heads_q > 1,
          mask.stride_row != 0 && p.len_q > 1};
}

// What an attn_mask does to a tile of queries and keys: hides every pair (the
// Hopper kernels skip the tile), none (they run the unmasked code on it), or
// some.
enum class BlockVisibility : uint8_t { kHidden = 0, kVisible = 1, kPartial = 2 };

// The visibility of each block of kMaskBlockRows queries x kKeyBlockKeys keys
// (cuda/flash_cuda.h), for each (batch, head) of the mask: key blocks
// contiguous, then query blocks (stride_rows; 0 where the mask repeats over
// queries, such as a key-padding mask: one block of all of them), heads and
// batches (0 where the mask repeats over them). No map (visibility null):
// every block counts as partial.
struct MaskBlockMap {
  const uint8_t* visibility = nullptr;
  int64_t stride_batch = 0, stride_head = 0, stride_rows = 0;
};

// Integer indices read in place, int32 or int64, through element strides: a
// decoding step's cache_seqlens (1-d: element i at(0, i)) and block_table
// (element (b, j) at(b, j)). data == nullptr: absent.
struct IndexView {
  const void* data = nullptr;
  bool int32 = false;
  int64_t stride_row = 0;
  int64_t stride_col = 0;

  FLASHATTN_EXT_HOST_DEVICE int64_t at(int64_t row, int64_t col) const {
    const int64_t offset = row * stride_row + col * stride_col;
    return int32 ? static_cast<const int32_t*>(data)[offset] : static_cast<const int64_t*>(data)[offset];
  }
};

// A packed batch (varlen): problem.batch sequences of different lengths along
// the rows of q, k, v and out, each seen as 4-d (1, heads, total rows, dim).
// Sequence b's queries are rows cu_seqlens_q.at(0, b) to cu_seqlens_q.at(0, b +
// 1), its keys likewise in k and v; problem.len_q and len_k are at least
// every sequence's lengths (the longest, as the kernels' grids are sized by
// them). lse is (heads_q, total_q). cu_seqlens_q.data == nullptr: a dense call.
// tile_order and tile_pairs (device memory, written by cuda::plan_packed_forward):
// the Hopper forward's (sequence, query block) pairs in the order its tiles
// take them, two int32 each, *tile_pairs of them (at most max_tile_pairs).
struct PackedSequences {
  IndexView cu_seqlens_q, cu_seqlens_k;
  int64_t total_q = 0, total_k = 0;
  const int32_t* tile_order = nullptr;
  const int32_t* tile_pairs = nullptr;
  int64_t max_tile_pairs = 0;

  FLASHATTN_EXT_HOST_DEVICE bool present() const { return cu_seqlens_q.data != nullptr; }
};

// The forward pass reads q, k, v and writes out and the per-row log-sum-exp.
// lse is contiguous (batch, heads_q, len_q), in the accumulation type
// (float, or double for double inputs); fully masked rows get lse = -inf and out = 0.
// An optional mask is seen as (batch, heads_q, len_q, len_k) through its
// strides: a broadcast mask has stride 0 where it repeats.
// With dropout, the output is P dropped (see dropout.h) times V over the
// undropped row sums, and the lse is that of the undropped scores.
// tile_counter (CUDA only) is a zero-filled int32 that the Hopper forward's
// tile scheduler counts with; that kernel runs only where it is set.
struct FwdParams {
  AttentionProblem problem;
  TensorView4d q, k, v, out;
  void* lse = nullptr;
  MaskKind mask_kind = MaskKind::kNone;
  TensorView4d mask;
  MaskBlockMap mask_blocks;  // (CUDA) set by cuda::classify_mask_blocks for the Hopper kernels
  DropoutParams dropout;
  int* tile_counter = nullptr;
  PackedSequences packed;  // a packed batch (the Hopper forward alone; no mask or dropout)
};

// The backward pass reads q, k, v, out, lse and dout, and writes dq, dk, dv,
// and, where dmask.data is set, the gradient of an additive mask, shaped
// (batch, heads_q, len_q, len_k) and zero-filled beforehand.
// delta is a contiguous (batch, heads_q, len_q) workspace of the lse's type that
// the CUDA glue allocates for its kernels; the CPU backward keeps its own.
// dq_accum (CUDA only), when set, is a float32 workspace (its size from
// cuda::dq_accum_floats) that the delta pass zero-fills: the dK/dV pass then
// adds dQ into it with atomics instead of a separate, deterministic dQ pass.
// It holds the dQ rows of dq_accum_pairs (batch, key/value head) pairs,
// flattened as batch * heads_kv + kv head, from dq_accum_pair0 on: all of
// them, except in the Hopper backward above head dim 128, which runs in
// chunks of pairs over a smaller workspace (cuda::sm90::backward_chunk_pairs).
struct BwdParams {
  AttentionProblem problem;
  TensorView4d q, k, v, out, dout, dq, dk, dv;
  const void* lse = nullptr;
  void* delta = nullptr;
  float* dq_accum = nullptr;
  int64_t dq_accum_pair0 = 0, dq_accum_pairs = 0;
  MaskKind mask_kind = MaskKind::kNone;
  TensorView4d mask, dmask;
  MaskBlockMap mask_blocks;  // (CUDA) as in FwdParams
  DropoutParams dropout;   // the forward's, with the same rng_state
  // The forward's attention sinks (heads_q, float64, on the tensors' device),
  // which out and lse include (merge_sinks in ops.h); null if none. The CPU
  // kernels read them; the CUDA kernels need only know of them: a row that
  // sees one key then gives it less than all the weight, so its dS is not 0.
  const double* sinks = nullptr;
  // A packed batch (the Hopper backward at head dims up to 128 alone; no mask
  // or dropout): q, k, v, out, dout, dq, dk, dv as in FwdParams, lse and delta
  // (heads_q, total_q), dq_accum laid out by packed_dq_accum_start
  // (cuda/dq_accum.cuh). The tile order is not used.
  PackedSequences packed;
  // (The Hopper backward in deterministic mode) zero-filled counters, one
  // per query tile of dq_accum's (cuda::sm90::dq_semaphore_ints): how many
  // key blocks have added their dQ of the tile, so that they add it in a
  // fixed order. Null otherwise: dQ is added as it comes.
  int* dq_semaphore = nullptr;
  // (Deterministic mode, causal GQA: cuda::sm90::deterministic_head_splits)
  // Each key block's query heads split over head_splits blocks, each storing
  // its dK and dV (scaled, float32) in key_grad_partials, laid out
  // [split][dk, dv][batch][key/value head][len_k][head_dim], summed in split
  // order after the kernel. 1 and null otherwise.
  int head_splits = 1;
  float* key_grad_partials = nullptr;
};

// x clamped to [low, high] (std::clamp is not callable from device code).
FLASHATTN_EXT_HOST_DEVICE int64_t clamp_index(int64_t x, int64_t low, int64_t high) {
  return x < low ? low : x > high ? high : x;
}

// Which keys each query may see: query i sees keys j with
// i + offset - left <= j <= i + offset + right (offset 0: top-left alignment,
// len_k - len_q: bottom-right), a bound of -1 leaving its side open. Causal
// attention is right = 0; a sliding window sets either or both.
// Shared by the CPU kernels, the decode kernels of both devices and the Hopper
// kernels (whose calls without a window keep their own causal bounds).
struct Visibility {
  int64_t offset, left, right;
  int64_t len_q, len_k;

  FLASHATTN_EXT_HOST_DEVICE explicit Visibility(const AttentionProblem& p) : Visibility(p, p.len_q, p.len_k) {}
  // With a sequence's own lengths (a decoding step's keys, a packed batch's sequence).
  FLASHATTN_EXT_HOST_DEVICE Visibility(const AttentionProblem& p, int64_t len_q_, int64_t len_k_)
      : offset(p.causal_lower_right ? len_k_ - len_q_ : 0),
        left(p.window_left),
        right(p.is_causal ? 0 : p.window_right),
        len_q(len_q_),
        len_k(len_k_) {}

  FLASHATTN_EXT_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    return (right < 0 || j <= i + offset + right) && (left < 0 || j >= i + offset - left);
  }
  // The keys that some query of [first_row, last_row] sees lie in [key_begin, key_end).
  FLASHATTN_EXT_HOST_DEVICE int64_t key_begin(int64_t first_row) const {
    return left < 0 ? 0 : clamp_index(first_row + offset - left, 0, len_k);
  }
  FLASHATTN_EXT_HOST_DEVICE int64_t key_end(int64_t last_row) const {
    return right < 0 ? len_k : clamp_index(last_row + offset + right + 1, 0, len_k);
  }
  // key_end of the rows [row0, row0 + rows) that lie before len_q.
  FLASHATTN_EXT_HOST_DEVICE int64_t key_end_of_rows(int64_t row0, int64_t rows) const {
    return key_end((row0 + rows < len_q ? row0 + rows : len_q) - 1);
  }
  // The queries that see some key of [first_key, last_key] lie in [query_begin, query_end).
  FLASHATTN_EXT_HOST_DEVICE int64_t query_begin(int64_t first_key) const {
    return right < 0 ? 0 : clamp_index(first_key - offset - right, 0, len_q);
  }
  FLASHATTN_EXT_HOST_DEVICE int64_t query_end(int64_t last_key) const {
    return left < 0 ? len_q : clamp_index(last_key - offset + left + 1, 0, len_q);
  }
  // How far key j lies from query i's diagonal: ALiBi's distance.
  FLASHATTN_EXT_HOST_DEVICE int64_t distance(int64_t i, int64_t j) const {
    const int64_t d = i + offset - j;
    return d < 0 ? -d : d;
  }
  // Whether some pair of the tile is hidden, so the tile needs the element test.
  FLASHATTN_EXT_HOST_DEVICE bool tile_is_partial(int64_t row0, int64_t rows, int64_t col0, int64_t cols) const {
    return (right >= 0 && col0 + cols - 1 > row0 + offset + right) ||
           (left >= 0 && col0 < row0 + rows - 1 + offset - left);
  }
};

// A decoding step: a few query tokens of each sequence against its key/value
// cache. q and out are as in FwdParams, lse (batch, heads_q, len_q) likewise.
// Sequence b's key j (and value j) is row j of head h of the cache seen as
// 4-d: contiguous, (batch, heads_kv, capacity, head_dim); paged (block_table
// set), (num_blocks, heads_kv, block_size, head_dim), with key j in block
// block_table.at(b, j / block_size) at row j % block_size.
// cache_seqlens.at(0, b) keys are cached (all problem.len_k where
// cache_seqlens.data is null: a dense call's keys); k_new and v_new (data
// set), (batch, heads_kv, len_new, head_dim), are first written into the
// cache at rows cache_seqlens.at(0, b) on, and the queries then see all those
// + len_new keys, with is_causal aligned bottom-right within them. problem.len_k is the
// capacity (keys a sequence's cache can hold); problem.causal_lower_right is set.
struct DecodeParams {
  AttentionProblem problem;
  TensorView4d q, out, k_cache, v_cache, k_new, v_new;
  void* lse = nullptr;
  IndexView cache_seqlens;
  IndexView block_table;  // data == nullptr: a contiguous cache
  int64_t block_size = 0;
  int64_t num_blocks = 0;  // paged: blocks in the cache
  int64_t len_new = 0;
  // (A dense call that the decode kernels take, CUDA only) a bool attn_mask,
  // seen as (batch, heads_q, len_q, len_k) as in FwdParams, its columns
  // contiguous: it hides the pairs where it is false. data == nullptr: none.
  TensorView4d mask;
  // An FP8 cache (k_scale set): the caches hold float8 e4m3 values, and key
  // row j of head h stands for k_cache's row times k_scale[h *
  // scale_stride_head] (float32; stride 0: one scale for every head), the
  // values likewise with v_scale. k_new and v_new (the queries' dtype) are
  // written as round-to-nearest(x / scale), saturated to e4m3's +-448.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_stride_head = 0;

  // Sequence b's cached keys: cache_seqlens.at(0, b), or the whole capacity
  // where cache_seqlens is absent (a dense call that the decode kernels take).
  FLASHATTN_EXT_HOST_DEVICE int64_t cached_length(int64_t b) const {
    return cache_seqlens.data == nullptr ? problem.len_k : cache_seqlens.at(0, b);
  }
  // Whether sequence b's cached and new keys fit its cache (in arithmetic
  // that cannot overflow, whatever cache_seqlens holds).
  FLASHATTN_EXT_HOST_DEVICE bool length_fits(int64_t b) const {
    const int64_t cached = cached_length(b);
    return cached >= 0 && cached <= problem.len_k - len_new;
  }
  // The keys sequence b's queries see, clamped to [0, capacity]: what the CUDA
  // kernels read where length_fits fails (they do not wait for the GPU to
  // check; decode_poison marks such sequences' results NaN).
  FLASHATTN_EXT_HOST_DEVICE int64_t clamped_length(int64_t b) const {
    const int64_t cached = clamp_index(cached_length(b), 0, problem.len_k);
    return len_new >= problem.len_k - cached ? problem.len_k : cached + len_new;
  }
  // Whether a block table entry names a block of the (paged) cache.
  FLASHATTN_EXT_HOST_DEVICE bool is_cache_block(int64_t index) const { return index >= 0 && index < num_blocks; }
};

}  // namespace flashattn_ext
