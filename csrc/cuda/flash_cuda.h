// Entry points of the CUDA kernels, called by the torch glue in ops_cuda.cpp.
// No torch headers: the params structs carry everything.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "flash_params.h"

namespace flashattn_ext::cuda {

enum class ElementType { kFloat16, kBFloat16 };

// The largest head dim the kernels take; it must be a multiple of 8.
constexpr int kMaxHeadDim = 256;
// Query rows of a decode kernel's block (a key/value head's group of query
// heads times the query tokens): one mma tile.
constexpr int kDecodeTileRows = 16;
// The most query rows of a key/value head that the dense calls' decode route
// takes (route.cpp): two tiles, which the Hopper decode kernel takes at once
// (8 tokens of speculative decoding with GQA 4).
constexpr int kDecodeRouteRows = 2 * kDecodeTileRows;

// A (batch, heads, rows, cols) tensor to or from e4m3 with one descale a
// (batch, key/value head), each heads / heads_kv consecutive heads sharing
// one (fp8_convert.cu: the quantize_fp8 and dequantize_fp8 ops).
struct Fp8ConvertParams {
  TensorView4d wide;    // the 16-bit side
  TensorView4d narrow;  // the e4m3 side
  int64_t batch = 0, heads = 0, rows = 0, cols = 0, heads_kv = 0;
  float* amax = nullptr;     // quantize: (batch, heads_kv) floats, zeroed beforehand
  float* descale = nullptr;  // (batch, heads_kv) floats: quantize writes them, dequantize reads them
};
// narrow = e4m3(wide / descale), rounded to nearest and saturated, with
// descale = max(largest |wide| of the pair's heads / 448, FLT_MIN).
void quantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream);
// wide = float(narrow) * descale, rounded to the 16-bit type.
void dequantize_fp8(const Fp8ConvertParams& params, ElementType type, cudaStream_t stream);

// Pieces of the backward shared by both families (dq_accum.cu, delta.cu).
// delta = rowsum(dO * O) per query row, into params.delta (kOneKeyRowDelta
// in the rows that an attn_mask leaves one key: mark_rows_seeing_one_key);
// zero-fills params.dq_accum where set. Runs before the kernels that read either.
void compute_delta(const BwdParams& params, ElementType type, cudaStream_t stream);

// Floats of a dq_accum workspace of the atomic-dQ backwards that holds the dQ
// rows of `pairs` (batch, key/value head) pairs (its layout:
// kDqAccumRowMultiple in dq_accum.cuh). Which calls have one:
// attention_backward_cuda (ops_cuda.cpp).
int64_t dq_accum_floats(const AttentionProblem& p, int64_t pairs);
// The same for a packed batch's call (params.packed; layout: packed_dq_accum_start).
int64_t packed_dq_accum_floats(const BwdParams& params);

// A packed batch's (varlen's) work on the device (packed_batch.cu): nothing
// is read back to the host, so its calls do not wait for the device.
// Bounds are a packed batch's when cu_seqlens run from 0 to the packed rows,
// do not decrease and give no sequence more rows than the problem's len_q or
// len_k (max_seqlen); with other bounds the kernels stay in their tensors,
// and these fill the results with NaN (a call cannot raise without the read).
//
// The Hopper forward's tile order for params' batch, in `workspace`
// (packed_forward_plan_ints of them), params.packed.tile_order, tile_pairs,
// max_tile_pairs and params.tile_counter set to it: sequence by sequence, the
// most work first, each sequence's blocks of block_rows queries from the last
// (the causal diagonal's heaviest). The tiles that run together then read one
// or two sequences' keys and values, and the grid ends with light tiles. Bad
// bounds: no tile, out and lse NaN.
int64_t packed_forward_plan_ints(const FwdParams& params, int64_t block_rows);
void plan_packed_forward(FwdParams& params, int64_t block_rows, int32_t* workspace, ElementType type,
                         cudaStream_t stream);
// After a packed batch's backward: dq, dk and dv NaN where its bounds are bad.
void poison_gradients_of_bad_bounds(const BwdParams& params, ElementType type, cudaStream_t stream);

// How a backward laid out dq_accum (dq_accum.cuh): rows with permuted
// columns (the sm80 atomics) or, within each tile, wgmma's register order (sm90).
enum class DqAccumLayout { kRows, kWgmmaTiles };

// dq = dq_accum * scale, rounded to the element type, for the pairs dq_accum
// holds (the rows layout: all of them).
void convert_dq_accum(const BwdParams& params, ElementType type, DqAccumLayout layout, cudaStream_t stream);

// The block map of an attn_mask (mask_blocks.cu), for the Hopper kernels,
// whose masked forward and backward take kKeyBlockKeys keys at a time and
// query tiles of a multiple of kMaskBlockRows rows: mask_block_map_bytes is the
// device memory the map takes, 0 where there is none (no mask, or a grid past
// its launch limits); classify_mask_blocks fills that memory and returns the
// map over it.
constexpr int kKeyBlockKeys = 128;
constexpr int kMaskBlockRows = 64;
int64_t mask_block_map_bytes(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p);
MaskBlockMap classify_mask_blocks(MaskKind kind, const TensorView4d& mask, const AttentionProblem& p,
                                  ElementType type, uint8_t* map, cudaStream_t stream);

// A bool attn_mask's key extents (mask_blocks.cu), for a dense call that the
// decode kernels take: extents[b] (zeros beforehand) becomes one past the last
// key that the mask shows any row of batch b, for the mask_key_extent_batches
// batches it has values of (1 where it repeats over them). Its columns are
// contiguous.
int64_t mask_key_extent_batches(const TensorView4d& mask, const AttentionProblem& p);
void mask_key_extents(const TensorView4d& mask, const AttentionProblem& p, int32_t* extents, cudaStream_t stream);

// Sets the delta of the query rows that params' attn_mask leaves exactly one
// key (mask_blocks.cu) to kOneKeyRowDelta (visibility.cuh); with no mask, nothing.
void mark_rows_seeing_one_key(const BwdParams& params, ElementType type, cudaStream_t stream);

// Decoding (decode.cu, sm80/decode.cu), float16 and bfloat16, head dims up to kMaxHeadDim:
// decode_append writes key_new and value_new into the caches; then
// sm90::decode_attention where it takes the call, else two steps:
// decode_attention_partials (mma.sync, any GPU from Ampere on) writes each
// query row's partial results over chunks of its keys (`partials` of them, as
// decode_partials says) into out_partial (batch * heads_q * len_q * partials
// * head_dim_v floats) and lse_partial (batch * heads_q * len_q * partials),
// and decode_merge merges them into out and lse. Last, decode_poison sets
// out and lse to NaN for each sequence whose length does not fit its cache or
// whose block table names a block outside the cache: the kernels before it
// clamp such lengths and indices into the cache (no read or write leaves it,
// and decode_append writes nothing for them) rather than wait for the GPU to
// check them on the host. With lengths_marked (sm90::decode_attention ran: it
// marks the lengths itself) only block tables are left to check.
struct DecodePartials {
  float* out = nullptr;
  float* lse = nullptr;
  int* arrivals = nullptr;
};
// The caller's buffers for `results` partial results (a query row's over a
// chunk of its keys: head_dim_v floats in out, one in lse) and
// `arrival_counters` counters, zeros (sm90::decode_attention's).
using DecodePartialsAllocator = std::function<DecodePartials(int64_t results, int64_t arrival_counters)>;
int decode_partials(const DecodeParams& params, ElementType type);
void decode_append(const DecodeParams& params, ElementType type, cudaStream_t stream);
void decode_attention_partials(const DecodeParams& params, ElementType type, float* out_partial, float* lse_partial,
                               int partials, cudaStream_t stream);
void decode_merge(const DecodeParams& params, ElementType type, const float* out_partial, const float* lse_partial,
                  int partials, cudaStream_t stream);
void decode_poison(const DecodeParams& params, ElementType type, bool lengths_marked, cudaStream_t stream);

// The mma.sync kernels (csrc/cuda/sm80/): Ampere and newer, every call the
// CUDA kernels take.
namespace sm80 {

void attention_forward(const FwdParams& params, ElementType type, cudaStream_t stream);

// Head dims up to this one have the faster backward with atomic dQ.
constexpr int kMaxAtomicDqHeadDim = 128;

// Computes delta, then dK, dV and dQ. With params.dq_accum set (see
// dq_accum_floats) and a head dim up to kMaxAtomicDqHeadDim, one pass over key
// blocks computes all three, dQ by float32 atomics; else dK and dV come from
// one pass over key blocks and dQ from a separate one over query blocks:
// deterministic, no float32 accumulator.
void attention_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

// The atomic-dQ pass, after delta and before convert_dq_accum (flash_bwd_atomic.cu).
void attention_backward_atomic_dq(const BwdParams& params, ElementType type, cudaStream_t stream);

}  // namespace sm80

// The wgmma/TMA kernels (csrc/cuda/sm90/): Hopper (compute capability 9.0)
// only, in a build for the 9.0a target (FLASHATTN_EXT_HAS_SM90A).
namespace sm90 {

// Whether the Hopper forward takes the call, as far as its sizes and options
// tell (float16 or bfloat16 is the caller's): head dim up to 256, 128 with an
// attn_mask (value's equal), a positive scale, dropout (with the sm80 kernels'
// numbers) or an attn_mask but not both, softcap or ALiBi (not both) with
// neither, a sliding window with any of them; and MLA's prefill shape, queries
// and keys of head dim 136 to 192 with values of 72 to 128, with none of these
// but a window (nor a packed batch).
bool forward_covers(const FwdParams& params);

// Runs the Hopper forward and returns true where it covers the call:
// forward_covers, tensors the copy engine can address (rows 16-byte aligned,
// strides non-zero multiples of 16 bytes; an attn_mask's last dim contiguous),
// params.tile_counter set. Else launches nothing and returns false.
bool attention_forward(const FwdParams& params, ElementType type, cudaStream_t stream);

// The FP8 forward (attention_forward_fp8, flash_fwd_sm90_fp8.cu): q, k, v
// in float8 e4m3 (fwd's views, in bytes), out bfloat16, lse float32;
// descales float32 contiguous (batch, heads_kv) (a stored x stands for x *
// descale[b, kv head]). values_t: a workspace of fp8_values_t_bytes bytes
// that the call fills with v transposed (batch, heads_kv, head dim,
// fp8_values_t_keys(len_k)), the keys in the order the kernel's P fragments
// take (e4m3_fragment_column), zero past len_k.
struct Fp8FwdParams {
  FwdParams fwd;
  const float *q_descale = nullptr, *k_descale = nullptr, *v_descale = nullptr;
  void* values_t = nullptr;
};
int64_t fp8_values_t_keys(int64_t len_k);
int64_t fp8_values_t_bytes(const AttentionProblem& p);
// Whether the FP8 forward takes a call: head dim 128 (value's equal), causal
// of either alignment or not, GQA; no window, attn_mask, dropout, softcap,
// ALiBi or packed batch; descales given.
bool fp8_forward_covers(const Fp8FwdParams& params);
// Runs it (the transpose of v, then the kernel) and returns true where it
// covers the call and the copy engine can address the tensors (last dims
// contiguous, strides multiples of 16 bytes), params.fwd.tile_counter and
// params.values_t set. Else launches nothing and returns false.
bool attention_forward_fp8(const Fp8FwdParams& params, cudaStream_t stream);

// The query rows of the Hopper forward's tiles for a packed batch (their
// blocks are what plan_packed_forward orders).
int64_t varlen_forward_block_rows(const AttentionProblem& p);

// Whether the Hopper backward takes a call: every call the Hopper forward
// takes (head dims up to 256, value's equal; with an attn_mask up to 128;
// dropout; a sliding window; softcap, or ALiBi, without a mask or dropout),
// but a mask's gradient; a packed batch at head dims up to 128.
bool backward_covers(const BwdParams& params);

// Whether the Hopper backward takes a call that backward_covers in
// deterministic mode, where the key blocks add their dQ of a query tile in a
// fixed order (counted in params.dq_semaphore): head dims up to 128, no
// attn_mask, sliding window or packed batch, and unless causal no more key
// blocks a head than SMs (the order has a block wait for others of its head
// that may start after it: they must all be resident at once).
bool deterministic_backward_covers(const BwdParams& params);

// Deterministic mode (deterministic_backward_covers): over how many blocks of
// each key block a causal call's query heads of a group are split (1: not
// split), so that its heaviest blocks (the first key blocks, which the order
// starts last) take a fraction of the group's work. params.key_grad_partials
// then holds key_grad_partial_floats of float32.
int deterministic_head_splits(const AttentionProblem& p);
int64_t key_grad_partial_floats(const AttentionProblem& p, int splits);
// dk and dv from params.key_grad_partials (launch_backward_kernel's last step
// where params.head_splits > 1).
void sum_key_grad_partials(const BwdParams& params, ElementType type, cudaStream_t stream);

// The counters params.dq_semaphore needs for `pairs` (batch, key/value head)
// pairs: one per query tile of 64 rows (the smallest) of each query head.
int64_t dq_semaphore_ints(const AttentionProblem& p, int64_t pairs);

// How many (batch, key/value head) pairs the Hopper backward takes at most at
// a time, and so how many pairs' rows its dq_accum must hold: all of them up
// to head dim 128. Above, where dq_accum would add half the memory that q, k,
// v, out, dout and the gradients take, about a quarter of them.
int64_t backward_chunk_pairs(const AttentionProblem& p);

// Runs the Hopper backward (delta, then per chunk of pairs the kernel and
// convert_dq_accum) and returns true where it covers the call:
// backward_covers, params.dq_accum set (the atomic-dQ mode) for
// backward_chunk_pairs pairs, params.dq_semaphore set where
// deterministic_backward_covers (and null elsewhere), tensors the copy engine
// can address. Else
// launches nothing and returns false.
bool attention_backward(const BwdParams& params, ElementType type, cudaStream_t stream);

// The Hopper decode kernel (decode_sm90.cu), launched where it takes the
// call: it writes out and lse itself, a sequence's keys in one or more chunks
// (each chunk's partial results in the buffers `allocate` gives, asked at most
// once before the launch, merged by the last of the chunks to finish), and
// returns true. Returns false, launching nothing, where it does not take the
// call. Its consumer warps' results of a chunk merge in shared memory. It
// takes float16 and bfloat16 (the caller's), head dims 64 and 128 (value's
// equal), up to 16 query rows a key/value head (GQA group times query
// tokens), caches the copy engine can address, paged ones whose blocks divide
// its tiles' keys or are a multiple of them (tiles of 64 keys of one
// key/value head, 32 of two, 16 of four, ...: one head where each head's rows
// lie apart, else as many as have up to 16 query rows together) and hold 1024
// bytes or more a copy.
bool decode_attention(const DecodeParams& params, ElementType type, const DecodePartialsAllocator& allocate,
                      cudaStream_t stream);

}  // namespace sm90

// Where one call's dropout {seed, offset} comes from: torch's PhiloxCudaState,
// read on the device, because under CUDA graph capture seed and offset live in
// device memory (offset then plus offset_intragraph).
struct PhiloxSource {
  uint64_t seed = 0, offset = 0;  // when not captured
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  bool captured = false;
  int bits = kDefaultDropoutBits;  // of the random numbers
};

// A forward's out and lse made those with attention sinks, in place
// (sinks.cu; ops.h's merge_sinks): lse' = logaddexp(lse, the row's head's
// sink), out times exp(lse - lse') (0 where lse' is -inf). out (batch, heads,
// rows, dim) of the element type, its last dim contiguous; lse float32,
// contiguous (batch, heads, rows); sinks float32 (heads).
struct SinkMerge {
  TensorView4d out;
  int64_t batch, heads, rows, dim;
  float* lse;
  const float* sinks;
};
void merge_sinks(const SinkMerge& merge, ElementType type, cudaStream_t stream);

// rng_state = {seed, offset, bits} (device memory), for the kernels to read (dropout.cu).
void write_rng_state(const PhiloxSource& source, int64_t* rng_state, cudaStream_t stream);

// Fills mask (device memory, contiguous (batch, heads, rows, len_k)) with dropout's keep decisions.
void dropout_mask(const DropoutMaskShape& shape, const DropoutParams& dropout, bool* mask, cudaStream_t stream);

}  // namespace flashattn_ext::cuda
