// The Hopper forward with float8 e4m3 operands (attention_forward_fp8): the
// forward kernel (flash_fwd_sm90.cuh) at FwdFp8TileConfig, after a pass that
// transposes the values. 8-bit wgmma reads only K-major operands, so P V needs
// V as (head dim, keys) rows; and the pass puts each 32 keys in the order in
// which a thread's score registers become its P fragment (to_e4m3_fragments),
// so that the probabilities need no shuffle between threads.
#include "cuda/launch.cuh"
#include "cuda/sm90/flash_fwd_sm90.cuh"

namespace flashattn_ext::cuda::sm90 {
namespace {

// 128 x 192 tiles, causal or not (causal on an H200 at N = 8192 and 16384:
// 1.11-1.12x the 128-key tiles' TFLOP/s, whose diagonal wastes less).
using Fp8Cfg = FwdFp8TileConfig<128, 192>;

// Keys of a transpose block, and its threads.
constexpr int kTransposeKeys = 64;
constexpr int kTransposeThreads = 256;
static_assert(Fp8Cfg::kBlockN % kTransposeKeys == 0, "transpose blocks of whole key tiles");

// values_t[b, h, d, n0 + p] = v[b, h, n0 + 32 (p / 32) + e4m3_fragment_column(p % 32), d] for
// the block's kTransposeKeys keys from n0 (zero past len_k: e4m3 0x7f is a NaN,
// and a NaN times a zero probability is still a NaN). One block a
// (kTransposeKeys keys, head, batch), through shared memory: 16-byte reads of the key rows, 16-byte
// writes of the head-dim rows.
template <int kHeadDim>
__global__ void __launch_bounds__(kTransposeThreads) fp8_transpose_values(const TensorView4d v, uint8_t* values_t,
                                                                           int64_t len_k, int64_t keys_t) {
  constexpr int kPitch = kHeadDim + 4;  // bytes a key row in shared memory: rows 1 bank apart
  __shared__ uint8_t tile[kTransposeKeys * kPitch];
  const int n0 = blockIdx.x * kTransposeKeys, head = blockIdx.y, batch = blockIdx.z;
  const auto* src = static_cast<const uint8_t*>(v.data) + batch * v.stride_batch + head * v.stride_head;
  constexpr int kChunks = kHeadDim / 16;  // 16-byte pieces of a row
  for (int i = threadIdx.x; i < kTransposeKeys * kChunks; i += kTransposeThreads) {
    const int key = i / kChunks, chunk = i % kChunks;
    uint4 piece = make_uint4(0, 0, 0, 0);
    if (n0 + key < len_k) piece = *reinterpret_cast<const uint4*>(src + (n0 + key) * v.stride_row + chunk * 16);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[key * kPitch + chunk * 16]);
    dst[0] = piece.x, dst[1] = piece.y, dst[2] = piece.z, dst[3] = piece.w;
  }
  __syncthreads();
  uint8_t* dst = values_t + ((int64_t(batch) * gridDim.y + head) * kHeadDim) * keys_t + n0;
  constexpr int kOutChunks = kTransposeKeys / 16;  // 16-byte pieces of a head-dim row's keys
  for (int i = threadIdx.x; i < kHeadDim * kOutChunks; i += kTransposeThreads) {
    const int d = i / kOutChunks, p0 = (i % kOutChunks) * 16;
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int p = p0 + 4 * w + b;
        const int key = 32 * (p / 32) + e4m3_fragment_column(p % 32);
        word |= uint32_t{tile[key * kPitch + d]} << (8 * b);
      }
      words[w] = word;
    }
    *reinterpret_cast<uint4*>(dst + int64_t(d) * keys_t + p0) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

bool aligned16(const void* data) { return reinterpret_cast<uintptr_t>(data) % 16 == 0; }

}  // namespace

int64_t fp8_values_t_keys(int64_t len_k) { return ceil_div(len_k, kTransposeKeys) * kTransposeKeys; }

int64_t fp8_values_t_bytes(const AttentionProblem& p) {
  return p.batch * p.heads_kv * p.head_dim_v * fp8_values_t_keys(p.len_k);
}

bool fp8_forward_covers(const Fp8FwdParams& params) {
  const FwdParams& fwd = params.fwd;
  const AttentionProblem& p = fwd.problem;
  return p.head_dim == Fp8Cfg::kHeadDim && p.head_dim_v == Fp8Cfg::kHeadDimV && !p.has_window() &&
         p.softcap == 0.0 && p.alibi_slopes == nullptr && fwd.mask_kind == MaskKind::kNone && fwd.dropout.p == 0.0 &&
         !fwd.packed.present() && p.scale > 0.0 && p.len_q > 0 && p.len_k > 0 && p.heads_kv > 0 &&
         p.heads_q % p.heads_kv == 0 && p.batch > 0 && params.q_descale != nullptr && params.k_descale != nullptr &&
         params.v_descale != nullptr;
}

namespace forward_kernel {

template <typename Cfg>
bool launch_fp8_forward(const Fp8FwdParams& params, cudaStream_t stream) {
  const FwdParams& call = params.fwd;
  const AttentionProblem& p = call.problem;
  FwdKernelParams kp;
  kp.call = call;
  kp.q_descale = params.q_descale;
  kp.k_descale = params.k_descale;
  kp.v_descale = params.v_descale;
  const int64_t keys_t = fp8_values_t_keys(p.len_k);
  TensorView4d values_t;
  values_t.data = params.values_t;
  values_t.stride_col = 1;
  values_t.stride_row = keys_t;
  values_t.stride_head = p.head_dim_v * keys_t;
  values_t.stride_batch = p.heads_kv * p.head_dim_v * keys_t;
  if (!aligned16(call.v.data) || call.v.stride_col != 1 || call.v.stride_row % 16 != 0 ||
      call.v.stride_head % 16 != 0 || call.v.stride_batch % 16 != 0 || !aligned16(params.values_t) ||
      call.out.stride_col != 1) {
    return false;
  }
  constexpr MapElement kE4M3 = MapElement::kE4M3;
  if (!encode_tensor_map(&kp.q_map, call.q, p.head_dim, p.len_q, p.heads_q, p.batch, kE4M3, Cfg::kBlockM) ||
      !encode_tensor_map(&kp.k_map, call.k, p.head_dim, p.len_k, p.heads_kv, p.batch, kE4M3, Cfg::kBlockN) ||
      !encode_tensor_map(&kp.v_map, values_t, keys_t, p.head_dim_v, p.heads_kv, p.batch, kE4M3, Cfg::kHeadDimV)) {
    return false;
  }
  if (Cfg::kVtTailKeys > 0 && !encode_tensor_map(&kp.v_tail_map, values_t, keys_t, p.head_dim_v, p.heads_kv, p.batch,
                                                 kE4M3, Cfg::kHeadDimV, Cfg::kVtTailKeys)) {
    return false;
  }
  const int64_t m_blocks = ceil_div(p.len_q, Cfg::kBlockM);
  const int64_t tiles = m_blocks * p.batch * p.heads_q;
  if (tiles > kMaxTiles || p.heads_kv > 65535 || p.batch > 65535) return false;

  const dim3 transpose_grid(static_cast<unsigned>(keys_t / kTransposeKeys), static_cast<unsigned>(p.heads_kv),
                            static_cast<unsigned>(p.batch));
  fp8_transpose_values<Cfg::kHeadDimV>
      <<<transpose_grid, kTransposeThreads, 0, stream>>>(call.v, static_cast<uint8_t*>(params.values_t), p.len_k, keys_t);

  auto kernel = attention_forward_kernel<__nv_fp8_e4m3, Cfg, false, MaskKind::kNone, false, false, false, false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  const int sms = multiprocessor_count();
  kp.tiles = static_cast<int>(tiles);
  const int64_t kv_bytes_per_head = p.len_k * (p.head_dim + p.head_dim_v);  // K and V, streamed (1 byte each)
  kp.order_chunks = heaviest_first_chunks(p.heads_q * p.batch, m_blocks, kv_bytes_per_head, sms);
  kp.heads_first = false;
  const int64_t blocks = std::min<int64_t>(tiles, sms);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(kp);
  return true;
}

}  // namespace forward_kernel

bool attention_forward_fp8(const Fp8FwdParams& params, cudaStream_t stream) {
  if (params.fwd.tile_counter == nullptr || params.values_t == nullptr || !fp8_forward_covers(params)) return false;
  return forward_kernel::launch_fp8_forward<Fp8Cfg>(params, stream);
}

}  // namespace flashattn_ext::cuda::sm90
