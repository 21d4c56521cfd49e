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

// Encodes a tiled tensor map of kRank dims (dims[0] contiguous; strides of
// dims 1 on in elements), boxes of box elements, swizzled (128-byte unless said otherwise),
// out-of-range elements read as zero, L2 fetches promoted to 256 bytes unless
// said otherwise.
template <int kRank>
bool encode_tiled(CUtensorMap* map, void* data, CUtensorMapDataType type, int64_t elem_bytes,
                  const cuuint64_t (&dims)[kRank], const int64_t (&strides)[kRank - 1], const cuuint32_t (&box)[kRank],
                  CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  cuuint64_t stride_bytes[kRank - 1];
  for (int i = 0; i < kRank - 1; ++i) {
    // The copy engine takes strides that are positive multiples of 16 bytes below 2^40.
    if (strides[i] <= 0 || strides[i] * elem_bytes % 16 != 0 || strides[i] * elem_bytes >= (int64_t(1) << 40)) {
      return false;
    }
    stride_bytes[i] = static_cast<cuuint64_t>(strides[i] * elem_bytes);
  }
  for (const cuuint64_t dim : dims) {
    if (dim == 0 || dim > (uint64_t(1) << 32)) return false;
  }
  cuuint32_t element_strides[kRank];
  for (cuuint32_t& stride : element_strides) stride = 1;
  const CUresult result = encode(map, type, kRank, data, dims, stride_bytes, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace

bool encode_tensor_map(CUtensorMap* map, const TensorView4d& t, int64_t cols, int64_t rows, int64_t heads,
                       int64_t batches, MapElement element, int box_rows, int box_row_bytes) {
  if (t.stride_col != 1 || (box_row_bytes != kSwizzleRowBytes && box_row_bytes != 64)) return false;
  const int elem_bytes = element == MapElement::kE4M3 ? 1 : 2;
  const CUtensorMapDataType type = element == MapElement::kE4M3       ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : element == MapElement::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batches)};
  return encode_tiled(map, t.data, type, elem_bytes, dims, {t.stride_row, t.stride_head, t.stride_batch},
                      {static_cast<cuuint32_t>(box_row_bytes / elem_bytes), static_cast<cuuint32_t>(box_rows), 1, 1},
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      box_row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B);
}

bool encode_mask_tiles(CUtensorMap* map, MaskTileShape* shape, const TensorView4d& mask, int elem_bytes,
                       const AttentionProblem& p, int tile_rows) {
  if (mask.stride_col != 1) return false;
  const MaskDims own = mask_dims(mask, p);
  shape->rows_full = own.rows;
  shape->head_step = own.heads ? 1 : 0;
  shape->batch_step = own.batch ? 1 : 0;
  shape->box_rows = own.rows ? tile_rows : 1;
  shape->block_bytes = own.rows ? tile_rows * kSwizzleRowBytes : kSwizzleAtomBytes;
  // A dimension the mask repeats over has size 1: its stride is never used,
  // but must still be one the copy engine takes.
  const int64_t unused_stride = 16 / elem_bytes;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.len_k), static_cast<cuuint64_t>(own.rows ? p.len_q : 1),
                              static_cast<cuuint64_t>(own.heads ? p.heads_q : 1),
                              static_cast<cuuint64_t>(own.batch ? p.batch : 1)};
  const int64_t strides[3] = {own.rows ? mask.stride_row : unused_stride,
                              own.heads ? mask.stride_head : unused_stride,
                              own.batch ? mask.stride_batch : unused_stride};
  return encode_tiled(map, mask.data, elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16,
                      elem_bytes, dims, strides,
                      {static_cast<cuuint32_t>(kSwizzleRowBytes / elem_bytes),
                       static_cast<cuuint32_t>(shape->box_rows), 1, 1});
}

bool encode_cache_tensor_map(CUtensorMap* map, const TensorView4d& cache, CacheElement element, int64_t head_dim,
                             int64_t rows, int64_t heads, int64_t outer, int box_heads, int box_rows,
                             bool heads_inner) {
  const int64_t elem_bytes = element == CacheElement::kE4M3 ? 1 : 2, line_cols = kSwizzleRowBytes / elem_bytes;
  const CUtensorMapDataType type = element == CacheElement::kE4M3       ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : element == CacheElement::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const auto heads_dim = static_cast<cuuint64_t>(heads), rows_dim = static_cast<cuuint64_t>(rows);
  const auto heads_box = static_cast<cuuint32_t>(box_heads), rows_box = static_cast<cuuint32_t>(box_rows);
  const auto lines = static_cast<cuuint32_t>(head_dim / line_cols);
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(line_cols), lines, heads_inner ? heads_dim : rows_dim,
                              heads_inner ? rows_dim : heads_dim, static_cast<cuuint64_t>(outer)};
  const int64_t strides[4] = {line_cols * cache.stride_col, heads_inner ? cache.stride_head : cache.stride_row,
                              heads_inner ? cache.stride_row : cache.stride_head, cache.stride_batch};
  const cuuint32_t box[5] = {static_cast<cuuint32_t>(line_cols), lines, heads_inner ? heads_box : rows_box,
                             heads_inner ? rows_box : heads_box, 1};
  return encode_tiled(map, cache.data, type, elem_bytes, dims, strides, box,
                      // Without promotion: the decode kernel read the cache 7% faster on an
                      // H200 (4.40 against 4.09 TB/s at 8k keys, 4.58 against 4.29 at 32k).
                      CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

}  // namespace flashattn_ext::cuda::sm90
