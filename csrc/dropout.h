// Dropout's random numbers, shared by the CPU and CUDA kernels (no torch headers).
//
// Each (batch * heads_q + head, query, key) pair gets a random number of
// `bits` bits, 8 (the default) or 16; the pair is kept iff that number is at
// least dropout_threshold(p, bits) = round(p * 2^bits). So the drop
// probability is p rounded to a multiple of 2^-bits (1/256 with 8 bits: 0.1
// drops 26/256 = 0.1016), while a kept score is scaled by 1 / (1 - p) as in
// torch's dropout. The bit count is chosen per call (set_dropout_bits) and
// recorded in rng_state, so a backward draws what its forward drew.
//
// The numbers come from Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", 2011), keyed by the seed, for groups of 16
// pairs: queries {a, a+1, a+8, a+9} x keys {c, c+1, c+8, c+9} with a and c even
// and a % 16 < 8, c % 16 < 8. A lane of an mma.sync or wgmma fragment holds
// half of a group, whether the fragment's rows are queries (S) or keys (S^T):
// two rows of one parity x four columns. Of a pair, let qp = query % 2, kp =
// key % 2, qh = (query % 16 >= 8) and kh = (key % 16 >= 8):
//   8 bits: one Philox call a group; byte qh * 2 + kh of output qp * 2 + kp.
//   16 bits: two calls a group, call qp; half kh of output kp * 2 + qh.
// A lane pair of a fragment thus makes one call each for two groups and swaps
// halves (8 bits), or one call for each of its own halves (16 bits, queries as
// rows) (cuda/dropout_flags.cuh).
//
// The counter follows torch's Philox convention (curand's subsequence and
// offset): its high 64 bits are the call's index (the group's with 8 bits,
// 2 * group + qp with 16), its low 64 bits offset / 4. Every attention call
// reserves 4 of the generator's offset, so calls on one generator never share
// a counter.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHATTN_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHATTN_EXT_HOST_DEVICE inline
#endif

namespace flashattn_ext {

// The generator offset that one call reserves.
constexpr uint64_t kDropoutOffsetIncrement = 4;

// rng_state's values: {seed, offset, bits}.
constexpr int64_t kRngStateSize = 3;
constexpr int kDefaultDropoutBits = 8;

// What the kernels need for dropout. rng_state points at {seed, offset, bits}
// in the memory of the kernels that read it (device memory for CUDA): written
// by the forward, read again by the backward, so that both see the same numbers.
struct DropoutParams {
  double p = 0.0;  // 0: no dropout
  const int64_t* rng_state = nullptr;
};

// The bits of the numbers that rng_state records: 16, or else 8 (the ops check
// the value where rng_state is in host memory; device code cannot).
FLASHATTN_EXT_HOST_DEVICE int dropout_bits_of(const int64_t* rng_state) { return rng_state[2] == 16 ? 16 : 8; }

// The keep mask of query rows [row_begin, row_end) of a (batch, heads, len_q,
// len_k) attention call, as the dropout_mask op returns it.
struct DropoutMaskShape {
  int64_t batch, heads, len_q, len_k, row_begin, row_end;
};

struct PhiloxOutput {
  uint32_t x[4];
};

// The high and low words of the 64-bit product a * b. On the GPU from
// __umulhi and a plain multiply, which nvcc 13 fuses into one wide multiply:
// from a 64-bit product it adds a zero to the high word after each.
FLASHATTN_EXT_HOST_DEVICE void multiply_wide(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t product = uint64_t{a} * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
#endif
}

// Philox4x32 with 10 rounds.
FLASHATTN_EXT_HOST_DEVICE PhiloxOutput philox4x32_10(uint64_t seed, uint64_t counter_low, uint64_t counter_high) {
  uint32_t c0 = static_cast<uint32_t>(counter_low), c1 = static_cast<uint32_t>(counter_low >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_high), c3 = static_cast<uint32_t>(counter_high >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    multiply_wide(0xD2511F53u, c0, hi0, lo0);
    multiply_wide(0xCD9E8D57u, c2, hi1, lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// The numbers below this one are dropped: round(p * 2^bits).
FLASHATTN_EXT_HOST_DEVICE uint32_t dropout_threshold(double p, int bits) {
  const double levels = static_cast<double>(1u << bits), scaled = p * levels + 0.5;
  return scaled >= levels ? 1u << bits : static_cast<uint32_t>(scaled);
}

// The factor of a kept score: 1 / (1 - p), as in torch's dropout; 0 when p = 1.
FLASHATTN_EXT_HOST_DEVICE double dropout_keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

// The groups along a query row (or key column) of length len: four a 16.
FLASHATTN_EXT_HOST_DEVICE int64_t dropout_quads(int64_t len) { return (len + 15) / 16 * 4; }
// The group column (row) of key (query) i.
FLASHATTN_EXT_HOST_DEVICE int64_t dropout_quad(int64_t i) { return i / 16 * 4 + i % 8 / 2; }

// The index of the group of the pair (query, key) of head bh (batch *
// heads_q + head), among all groups of one attention call. Along a query row
// the group grows by 4 a 16 keys; down a key column by 4 * dropout_quads(len_k)
// a 16 queries.
FLASHATTN_EXT_HOST_DEVICE uint64_t dropout_group(int64_t bh, int64_t query, int64_t key, int64_t len_q,
                                                 int64_t len_k) {
  return static_cast<uint64_t>((bh * dropout_quads(len_q) + dropout_quad(query)) * dropout_quads(len_k) +
                               dropout_quad(key));
}

// The Philox call of index `call` (see above), from the saved {seed, offset}.
FLASHATTN_EXT_HOST_DEVICE PhiloxOutput dropout_call(uint64_t seed, uint64_t offset, uint64_t call) {
  return philox4x32_10(seed, offset / 4, call);
}

// Where a pair's number lies in its group's Philox outputs (see above): the
// group's call (0; 0 or 1 with 16 bits), the output word and the bit shift in
// it. It depends on query % 16 and key % 16 only.
struct DropoutSlot {
  int call, word, shift;
};

FLASHATTN_EXT_HOST_DEVICE DropoutSlot dropout_slot(int bits, int64_t query, int64_t key) {
  const int qp = int(query % 2), kp = int(key % 2), qh = int(query % 16 >= 8), kh = int(key % 16 >= 8);
  if (bits == 8) return {0, qp * 2 + kp, 8 * (qh * 2 + kh)};
  return {qp, kp * 2 + qh, 16 * kh};
}

// The Philox calls of a group: one with 8 bits, two with 16.
FLASHATTN_EXT_HOST_DEVICE constexpr int dropout_group_calls(int bits) { return bits / 8; }

// The index of a group's call (slot.call): the group's own with 8 bits, 2 * group + call with 16.
FLASHATTN_EXT_HOST_DEVICE uint64_t dropout_call_index(uint64_t group, int bits, int call) {
  return group * static_cast<uint64_t>(dropout_group_calls(bits)) + call;
}

// The number at slot in the output of its call.
FLASHATTN_EXT_HOST_DEVICE uint32_t dropout_slot_number(const PhiloxOutput& output, DropoutSlot slot, int bits) {
  return output.x[slot.word] >> slot.shift & ((1u << bits) - 1);
}

// The random number of one pair (one Philox call: for code that needs single
// pairs, not for the kernels' inner loops).
FLASHATTN_EXT_HOST_DEVICE uint32_t dropout_number(uint64_t seed, uint64_t offset, int bits, int64_t bh, int64_t query,
                                                  int64_t key, int64_t len_q, int64_t len_k) {
  const DropoutSlot slot = dropout_slot(bits, query, key);
  const uint64_t call = dropout_call_index(dropout_group(bh, query, key, len_q, len_k), bits, slot.call);
  return dropout_slot_number(dropout_call(seed, offset, call), slot, bits);
}

}  // namespace flashattn_ext
