// The forward kernel: one thread block per (block of query rows, head, batch).
// The query tile stays in shared memory; key and value tiles stream through
// two shared-memory buffers with cp.async, so the next pair loads while the
// tensor cores (mma.sync m16n8k16) work on the current one. Each warp owns
// 16 * kMTiles query rows and keeps their softmax state and output in registers.
// With kDropout, the probabilities are dropped after the row sums and before
// P V, and the output scaled by 1 / (1 - p) at the end. With kMasked, every
// tile takes the general body, which applies attn_mask to each score.
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
#include "cuda/views.cuh"
#include "cuda/visibility.cuh"

namespace flashattn_ext::cuda::sm80 {
namespace {

__device__ __forceinline__ float fmaxf_op(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float add_op(float a, float b) { return a + b; }

// op over the 2 * kTiles scores x[0..kTiles)[e0, e0 + 1] of one row, as a tree.
template <int kTiles, typename Op>
__device__ __forceinline__ float tree_reduce(const float (&x)[kTiles][4], int e0, Op op) {
  float v[kTiles];
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) v[nt] = op(x[nt][e0], x[nt][e0 + 1]);
#pragma unroll
  for (int width = kTiles / 2; width > 0; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i) v[i] = op(v[i], v[i + width]);
  }
  return v[0];
}

template <typename Elem, typename Cfg, bool kDropout, bool kMasked>
__global__ void __launch_bounds__(Cfg::kThreads) attention_forward_kernel(const FwdParams params) {
  constexpr int kHeadDim = Cfg::kHeadDim, kMTiles = Cfg::kMTiles, kBlockM = Cfg::kBlockM,
                kBlockN = Cfg::kBlockN, kStride = Cfg::kStride;
  constexpr int kDimTiles = kHeadDim / 8;  // n8 tiles of the output
  constexpr int kKeyTiles = kBlockN / 8;   // n8 tiles of the scores

  extern __shared__ __align__(16) unsigned char smem[];
  Elem* s_q = reinterpret_cast<Elem*>(smem);
  Elem* s_k = s_q + kBlockM * kStride;
  Elem* s_v = s_k + 2 * kBlockN * kStride;

  const AttentionProblem& p = params.problem;
  // A flattened grid has no 65535 limit; blocks of one head run together (they
  // share its keys in L2), the longest causal rows first.
  const int64_t m_blocks = ceil_div(p.len_q, kBlockM);
  const int64_t m_block = m_blocks - 1 - blockIdx.x % m_blocks;
  const int64_t h = (blockIdx.x / m_blocks) % p.heads_q;
  const int64_t b = blockIdx.x / (m_blocks * p.heads_q);
  const int64_t h_kv = h / (p.heads_q / p.heads_kv);
  const int64_t row0 = m_block * kBlockM;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warp_row0 = warp * 16 * kMTiles;

  const Elem* q = head_ptr<Elem>(params.q, b, h);
  const Elem* k = head_ptr<Elem>(params.k, b, h_kv);
  const Elem* v = head_ptr<Elem>(params.v, b, h_kv);
  const int dim = static_cast<int>(p.head_dim);

  const HeadMaskLog2<Elem> mask(params.mask_kind, params.mask, b, h);
  const Visibility seen(p);
  const int64_t offset = seen.offset;
  const int n_blocks = static_cast<int>(ceil_div(seen.key_end_of_rows(row0, kBlockM), kBlockN));

  auto load_kv = [&](int n_block) {
    const int buf = n_block & 1;
    load_tile_async<kBlockN, kHeadDim, Cfg::kThreads>(s_k + buf * kBlockN * kStride, k, params.k.stride_row,
                                                      int64_t(n_block) * kBlockN, p.len_k, dim);
    load_tile_async<kBlockN, kHeadDim, Cfg::kThreads>(s_v + buf * kBlockN * kStride, v, params.v.stride_row,
                                                      int64_t(n_block) * kBlockN, p.len_k, dim);
  };
  load_tile_async<kBlockM, kHeadDim, Cfg::kThreads>(s_q, q, params.q.stride_row, row0, p.len_q, dim);
  if (n_blocks > 0) load_kv(0);
  ptx::cp_async_commit();

  // Each lane's ldmatrix row addresses in the Q, K and V tiles (shared space).
  constexpr int kElemBytes = sizeof(Elem);
  constexpr uint32_t kTileBytes = kBlockN * kStride * kElemBytes;
  const uint32_t q_frag = ptx::smem_addr(s_q) + (warp_row0 * kStride + a_lane_offset<kStride>(lane)) * kElemBytes;
  const uint32_t k_frag = ptx::smem_addr(s_k) + b_lane_offset<kStride>(lane) * kElemBytes;
  const uint32_t v_frag = ptx::smem_addr(s_v) + a_lane_offset<kStride>(lane) * kElemBytes;

  // Scores are kept in log2 units: exp(x * scale) = exp2(x * scale * log2(e)).
  const float scale_log2 = score_scale_log2(p);
  float acc_o[kMTiles][kDimTiles][4] = {};
  float row_max[kMTiles][2], row_sum[kMTiles][2];
  DropoutState dropout{};
  if constexpr (kDropout) dropout = dropout_state(params.dropout);
  for (int mt = 0; mt < kMTiles; ++mt) {
    for (int half = 0; half < 2; ++half) {
      row_max[mt][half] = -INFINITY;
      row_sum[mt][half] = 0.f;
    }
  }

  // One key tile. The general body (kGeneral) scales every score, then masks
  // keys past the end and above the causal diagonal. The fast body serves
  // tiles with nothing to mask when the scale is positive: the row max of the
  // unscaled scores, times the scale, is the max of the scaled ones, so scaling
  // and subtracting the max fold into one fma per score.
  auto process_tile = [&](int n_block, auto general_tag) {
    constexpr bool kGeneral = decltype(general_tag)::value;

    // S = Q K^T for this warp's rows and the tile's kBlockN keys.
    const uint32_t k_tile = k_frag + (n_block & 1) * kTileBytes;
    const uint32_t v_tile = v_frag + (n_block & 1) * kTileBytes;
    float s[kMTiles][kKeyTiles][4] = {};
    mma_rows_by_rows<Elem, kMTiles, kKeyTiles, kHeadDim, kStride>(s, q_frag, k_tile);

    if constexpr (kGeneral) {
      // Scale; mask keys past the end, and above the diagonal where the tile
      // crosses it; apply attn_mask (kMasked). In tile coordinates (r, c): key
      // c is past the end if c >= keys_left, and above the diagonal if
      // c - r > diagonal.
      const int64_t col0 = int64_t(n_block) * kBlockN;
      const bool mask_causal = p.is_causal && col0 + kBlockN - 1 > row0 + offset;
      const int keys_left = static_cast<int>(min(p.len_k - col0, int64_t(kBlockN)));
      const int diagonal = static_cast<int>(min(max(row0 + offset - col0, int64_t(-kBlockM - 1)), int64_t(kBlockN)));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& x = s[mt][nt][e];
            x *= scale_log2;
            const int r = warp_row0 + mt * 16 + lane / 4 + (e / 2) * 8;
            const int c = nt * 8 + (lane % 4) * 2 + e % 2;
            if (c >= keys_left || (mask_causal && c - r > diagonal)) {
              x = -INFINITY;
            } else if (kMasked && row0 + r < p.len_q) {
              x = mask.apply(x, row0 + r, col0 + c);
            }
          }
        }
      }
    }

    // Online softmax. Each row lives in the 4 lanes of a quad, two rows per m-tile.
    float rescale[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Max and sum as trees, not chains of dependent instructions.
        float tile_max = tree_reduce<kKeyTiles>(s[mt], 2 * half, fmaxf_op);
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
        if constexpr (!kGeneral) tile_max *= scale_log2;
        tile_max = fmaxf(row_max[mt][half], tile_max);
        // A row with nothing visible yet keeps max -inf; subtract 0 instead so
        // that exp2(-inf - max) stays 0 rather than NaN.
        const float max_used = tile_max == -INFINITY ? 0.f : tile_max;
        rescale[mt][half] = ptx::exp2_approx(row_max[mt][half] - max_used);
        row_max[mt][half] = tile_max;
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            float& x = s[mt][nt][e];
            x = ptx::exp2_approx(kGeneral ? x - max_used : fmaf(x, scale_log2, -max_used));
          }
        }
        const float tile_sum = tree_reduce<kKeyTiles>(s[mt], 2 * half, add_op);
        row_sum[mt][half] = row_sum[mt][half] * rescale[mt][half] + tile_sum;  // per-lane partial sum
      }
    }
    // The output needs rescaling only where a row max grew; after the first
    // tiles that is rare, and the warp skips the multiplies (a factor of exactly 1).
    bool max_grew = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) max_grew |= rescale[mt][0] != 1.f || rescale[mt][1] != 1.f;
    if (__any_sync(0xffffffff, max_grew)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDimTiles; ++dt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= rescale[mt][e / 2];
        }
      }
    }

    if constexpr (kDropout) {
      bool keep[kMTiles][kKeyTiles][4];
      dropout_keep_fragments</*kKeyRows=*/false>(keep, dropout, p, b * p.heads_q + h, row0 + warp_row0,
                                                 int64_t(n_block) * kBlockN, lane);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = keep[mt][nt][e] ? s[mt][nt][e] : 0.f;
        }
      }
    }

    // O += P V, with P taken from the score registers.
    mma_regs_by_rows<Elem, kMTiles, kBlockN, kHeadDim, kStride>(acc_o, s, v_tile);
  };

  for (int n_block = 0; n_block < n_blocks; ++n_block) {
    if (n_block + 1 < n_blocks) load_kv(n_block + 1);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // everything but the prefetch just issued has landed
    __syncthreads();
    const int64_t col_last = int64_t(n_block + 1) * kBlockN - 1;
    if (kMasked || !(scale_log2 > 0.f) || col_last >= p.len_k || (p.is_causal && col_last > row0 + offset)) {
      process_tile(n_block, std::true_type{});
    } else {
      process_tile(n_block, std::false_type{});
    }
    __syncthreads();  // all warps are done with this buffer before it is refilled
  }

  // Normalize, write out and the log-sum-exp. Rows that saw no key get 0 and -inf.
  Elem* out = head_ptr<Elem>(params.out, b, h);
  float* lse = static_cast<float*>(params.lse) + (b * p.heads_q + h) * p.len_q;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[mt][half];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const float out_scale = kDropout ? inv_sum * dropout.keep_scale : inv_sum;
      const int64_t row = row0 + warp_row0 + mt * 16 + lane / 4 + half * 8;
      if (row >= p.len_q) continue;
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        if (col < dim) {
          *reinterpret_cast<uint32_t*>(out + row * params.out.stride_row + col) =
              ptx::pack2<Elem>(acc_o[mt][dt][2 * half] * out_scale, acc_o[mt][dt][2 * half + 1] * out_scale);
        }
      }
      if (lane % 4 == 0) {
        lse[row] = sum > 0.f ? (row_max[mt][half] + log2f(sum)) * float(M_LN2) : -INFINITY;
      }
    }
  }
}

template <typename Elem, typename Cfg>
void launch_forward(const FwdParams& params, cudaStream_t stream) {
  const AttentionProblem& p = params.problem;
  dispatch_flag(params.dropout.p > 0.0, [&](auto dropout) {
    dispatch_flag(params.mask_kind != MaskKind::kNone, [&](auto masked) {
      launch_kernel(attention_forward_kernel<Elem, Cfg, decltype(dropout)::value, decltype(masked)::value>,
                    ceil_div(p.len_q, Cfg::kBlockM) * p.heads_q * p.batch, Cfg::kThreads,
                    Cfg::kSmemElems * sizeof(Elem), params, stream);
    });
  });
}

}  // namespace

void attention_forward(const FwdParams& params, ElementType type, cudaStream_t stream) {
  dispatch_element_type(type, [&](auto elem) {
    dispatch_head_dim(params.problem.head_dim, [&](auto head_dim) {
      // Two 16-row tiles per warp; one at head dim 256, whose output alone takes 128 registers a tile.
      constexpr int kHeadDim = decltype(head_dim)::value;
      launch_forward<decltype(elem), FwdTiles<kHeadDim>>(params, stream);
    });
  });
}

}  // namespace flashattn_ext::cuda::sm80
