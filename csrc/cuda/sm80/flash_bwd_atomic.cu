// The default backward for head dims up to 128 (kMaxAtomicDqHeadDim): one pass
// over key blocks computes dK, dV and dQ, adding dQ into a float32 accumulator
// with atomics. One block of 8 warps per (128 keys, key/value head, batch); it
// streams 64-query tiles of every query head of the group through two
// shared-memory buffers. Per tile:
//   1. S^T = K Q^T and dP^T = V dO^T, 32 keys x 32 queries per warp; P^T and
//      dS^T = P^T * (dP^T - delta) go to shared memory, rounded to Elem;
//   2. dV += P^T dO and dK += dS^T Q, 32 keys x D/2 columns per warp, kept in
//      registers for the whole pass; between the two,
//   3. dQ tile = dS K, one piece per warp, added to dq_accum (red.global.add).
// The warps change roles between phases, so each mma operand comes from shared
// memory in 32-wide tiles (about two mma per ldmatrix). A last kernel scales
// dq_accum and rounds it into dq. Delta = rowsum(dO * O) comes from delta.cu.
// With kDropout (Z: 0 where dropped, 1 / (1 - p) where kept), dS^T = P^T *
// (Z dP^T - delta) and dV += (P^T where kept) dO, times 1 / (1 - p) at the end.
// With kMasked, attn_mask enters S^T before the exponentials, and dS^T is also
// written out as the gradient of an additive mask where params.dmask asks for it.
#include <cmath>
#include <type_traits>

#include "cuda/attn_mask.cuh"
#include "cuda/dq_accum.cuh"
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

template <typename Elem, typename Cfg, bool kDropout, bool kMasked>
__global__ void __launch_bounds__(Cfg::kThreads) attention_backward_atomic_dq_kernel(const BwdParams params) {
  constexpr int kHeadDim = Cfg::kHeadDim, kBlockN = Cfg::kBlockN, kBlockM = Cfg::kBlockM, kStride = Cfg::kStride,
                kScoreStride = Cfg::kScoreStride, kThreads = Cfg::kThreads;
  constexpr int kTile = kBlockM * kStride;  // elements of one streamed tile
  constexpr int kElemBytes = sizeof(Elem);
  constexpr int kHalfDimTiles = kHeadDim / 16;  // n8 tiles of a warp's dK/dV columns
  constexpr Operand kRows = Operand::kRowMajor, kKMajor = Operand::kKMajor;
  static_assert(kElemBytes == 2, "kSmemBytes counts 16-bit elements");

  extern __shared__ __align__(16) unsigned char smem[];
  Elem* s_k = reinterpret_cast<Elem*>(smem);
  Elem* s_v = s_k + kBlockN * kStride;
  Elem* s_q = s_v + kBlockN * kStride;                    // two buffers
  Elem* s_do = s_q + 2 * kTile;                           // two buffers
  Elem* s_pt = s_do + 2 * kTile;                          // P^T: kBlockN x kBlockM
  Elem* s_dst = s_pt + kBlockN * kScoreStride;            // dS^T: kBlockN x kBlockM
  float* s_lse = reinterpret_cast<float*>(s_dst + kBlockN * kScoreStride);  // two buffers
  float* s_delta = s_lse + 2 * kBlockM;                                     // two buffers

  const AttentionProblem& p = params.problem;
  const GridPosition position = grid_position(blockIdx.x, ceil_div(p.len_k, kBlockN), p.heads_kv);
  const int64_t n_block = position.block, h_kv = position.head, b = position.batch;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t col0 = n_block * kBlockN;  // first key of the block
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int dim = static_cast<int>(p.head_dim);

  load_tile_async<kBlockN, kHeadDim, kThreads>(s_k, head_ptr<const Elem>(params.k, b, h_kv), params.k.stride_row, col0,
                                               p.len_k, dim);
  load_tile_async<kBlockN, kHeadDim, kThreads>(s_v, head_ptr<const Elem>(params.v, b, h_kv), params.v.stride_row, col0,
                                               p.len_k, dim);

  // Query tiles that see some key of this block, for each query head of the group.
  const Visibility seen(p);
  const int64_t offset = seen.offset;
  const int64_t m_begin = seen.query_begin(col0) / kBlockM, m_end = ceil_div(p.len_q, kBlockM);
  const int64_t steps = (m_end - m_begin) * group;

  // A step's work: query tile m (rows m * kBlockM..) of query head h. Steps run
  // through the tiles of one head, then of the next head of the group; counted
  // along, not divided out (64-bit division is slow).
  struct Work {
    int64_t m, h;
  };
  auto next = [&](Work w) { return w.m + 1 < m_end ? Work{w.m + 1, w.h} : Work{m_begin, w.h + 1}; };
  auto load_queries = [&](Work w, int buf) {
    const int64_t m0 = w.m * kBlockM;
    load_tile_async<kBlockM, kHeadDim, kThreads>(s_q + buf * kTile, head_ptr<const Elem>(params.q, b, w.h),
                                                 params.q.stride_row, m0, p.len_q, dim);
    load_tile_async<kBlockM, kHeadDim, kThreads>(s_do + buf * kTile, head_ptr<const Elem>(params.dout, b, w.h),
                                                 params.dout.stride_row, m0, p.len_q, dim);
    if (threadIdx.x < kBlockM) {
      const int64_t row_base = (b * p.heads_q + w.h) * p.len_q;
      const int64_t row = m0 + threadIdx.x;
      s_lse[buf * kBlockM + threadIdx.x] = lse_log2(static_cast<const float*>(params.lse) + row_base, row, p.len_q);
      s_delta[buf * kBlockM + threadIdx.x] =
          row < p.len_q ? static_cast<const float*>(params.delta)[row_base + row] : 0.f;
    }
  };
  Work work{m_begin, h_kv * group};
  if (steps > 0) load_queries(work, 0);
  ptx::cp_async_commit();

  // Warp roles: phases 1 and 2 give the warp keys key0..key0+31; phase 1 queries
  // query0..query0+31, phase 2 columns dim0..dim0+D/2-1; phase 3 one dQ piece.
  const int key0 = (warp % 4) * 32, query0 = (warp / 4) * 32, dim0 = (warp / 4) * (kHeadDim / 2);
  const int dq_row0 = (warp % Cfg::kDqWarpRows) * Cfg::kDqMTiles * 16;
  const int dq_col0 = (warp / Cfg::kDqWarpRows) * Cfg::kDqNTiles * 8;
  const uint32_t k_smem = ptx::smem_addr(s_k), v_smem = ptx::smem_addr(s_v), q_smem = ptx::smem_addr(s_q),
                 do_smem = ptx::smem_addr(s_do), pt_smem = ptx::smem_addr(s_pt), dst_smem = ptx::smem_addr(s_dst);
  const float scale_log2 = score_scale_log2(p);
  // dq_accum is (batch, heads_q, padded_len_q, kDqCols): rows and columns past
  // the ends take the zeros that dS (P = 0) and K (zero-filled) give them, so
  // the atomics need no bounds checks.
  const int64_t padded_len_q = ceil_div(p.len_q, kBlockM) * kBlockM;
  constexpr int kDqCols = dq_accum_cols(kHeadDim);
  // Keys past the end must be masked: their S is 0, so P would not be.
  const int keys_left = static_cast<int>(min(p.len_k - col0, int64_t(kBlockN)));

  DropoutState dropout{};
  if constexpr (kDropout) dropout = dropout_state(params.dropout);

  float dk[2][kHalfDimTiles][4] = {}, dv[2][kHalfDimTiles][4] = {};
  for (int64_t step = 0; step < steps; ++step) {
    // The tile of this step has landed and every warp is done with the last one,
    // so the next tile may load into the other buffer while this one is used.
    ptx::cp_async_wait<0>();
    __syncthreads();
    const int buf = step & 1;
    const Work next_work = next(work);
    const uint32_t q_buf = q_smem + buf * kTile * kElemBytes, do_buf = do_smem + buf * kTile * kElemBytes;
    const float* lse = s_lse + buf * kBlockM;
    const float* delta = s_delta + buf * kBlockM;
    const int64_t m0 = work.m * kBlockM;

    // 1. P^T = exp2(S^T * scale * log2(e) - lse) and dS^T = P^T * (dP^T - delta).
    // P^T is computed before dP^T, so that its exponentials overlap the mma of
    // dP^T (one basic block; the masking comes after both).
    float pt[2][4][4] = {}, dst[2][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t k_step = kk * 16 * kElemBytes;
      mma_smem_by_smem<Elem, 2, 4, 16, kRows, kStride, kRows, kStride>(
          pt, k_smem + key0 * kStride * kElemBytes + k_step, q_buf + query0 * kStride * kElemBytes + k_step, lane);
    }
    float col_lse[4][2], col_delta[4][2];  // of this lane's 8 query columns
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int c = query0 + nt * 8 + (lane % 4) * 2;
      const float2 l = *reinterpret_cast<const float2*>(lse + c), d = *reinterpret_cast<const float2*>(delta + c);
      col_lse[nt][0] = l.x, col_lse[nt][1] = l.y, col_delta[nt][0] = d.x, col_delta[nt][1] = d.y;
    }
    const HeadMaskLog2<Elem> mask(params.mask_kind, params.mask, b, work.h);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = pt[mt][nt][e] * scale_log2;
          if constexpr (kMasked) {
            const int64_t key = col0 + key0 + mt * 16 + lane / 4 + (e / 2) * 8;
            const int64_t query = m0 + query0 + nt * 8 + (lane % 4) * 2 + e % 2;
            if (key < p.len_k && query < p.len_q) x = mask.apply(x, query, key);
          }
          pt[mt][nt][e] = ptx::exp2_approx(x - col_lse[nt][e % 2]);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t k_step = kk * 16 * kElemBytes;
      mma_smem_by_smem<Elem, 2, 4, 16, kRows, kStride, kRows, kStride>(
          dst, v_smem + key0 * kStride * kElemBytes + k_step, do_buf + query0 * kStride * kElemBytes + k_step, lane);
    }
    // Key r, query c of the block: hidden iff causal and r - c > diagonal (clamped
    // to the range of r - c), or r >= keys_left. Only tiles that cross the
    // diagonal or the end of the keys pay for the test.
    const bool mask_causal = p.is_causal && col0 + kBlockN - 1 > m0 + offset;
    const bool mask_keys = keys_left < kBlockN;
    const int diagonal = static_cast<int>(min(max(m0 + offset - col0, int64_t(-kBlockM)), int64_t(kBlockN)));
    if (mask_causal || mask_keys) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = key0 + mt * 16 + lane / 4 + (e / 2) * 8;
            const int c = query0 + nt * 8 + (lane % 4) * 2 + e % 2;
            if ((mask_causal && r - c > diagonal) || r >= keys_left) pt[mt][nt][e] = 0.f;
          }
        }
      }
    }
    // dS^T = P^T * (Z dP^T - delta), written out as a float mask's gradient where
    // asked for; then P^T where dropout keeps it, for dV.
    bool keep[2][4][4];
    if constexpr (kDropout) {
      dropout_keep_fragments</*kKeyRows=*/true>(keep, dropout, p, b * p.heads_q + work.h, col0 + key0, m0 + query0,
                                                lane);
    }
    const bool store_dmask = kMasked && params.dmask.data != nullptr;
    // Key 0 is row 0 of warp tile mt = 0 in the lanes with lane < 4 (registers e < 2).
    const RowRange first_key_alone = col0 + key0 == 0 && lane < 4
                                         ? rows_seeing_first_key_alone(params, offset, m0 + query0, 32)
                                         : RowRange{0, 0};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float dp = dst[mt][nt][e];
          if constexpr (kDropout) dp = keep[mt][nt][e] ? dp * dropout.keep_scale : 0.f;
          dst[mt][nt][e] = score_gradient<kMasked>(pt[mt][nt][e], dp, col_delta[nt][e % 2]);
          if (mt == 0 && e < 2 && first_key_alone.holds(nt * 8 + (lane % 4) * 2 + e % 2)) dst[mt][nt][e] = 0.f;
          if constexpr (kDropout) pt[mt][nt][e] = keep[mt][nt][e] ? pt[mt][nt][e] : 0.f;
          if (store_dmask) {
            const int64_t key = col0 + key0 + mt * 16 + lane / 4 + (e / 2) * 8;
            const int64_t query = m0 + query0 + nt * 8 + (lane % 4) * 2 + e % 2;
            if (key < p.len_k && query < p.len_q) store_mask_grad<Elem>(params.dmask, b, work.h, query, key, dst[mt][nt][e]);
          }
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int at = (key0 + mt * 16 + lane / 4 + half * 8) * kScoreStride + query0 + nt * 8 + (lane % 4) * 2;
          *reinterpret_cast<uint32_t*>(s_pt + at) = ptx::pack2<Elem>(pt[mt][nt][2 * half], pt[mt][nt][2 * half + 1]);
          *reinterpret_cast<uint32_t*>(s_dst + at) =
              ptx::pack2<Elem>(dst[mt][nt][2 * half], dst[mt][nt][2 * half + 1]);
        }
      }
    }
    __syncthreads();
    // The next tile loads from here, apart from the last step's dQ atomics in the memory queue.
    if (step + 1 < steps) load_queries(next_work, buf ^ 1);
    ptx::cp_async_commit();

    // 2. dV += P^T dO; then 3., the dQ piece = dS K (dS read transposed from
    // dS^T) added to dq_accum; then dK += dS^T Q (scaled at the end), so that
    // the atomics go out while the tensor cores work on dK.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      mma_smem_by_smem<Elem, 2, kHalfDimTiles, 16, kRows, kScoreStride, kKMajor, kStride>(
          dv, pt_smem + (key0 * kScoreStride + kk * 16) * kElemBytes, do_buf + (dim0 + kk * 16 * kStride) * kElemBytes,
          lane);
    }
    float dq[Cfg::kDqMTiles][Cfg::kDqNTiles][4] = {};
    mma_smem_by_smem<Elem, Cfg::kDqMTiles, Cfg::kDqNTiles, kBlockN, kKMajor, kScoreStride, kKMajor, kStride>(
        dq, dst_smem + dq_row0 * kElemBytes, k_smem + dq_col0 * kElemBytes, lane);
    float* dq_piece = params.dq_accum + ((b * p.heads_q + work.h) * padded_len_q + m0 + dq_row0) * kDqCols + dq_col0;
#pragma unroll
    for (int mt = 0; mt < Cfg::kDqMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* row = dq_piece + (mt * 16 + lane / 4 + half * 8) * kDqCols + dq_accum_column((lane % 4) * 2);
#pragma unroll
        for (int nt = 0; nt < Cfg::kDqNTiles; nt += 2) {
          ptx::red_add_v4_f32(row + nt * 8, dq[mt][nt][2 * half], dq[mt][nt][2 * half + 1], dq[mt][nt + 1][2 * half],
                              dq[mt][nt + 1][2 * half + 1]);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      mma_smem_by_smem<Elem, 2, kHalfDimTiles, 16, kRows, kScoreStride, kKMajor, kStride>(
          dk, dst_smem + (key0 * kScoreStride + kk * 16) * kElemBytes, q_buf + (dim0 + kk * 16 * kStride) * kElemBytes,
          lane);
    }
    work = next_work;
  }

  // dK (times scale) and dV (times dropout's 1 / (1 - p)) of this warp's keys and columns.
  const float scale = static_cast<float>(p.scale);
  const float dv_scale = kDropout ? dropout.keep_scale : 1.f;
  Elem* dk_head = head_ptr<Elem>(params.dk, b, h_kv);
  Elem* dv_head = head_ptr<Elem>(params.dv, b, h_kv);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t key = col0 + key0 + mt * 16 + lane / 4 + half * 8;
      if (key >= p.len_k) continue;
#pragma unroll
      for (int nt = 0; nt < kHalfDimTiles; ++nt) {
        const int col = dim0 + nt * 8 + (lane % 4) * 2;
        if (col >= dim) continue;
        *reinterpret_cast<uint32_t*>(dk_head + key * params.dk.stride_row + col) =
            ptx::pack2<Elem>(dk[mt][nt][2 * half] * scale, dk[mt][nt][2 * half + 1] * scale);
        *reinterpret_cast<uint32_t*>(dv_head + key * params.dv.stride_row + col) =
            ptx::pack2<Elem>(dv[mt][nt][2 * half] * dv_scale, dv[mt][nt][2 * half + 1] * dv_scale);
      }
    }
  }
}

// Calls fn with the AtomicBwdConfig serving head dim p.head_dim, if there is one.
template <typename Fn>
void dispatch_atomic_config(const AttentionProblem& p, Fn&& fn) {
  dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    if constexpr (decltype(head_dim)::value <= kMaxAtomicDqHeadDim) fn(AtomicBwdConfig<decltype(head_dim)::value>{});
  });
}

}  // namespace

void attention_backward_atomic_dq(const BwdParams& params, ElementType type, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  dispatch_element_type(type, [&](auto elem) {
    using Elem = decltype(elem);
    dispatch_atomic_config(p, [&](auto cfg) {
      using Cfg = decltype(cfg);
      dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
        dispatch_flag(params.mask_kind != MaskKind::kNone, [&](auto masked) {
          launch_kernel(
              attention_backward_atomic_dq_kernel<Elem, Cfg, decltype(dropout)::value, decltype(masked)::value>,
              ceil_div(p.len_k, Cfg::kBlockN) * p.heads_kv * p.batch, Cfg::kThreads, Cfg::kSmemBytes, params, stream);
        });
      });
    });
  });
}

}  // namespace flashattn_ext::cuda::sm80
