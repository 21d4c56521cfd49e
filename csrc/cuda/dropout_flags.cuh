// Dropout inside the kernels: the per-call DropoutState and the keep decisions
// of a warp's score fragments, from the Philox numbers of dropout.h. Included by
// the forwards and backwards of both families.
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"
#include "flash_params.h"

namespace flashattn_ext::cuda {

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

}  // namespace flashattn_ext::cuda
