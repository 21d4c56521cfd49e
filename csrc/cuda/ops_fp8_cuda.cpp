// The attention_forward_fp8 op on CUDA: the Hopper forward's e4m3 kernel
// (cuda::sm90::attention_forward_fp8) where it takes the call (Hopper kernels
// in use, descales a (batch, key/value head), head dim 128, no window), else
// attention_forward on the tensors dequantized to bfloat16 (ops_fp8.cpp); the
// quantize_fp8 and dequantize_fp8 ops' kernels (fp8_convert.cu) where they
// take the call, else their ATen paths.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cuda/flash_cuda.h"
#include "cuda/route.h"
#include "ops.h"

namespace flashattn_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_fp8_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale, bool is_causal,
    bool causal_lower_right, double scale, int64_t window_left, int64_t window_right) {
  check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale);
  auto dequantized_path = [&] {
    return attention_forward_fp8_dequantized(q, k, v, q_descale, k_descale, v_descale, is_causal, causal_lower_right,
                                             scale, window_left, window_right);
  };
  const bool per_head = q_descale.has_value() && k_descale.has_value() && v_descale.has_value() &&
                        q_descale->dim() == 2 && k_descale->dim() == 2 && v_descale->dim() == 2;
  if (!per_head || !cuda::use_sm90_kernels(q)) return dequantized_path();
  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cuda::sm90::Fp8FwdParams params;
  FwdParams& fwd = params.fwd;
  fwd.problem = attention_problem(
      q, k, v, AttentionOptions{std::nullopt, 0.0, is_causal, causal_lower_right, scale, window_left, window_right});
  const AttentionProblem& p = fwd.problem;
  // (The descales' storage is read as contiguous (batch, heads_kv) floats.)
  const at::Tensor qd = q_descale->contiguous(), kd = k_descale->contiguous(), vd = v_descale->contiguous();
  params.q_descale = qd.data_ptr<float>();
  params.k_descale = kd.data_ptr<float>();
  params.v_descale = vd.data_ptr<float>();
  if (!cuda::sm90::fp8_forward_covers(params)) return dequantized_path();

  at::Tensor out = at::empty({p.batch, p.heads_q, p.len_q, p.head_dim_v}, q.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(at::kFloat));
  const at::Tensor values_t = at::empty({cuda::sm90::fp8_values_t_bytes(p)}, q.options().dtype(at::kByte));
  const at::Tensor tile_counter = at::empty({1}, q.options().dtype(at::kInt));
  fwd.q = view_of(q);
  fwd.k = view_of(k);
  fwd.v = view_of(v);
  fwd.out = view_of(out);
  fwd.lse = lse.data_ptr();
  fwd.tile_counter = tile_counter.data_ptr<int>();
  params.values_t = values_t.data_ptr();
  C10_CUDA_CHECK(cudaMemsetAsync(fwd.tile_counter, 0, sizeof(int), stream));
  if (!cuda::sm90::attention_forward_fp8(params, stream)) return dequantized_path();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

bool sixteen_bit(at::ScalarType type) { return type == at::kBFloat16 || type == at::kHalf; }

// The kernels' view of x (16-bit) and x8 (e4m3), same shape.
cuda::Fp8ConvertParams convert_params(const at::Tensor& x, const at::Tensor& x8, int64_t heads_kv) {
  cuda::Fp8ConvertParams params;
  params.wide = view_of(x);
  params.narrow = view_of(x8);
  params.batch = x.size(0);
  params.heads = x.size(1);
  params.rows = x.size(2);
  params.cols = x.size(3);
  params.heads_kv = heads_kv;
  return params;
}

// The kernels take a 16-bit x with one descale a (batch, key/value head).
std::tuple<at::Tensor, at::Tensor> quantize_fp8_cuda(const at::Tensor& x, int64_t heads_kv, bool per_block) {
  if (per_block || x.dim() != 4 || !sixteen_bit(x.scalar_type()) || x.numel() == 0 || heads_kv <= 0 ||
      x.size(1) % heads_kv != 0) {
    return quantize_fp8_aten(x, heads_kv, per_block);
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor quantized = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  const at::Tensor amax = at::zeros({x.size(0), heads_kv}, x.options().dtype(at::kFloat));
  at::Tensor descale = at::empty({x.size(0), heads_kv}, x.options().dtype(at::kFloat));
  cuda::Fp8ConvertParams params = convert_params(x, quantized, heads_kv);
  params.amax = amax.data_ptr<float>();
  params.descale = descale.data_ptr<float>();
  cuda::quantize_fp8(params, cuda::element_type(x), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {quantized, descale};
}

at::Tensor dequantize_fp8_cuda(const at::Tensor& x, const std::optional<at::Tensor>& descale, at::ScalarType dtype) {
  const bool per_head = descale.has_value() && descale->dim() == 2 && descale->scalar_type() == at::kFloat &&
                        x.dim() == 4 && descale->size(0) == x.size(0) && descale->size(1) > 0 &&
                        x.size(1) % descale->size(1) == 0;
  if (!per_head || x.scalar_type() != at::kFloat8_e4m3fn || !sixteen_bit(dtype) || x.numel() == 0) {
    return dequantize_fp8_aten(x, descale, dtype);
  }
  check_device(*descale, "descale", x, "x");
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor wide = at::empty(x.sizes(), x.options().dtype(dtype));
  const at::Tensor descale_rows = descale->contiguous();  // (batch, heads_kv) floats
  cuda::Fp8ConvertParams params = convert_params(wide, x, descale->size(1));
  params.descale = descale_rows.data_ptr<float>();
  cuda::dequantize_fp8(params, cuda::element_type(wide), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return wide;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("attention_forward_fp8", &attention_forward_fp8_cuda);
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("dequantize_fp8", &dequantize_fp8_cuda);
}

}  // namespace flashattn_ext
