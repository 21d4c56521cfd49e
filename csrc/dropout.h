// Dropout's random numbers, shared by the CPU and CUDA kernels (no torch headers).
//
// Each (batch * heads_q + head, query, key) pair gets a 16-bit random number;
// the pair is kept iff that number is at least round(dropout_p * 65536), so the
// keep probability is 1 - dropout_p to within 2^-17. The numbers come from
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// 2011), keyed by the seed, in groups of eight pairs per call: queries {a, a+8}
// x keys {c, c+1, c+8, c+9} with a % 16 < 8 and c % 16 < 8 even. That is one
// thread's piece of a 16 x 16 block of mma.sync fragments, so a kernel whose
// score rows are queries makes one call per eight scores, and one whose rows
// are keys (S^T) one call per four.
//
// The counter follows torch's Philox convention (curand's subsequence and
// offset): its high 64 bits are the group's index, its low 64 bits offset / 4.
// Every call reserves 4 of the generator's offset (one Philox output per
// group), so calls on one generator never share a counter.
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

// What the kernels need for dropout. rng_state points at {seed, offset} in the
// memory of the kernels that read it (device memory for CUDA): written by the
// forward, read again by the backward, so that both see the same numbers.
struct DropoutParams {
  double p = 0.0;  // 0: no dropout
  const int64_t* rng_state = nullptr;
};

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

// The 16-bit numbers below this one are dropped.
FLASHATTN_EXT_HOST_DEVICE uint32_t dropout_threshold(double p) {
  const double scaled = p * 65536.0 + 0.5;
  return scaled >= 65536.0 ? 65536u : static_cast<uint32_t>(scaled);
}

// The factor of a kept score: 1 / (1 - p), as in torch's dropout; 0 when p = 1.
FLASHATTN_EXT_HOST_DEVICE double dropout_keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

// The Philox calls of one query row pair (a, a + 8) of a head: the step of
// dropout_group from query a to a + 1.
FLASHATTN_EXT_HOST_DEVICE int64_t dropout_key_quads(int64_t len_k) { return (len_k + 15) / 16 * 4; }

// The index of the Philox call that serves the pair (query, key) of head bh
// (batch * heads_q + head), among all calls of one attention call.
FLASHATTN_EXT_HOST_DEVICE uint64_t dropout_group(int64_t bh, int64_t query, int64_t key, int64_t len_q,
                                                 int64_t len_k) {
  const int64_t query_pairs = (len_q + 15) / 16 * 8, key_quads = dropout_key_quads(len_k);
  const int64_t query_pair = query / 16 * 8 + query % 8, key_quad = key / 16 * 4 + key % 8 / 2;
  return static_cast<uint64_t>((bh * query_pairs + query_pair) * key_quads + key_quad);
}

// Which of the group's eight 16-bit numbers belongs to (query, key).
FLASHATTN_EXT_HOST_DEVICE int dropout_slot(int64_t query, int64_t key) {
  return int(query % 16 >= 8) * 4 + int(key % 16 >= 8) * 2 + int(key % 2);
}

// The group's eight numbers, from the saved {seed, offset}.
FLASHATTN_EXT_HOST_DEVICE PhiloxOutput dropout_numbers(uint64_t seed, uint64_t offset, uint64_t group) {
  return philox4x32_10(seed, offset / 4, group);
}

FLASHATTN_EXT_HOST_DEVICE bool dropout_keeps(const PhiloxOutput& numbers, int slot, uint32_t threshold) {
  return ((numbers.x[slot / 2] >> (16 * (slot % 2))) & 0xFFFFu) >= threshold;
}

}  // namespace flashattn_ext
