// Tensor maps for the copy engine, encoded through the driver's
// cuTensorMapEncodeTiled (found through the runtime, so nothing links libcuda).
#include "cuda/sm90/descriptors.cuh"

#include <cudaTypedefs.h>

namespace flashattn_ext::cuda::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // clear it: the caller falls back to another kernel
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

}  // namespace

bool encode_tensor_map(CUtensorMap* map, const TensorView4d& t, const AttentionProblem& p, int64_t rows,
                       int64_t heads, bool bfloat16, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr int64_t kElemBytes = 2;
  const int64_t strides[3] = {t.stride_row, t.stride_head, t.stride_batch};
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(rows),
                        static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(p.batch)};
  cuuint64_t stride_bytes[3];
  for (int i = 0; i < 3; ++i) {
    // The copy engine takes strides that are positive multiples of 16 bytes below 2^40.
    if (strides[i] <= 0 || strides[i] * kElemBytes % 16 != 0 || strides[i] * kElemBytes >= (int64_t(1) << 40)) {
      return false;
    }
    stride_bytes[i] = static_cast<cuuint64_t>(strides[i] * kElemBytes);
  }
  for (const cuuint64_t dim : dims) {
    if (dim == 0 || dim > (uint64_t(1) << 32)) return false;
  }
  const cuuint32_t box[4] = {kSwizzleCols, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result =
      encode(map, bfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
             t.data, dims, stride_bytes, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace flashattn_ext::cuda::sm90
