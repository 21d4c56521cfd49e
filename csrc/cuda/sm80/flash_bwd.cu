// The backward: the choice between the two backward paths, and the
// deterministic one (delta.cu computes delta first). P = exp(S - lse) is recomputed tile by tile; then
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dK += dS^T Q * scale,  dQ += dS K * scale
// with delta = rowsum(dO * O). The default path (flash_bwd_atomic.cu) adds dQ
// with atomics; the deterministic one here splits the work in two passes:
//   - dK/dV: one block per (key block, key/value head, batch); warps own 16 keys
//     each and work on the transposed scores S^T = K Q^T, streaming query blocks
//     of every query head of the group through double-buffered shared memory;
//   - dQ: one block per (query block, query head, batch), streaming key blocks.
// So its result is deterministic and needs no float32 dQ accumulator.
// With kDropout (Z: 0 where dropped, 1 / (1 - p) where kept): dS = P * (Z dP -
// delta) and dV += (P where kept)^T dO, times 1 / (1 - p) at the end. With
// kMasked, attn_mask enters the scores before the exponentials, and the dQ pass
// writes dS as the gradient of an additive mask where params.dmask asks for it.
#include <cmath>
#include <type_traits>

#include "cuda/attn_mask.cuh"
#include "cuda/dropout_flags.cuh"
#include "cuda/flash_cuda.h"
#include "cuda/launch.cuh"
#include "cuda/mma_tiles.cuh"
#include "cuda/ptx.cuh"
#include "cuda/score_modifiers.cuh"
#include "cuda/sm80/tile_config.h"
#include "cuda/tile_order.cuh"
#include "cuda/views.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda::sm80 {
namespace {

constexpr int kBlockStream = TwoPassBwdTiles::kBlockStream;

// Writes a warp's 16 x kHeadDim accumulator tile (times factor) to rows row0.. of a head.
template <typename Elem, int kHeadDim>
__device__ __forceinline__ void store_rows(Elem* head, int64_t stride_row, int64_t row0, int64_t len, int dim,
                                           const float (&acc)[kHeadDim / 8][4], float factor, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + lane / 4 + half * 8;
    if (row >= len) continue;
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt) {
      const int col = dt * 8 + (lane % 4) * 2;
      if (col < dim) {
        *reinterpret_cast<uint32_t*>(head + row * stride_row + col) =
            ptx::pack2<Elem>(acc[dt][2 * half] * factor, acc[dt][2 * half + 1] * factor);
      }
    }
  }
}

template <typename Elem, int kHeadDim, int kBlockWarps, bool kDropout, bool kMasked>
__global__ void __launch_bounds__(kBlockWarps * kWarpSize) attention_dkdv_kernel(const BwdParams params) {
  constexpr int kBlockThreads = kBlockWarps * kWarpSize;
  constexpr int kBlockRows = 16 * kBlockWarps;  // rows the block owns: keys (dK/dV) or queries (dQ)
  constexpr int kStride = smem_stride<kHeadDim>();
  constexpr int kTile = kBlockStream * kStride;  // elements of one streamed tile
  constexpr int kElemBytes = sizeof(Elem);
  constexpr int kQueryTiles = kBlockStream / 8;

  extern __shared__ __align__(16) unsigned char smem[];
  Elem* s_k = reinterpret_cast<Elem*>(smem);
  Elem* s_v = s_k + kBlockRows * kStride;
  Elem* s_q = s_v + kBlockRows * kStride;  // two buffers
  Elem* s_do = s_q + 2 * kTile;             // two buffers
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * kTile);  // two buffers
  float* s_delta = s_lse + 2 * kBlockStream;                  // two buffers

  const AttentionProblem& p = params.problem;
  const GridPosition position = grid_position(blockIdx.x, ceil_div(p.len_k, kBlockRows), p.heads_kv);
  const int64_t n_block = position.block, h_kv = position.head, b = position.batch;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t col0 = n_block * kBlockRows;  // first key of the block
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int dim = static_cast<int>(p.head_dim);

  load_tile_async<kBlockRows, kHeadDim, kBlockThreads>(s_k, head_ptr<const Elem>(params.k, b, h_kv), params.k.stride_row,
                                                  col0, p.len_k, dim);
  load_tile_async<kBlockRows, kHeadDim, kBlockThreads>(s_v, head_ptr<const Elem>(params.v, b, h_kv), params.v.stride_row,
                                                  col0, p.len_k, dim);

  // Query blocks that see some key of this block, for each query head of the group.
  const Visibility seen(p);
  const int64_t offset = seen.offset;
  const int64_t m_begin = seen.query_begin(col0) / kBlockStream;
  const int64_t m_count = ceil_div(p.len_q, kBlockStream) - m_begin;
  const int64_t steps = m_count * group;

  auto load_queries = [&](int64_t step) {
    const int buf = step & 1;
    const int64_t h = h_kv * group + step / m_count;
    const int64_t m0 = (m_begin + step % m_count) * kBlockStream;
    load_tile_async<kBlockStream, kHeadDim, kBlockThreads>(s_q + buf * kTile, head_ptr<const Elem>(params.q, b, h),
                                                      params.q.stride_row, m0, p.len_q, dim);
    load_tile_async<kBlockStream, kHeadDim, kBlockThreads>(s_do + buf * kTile, head_ptr<const Elem>(params.dout, b, h),
                                                      params.dout.stride_row, m0, p.len_q, dim);
    if (threadIdx.x < kBlockStream) {
      const int64_t row_base = (b * p.heads_q + h) * p.len_q;
      const int64_t row = m0 + threadIdx.x;
      s_lse[buf * kBlockStream + threadIdx.x] = lse_log2(static_cast<const float*>(params.lse) + row_base, row, p.len_q);
      s_delta[buf * kBlockStream + threadIdx.x] =
          row < p.len_q ? static_cast<const float*>(params.delta)[row_base + row] : 0.f;
    }
  };
  if (steps > 0) load_queries(0);
  ptx::cp_async_commit();

  const uint32_t k_frag = ptx::smem_addr(s_k) + (warp * 16 * kStride + a_lane_offset<kStride>(lane)) * kElemBytes;
  const uint32_t v_frag = ptx::smem_addr(s_v) + (warp * 16 * kStride + a_lane_offset<kStride>(lane)) * kElemBytes;
  const uint32_t q_rows = ptx::smem_addr(s_q) + b_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t q_trans = ptx::smem_addr(s_q) + a_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t do_rows = ptx::smem_addr(s_do) + b_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t do_trans = ptx::smem_addr(s_do) + a_lane_offset<kStride>(lane) * kElemBytes;
  const float scale_log2 = score_scale_log2(p);

  DropoutState dropout{};
  if constexpr (kDropout) dropout = dropout_state(params.dropout);
  float dk[1][kHeadDim / 8][4] = {}, dv[1][kHeadDim / 8][4] = {};
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps) load_queries(step + 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();
    const int buf = step & 1;
    const uint32_t buf_bytes = buf * kTile * kElemBytes;
    const float* lse = s_lse + buf * kBlockStream;
    const float* delta = s_delta + buf * kBlockStream;
    const int64_t m0 = (m_begin + step % m_count) * kBlockStream;

    // P^T = exp2(S^T * scale * log2(e) - lse), masked above the diagonal.
    float pt[1][kQueryTiles][4] = {};
    mma_rows_by_rows<Elem, 1, kQueryTiles, kHeadDim, kStride>(pt, k_frag, q_rows + buf_bytes);
    // Key r of this warp, query c of the tile: hidden iff r - c > diagonal.
    // Only tiles that cross the diagonal pay for the test.
    const int diagonal = static_cast<int>(min(max(m0 + offset - col0, int64_t(-kBlockRows - 1)), int64_t(kBlockStream)));
    const HeadMaskLog2<Elem> mask(params.mask_kind, params.mask, b, h_kv * group + step / m_count);
    auto probabilities = [&](auto mask_tag) {
#pragma unroll
      for (int nt = 0; nt < kQueryTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + (lane % 4) * 2 + e % 2;
          float x = pt[0][nt][e] * scale_log2;
          if constexpr (kMasked) {
            const int64_t key = col0 + warp * 16 + lane / 4 + (e / 2) * 8;
            if (key < p.len_k && m0 + c < p.len_q) x = mask.apply(x, m0 + c, key);
          }
          pt[0][nt][e] = ptx::exp2_approx(x - lse[c]);
          if constexpr (decltype(mask_tag)::value) {
            const int r = warp * 16 + lane / 4 + (e / 2) * 8;
            if (r - c > diagonal) pt[0][nt][e] = 0.f;
          }
        }
      }
    };
    if (p.is_causal && col0 + kBlockRows - 1 > m0 + offset) {
      probabilities(std::true_type{});
    } else {
      probabilities(std::false_type{});
    }
    // dV += P^T dO (P^T where dropout keeps it).
    bool keep[1][kQueryTiles][4];
    if constexpr (kDropout) {
      const int64_t h = h_kv * group + step / m_count;
      dropout_keep_fragments</*kKeyRows=*/true>(keep, dropout, p, b * p.heads_q + h, col0 + warp * 16, m0, lane);
      float kept[1][kQueryTiles][4];
#pragma unroll
      for (int nt = 0; nt < kQueryTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) kept[0][nt][e] = keep[0][nt][e] ? pt[0][nt][e] : 0.f;
      }
      mma_regs_by_rows<Elem, 1, kBlockStream, kHeadDim, kStride>(dv, kept, do_trans + buf_bytes);
    } else {
      mma_regs_by_rows<Elem, 1, kBlockStream, kHeadDim, kStride>(dv, pt, do_trans + buf_bytes);
    }
    // dP^T = V dO^T; dS^T = P^T * (Z dP^T - delta).
    float dst[1][kQueryTiles][4] = {};
    mma_rows_by_rows<Elem, 1, kQueryTiles, kHeadDim, kStride>(dst, v_frag, do_rows + buf_bytes);
#pragma unroll
    for (int nt = 0; nt < kQueryTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float dp = dst[0][nt][e];
        if constexpr (kDropout) dp = keep[0][nt][e] ? dp * dropout.keep_scale : 0.f;
        dst[0][nt][e] = score_gradient<kMasked>(pt[0][nt][e], dp, delta[nt * 8 + (lane % 4) * 2 + e % 2]);
      }
    }
    if (col0 == 0 && warp == 0 && lane < 4) {  // the lanes that hold key 0 (registers e < 2)
      const RowRange alone = rows_seeing_first_key_alone(params, offset, m0, kBlockStream);
#pragma unroll
      for (int nt = 0; nt < kQueryTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (alone.holds(nt * 8 + (lane % 4) * 2 + e % 2)) dst[0][nt][e] = 0.f;
        }
      }
    }
    // dK += dS^T Q (scaled at the end).
    mma_regs_by_rows<Elem, 1, kBlockStream, kHeadDim, kStride>(dk, dst, q_trans + buf_bytes);
    __syncthreads();
  }

  const int64_t key0 = col0 + warp * 16;
  store_rows<Elem, kHeadDim>(head_ptr<Elem>(params.dk, b, h_kv), params.dk.stride_row, key0, p.len_k, dim, dk[0],
                             static_cast<float>(p.scale), lane);
  store_rows<Elem, kHeadDim>(head_ptr<Elem>(params.dv, b, h_kv), params.dv.stride_row, key0, p.len_k, dim, dv[0],
                             kDropout ? dropout.keep_scale : 1.f, lane);
}

template <typename Elem, int kHeadDim, int kBlockWarps, bool kDropout, bool kMasked>
__global__ void __launch_bounds__(kBlockWarps * kWarpSize) attention_dq_kernel(const BwdParams params) {
  constexpr int kBlockThreads = kBlockWarps * kWarpSize;
  constexpr int kBlockRows = 16 * kBlockWarps;  // rows the block owns: keys (dK/dV) or queries (dQ)
  constexpr int kStride = smem_stride<kHeadDim>();
  constexpr int kTile = kBlockStream * kStride;
  constexpr int kElemBytes = sizeof(Elem);
  constexpr int kKeyTiles = kBlockStream / 8;

  extern __shared__ __align__(16) unsigned char smem[];
  Elem* s_q = reinterpret_cast<Elem*>(smem);
  Elem* s_do = s_q + kBlockRows * kStride;
  Elem* s_k = s_do + kBlockRows * kStride;  // two buffers
  Elem* s_v = s_k + 2 * kTile;              // two buffers

  const AttentionProblem& p = params.problem;
  const int64_t m_blocks = ceil_div(p.len_q, kBlockRows);
  const int64_t m_block = m_blocks - 1 - blockIdx.x % m_blocks;  // longest causal rows first
  const int64_t h = (blockIdx.x / m_blocks) % p.heads_q;
  const int64_t b = blockIdx.x / (m_blocks * p.heads_q);
  const int64_t h_kv = h / (p.heads_q / p.heads_kv);
  const int64_t row0 = m_block * kBlockRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int dim = static_cast<int>(p.head_dim);
  const Elem* k = head_ptr<const Elem>(params.k, b, h_kv);
  const Elem* v = head_ptr<const Elem>(params.v, b, h_kv);

  load_tile_async<kBlockRows, kHeadDim, kBlockThreads>(s_q, head_ptr<const Elem>(params.q, b, h), params.q.stride_row,
                                                  row0, p.len_q, dim);
  load_tile_async<kBlockRows, kHeadDim, kBlockThreads>(s_do, head_ptr<const Elem>(params.dout, b, h),
                                                  params.dout.stride_row, row0, p.len_q, dim);
  const Visibility seen(p);
  const int64_t offset = seen.offset;
  const int n_steps = static_cast<int>(ceil_div(seen.key_end_of_rows(row0, kBlockRows), kBlockStream));
  auto load_keys = [&](int step) {
    const int buf = step & 1;
    load_tile_async<kBlockStream, kHeadDim, kBlockThreads>(s_k + buf * kTile, k, params.k.stride_row,
                                                      int64_t(step) * kBlockStream, p.len_k, dim);
    load_tile_async<kBlockStream, kHeadDim, kBlockThreads>(s_v + buf * kTile, v, params.v.stride_row,
                                                      int64_t(step) * kBlockStream, p.len_k, dim);
  };
  if (n_steps > 0) load_keys(0);
  ptx::cp_async_commit();

  // This lane's two rows: their lse (log2 units) and delta.
  const int64_t row_base = (b * p.heads_q + h) * p.len_q;
  float row_lse[2], row_delta[2];
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + warp * 16 + lane / 4 + half * 8;
    row_lse[half] = lse_log2(static_cast<const float*>(params.lse) + row_base, row, p.len_q);
    row_delta[half] = row < p.len_q ? static_cast<const float*>(params.delta)[row_base + row] : 0.f;
  }

  const uint32_t q_frag = ptx::smem_addr(s_q) + (warp * 16 * kStride + a_lane_offset<kStride>(lane)) * kElemBytes;
  const uint32_t do_frag = ptx::smem_addr(s_do) + (warp * 16 * kStride + a_lane_offset<kStride>(lane)) * kElemBytes;
  const uint32_t k_rows = ptx::smem_addr(s_k) + b_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t k_trans = ptx::smem_addr(s_k) + a_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t v_rows = ptx::smem_addr(s_v) + b_lane_offset<kStride>(lane) * kElemBytes;
  const float scale_log2 = score_scale_log2(p);

  DropoutState dropout{};
  if constexpr (kDropout) dropout = dropout_state(params.dropout);
  const HeadMaskLog2<Elem> mask(params.mask_kind, params.mask, b, h);
  float dq[1][kHeadDim / 8][4] = {};
  for (int step = 0; step < n_steps; ++step) {
    if (step + 1 < n_steps) load_keys(step + 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();
    const uint32_t buf_bytes = (step & 1) * kTile * kElemBytes;
    const int64_t col0 = int64_t(step) * kBlockStream;

    // P = exp2(S * scale * log2(e) - lse), masked past the last key and above the diagonal.
    float s[1][kKeyTiles][4] = {};
    mma_rows_by_rows<Elem, 1, kKeyTiles, kHeadDim, kStride>(s, q_frag, k_rows + buf_bytes);
    // Query r of this warp, key c of the tile: hidden iff c >= keys_left or,
    // causal, c - r > diagonal. Only the last tile and diagonal tiles pay for the test.
    const bool mask_causal = p.is_causal && col0 + kBlockStream - 1 > row0 + offset;
    const int keys_left = static_cast<int>(min(p.len_k - col0, int64_t(kBlockStream)));
    const int diagonal = static_cast<int>(min(max(row0 + offset - col0, int64_t(-kBlockRows - 1)), int64_t(kBlockStream)));
    auto probabilities = [&](auto mask_tag) {
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[0][nt][e] * scale_log2;
          if constexpr (kMasked) {
            const int64_t query = row0 + warp * 16 + lane / 4 + (e / 2) * 8, key = col0 + nt * 8 + (lane % 4) * 2 + e % 2;
            if (key < p.len_k && query < p.len_q) x = mask.apply(x, query, key);
          }
          s[0][nt][e] = ptx::exp2_approx(x - row_lse[e / 2]);
          if constexpr (decltype(mask_tag)::value) {
            const int r = warp * 16 + lane / 4 + (e / 2) * 8;
            const int c = nt * 8 + (lane % 4) * 2 + e % 2;
            if (c >= keys_left || (mask_causal && c - r > diagonal)) s[0][nt][e] = 0.f;
          }
        }
      }
    };
    if (mask_causal || col0 + kBlockStream > p.len_k) {
      probabilities(std::true_type{});
    } else {
      probabilities(std::false_type{});
    }
    // dP = dO V^T; dS = P * (Z dP - delta).
    float ds[1][kKeyTiles][4] = {};
    mma_rows_by_rows<Elem, 1, kKeyTiles, kHeadDim, kStride>(ds, do_frag, v_rows + buf_bytes);
    bool keep[1][kKeyTiles][4];
    if constexpr (kDropout) {
      dropout_keep_fragments</*kKeyRows=*/false>(keep, dropout, p, b * p.heads_q + h, row0 + warp * 16, col0, lane);
    }
    // Key 0 is column 0 of the lanes with lane % 4 == 0 (registers e % 2 == 0).
    const RowRange first_key_alone = col0 == 0 && lane % 4 == 0
                                         ? rows_seeing_first_key_alone(params, offset, row0, kBlockRows)
                                         : RowRange{0, 0};
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float dp = ds[0][nt][e];
        if constexpr (kDropout) dp = keep[0][nt][e] ? dp * dropout.keep_scale : 0.f;
        ds[0][nt][e] = score_gradient<kMasked>(s[0][nt][e], dp, row_delta[e / 2]);
        if (nt == 0 && e % 2 == 0 && first_key_alone.holds(warp * 16 + lane / 4 + (e / 2) * 8)) ds[0][nt][e] = 0.f;
        if (kMasked && params.dmask.data != nullptr) {
          const int64_t query = row0 + warp * 16 + lane / 4 + (e / 2) * 8, key = col0 + nt * 8 + (lane % 4) * 2 + e % 2;
          if (key < p.len_k && query < p.len_q) store_mask_grad<Elem>(params.dmask, b, h, query, key, ds[0][nt][e]);
        }
      }
    }
    // dQ += dS K (scaled at the end).
    mma_regs_by_rows<Elem, 1, kBlockStream, kHeadDim, kStride>(dq, ds, k_trans + buf_bytes);
    __syncthreads();
  }

  store_rows<Elem, kHeadDim>(head_ptr<Elem>(params.dq, b, h), params.dq.stride_row, row0 + warp * 16, p.len_q, dim,
                             dq[0], static_cast<float>(p.scale), lane);
}

// Four warps per block for both passes: eight measured the same on an H100.
template <typename Elem, int kHeadDim, int kDkdvWarps = TwoPassBwdTiles::kDkdvWarps,
          int kDqWarps = TwoPassBwdTiles::kDqWarps>
void two_pass_backward(const BwdParams& params, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  constexpr int kStride = smem_stride<kHeadDim>();
  constexpr int dkdv_rows = 16 * kDkdvWarps;
  constexpr int dkdv_smem =
      (2 * dkdv_rows + 4 * kBlockStream) * kStride * sizeof(Elem) + 4 * kBlockStream * sizeof(float);
  constexpr int dq_rows = 16 * kDqWarps;
  constexpr int dq_smem = (2 * dq_rows + 4 * kBlockStream) * kStride * sizeof(Elem);
  dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
    dispatch_flag(params.mask_kind != MaskKind::kNone, [&](auto masked) {
      constexpr bool kDropout = decltype(dropout)::value, kMasked = decltype(masked)::value;
      launch_kernel(attention_dkdv_kernel<Elem, kHeadDim, kDkdvWarps, kDropout, kMasked>,
                    ceil_div(p.len_k, dkdv_rows) * p.heads_kv * p.batch, kDkdvWarps * kWarpSize, dkdv_smem, params,
                    stream);
      launch_kernel(attention_dq_kernel<Elem, kHeadDim, kDqWarps, kDropout, kMasked>,
                    ceil_div(p.len_q, dq_rows) * p.heads_q * p.batch, kDqWarps * kWarpSize, dq_smem, params, stream);
    });
  });
}

}  // namespace

void attention_backward(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  compute_delta(params, type, stream);
  // (The atomic pass adds into the rows of every pair: a chunked workspace is the Hopper backward's.)
  if (params.dq_accum != nullptr && p.head_dim <= kMaxAtomicDqHeadDim &&
      params.dq_accum_pairs == p.batch * p.heads_kv) {
    attention_backward_atomic_dq(params, type, stream);
    convert_dq_accum(params, type, DqAccumLayout::kRows, stream);
    return;
  }
  dispatch_element_type(type, [&](auto elem) {
    dispatch_head_dim(p.head_dim, [&](auto head_dim) {
      two_pass_backward<decltype(elem), decltype(head_dim)::value>(params, stream);
    });
  });
}

}  // namespace flashattn_ext::cuda::sm80
