// The decode_attention op's glue: the checks of its arguments, its outputs and
// kernel params, and the checks of the values in cache_seqlens and block_table.
#include <ATen/MemoryOverlap.h>
#include <c10/util/safe_numerics.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"
#include "ops_checks.h"

namespace flashattn_ext {

DecodeParams prepare_decode(const DecodeArguments& args, at::Tensor& out, at::Tensor& lse) {
  const at::Tensor& q = args.q;
  check_rank4(q, "query");
  check_floating(q, "query");
  const AttentionOptions& options = args.options;
  TORCH_INTERNAL_ASSERT(!options.attn_mask.has_value() && options.dropout_p == 0.0 && options.causal_lower_right,
                        "flashattn_ext: decode_attention takes no attn_mask, no dropout, and aligns bottom-right");
  check_options(options);
  const bool paged = args.block_table.has_value();
  const char* cache_dims = paged ? "(num_blocks, block_size, heads, head_dim) with block_table"
                                 : "(batch, heads, capacity, head_dim) without block_table";
  const bool fp8 = args.k_cache.scalar_type() == at::kFloat8_e4m3fn;
  for (const auto& [t, name] : {std::pair{&args.k_cache, "key_cache"}, std::pair{&args.v_cache, "value_cache"}}) {
    TORCH_CHECK(t->dim() == 4, "flashattn_ext: ", name, " must be 4-d ", cache_dims, ", got shape ", t->sizes());
    if (fp8) {
      check_device(*t, name, q);
      TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat8_e4m3fn, "flashattn_ext: key_cache is float8_e4m3fn, so ",
                       name, " must be too, got ", t->scalar_type());
    } else {
      check_like(*t, name, q);
    }
  }
  TORCH_CHECK_TYPE(!fp8 || q.scalar_type() != at::kDouble, "flashattn_ext: an FP8 cache takes float32, bfloat16 or "
                   "float16 queries, got float64");
  // The caches as (batch or block, head, row, col).
  const at::Tensor k4 = paged ? args.k_cache.permute({0, 2, 1, 3}) : args.k_cache;
  const at::Tensor v4 = paged ? args.v_cache.permute({0, 2, 1, 3}) : args.v_cache;
  TORCH_CHECK(k4.sizes().slice(0, 3) == v4.sizes().slice(0, 3), "flashattn_ext: key_cache ", args.k_cache.sizes(),
              " and value_cache ", args.v_cache.sizes(), " must agree in all but the last dim ", cache_dims);
  const int64_t batch = q.size(0), heads_kv = k4.size(1);
  TORCH_CHECK(heads_kv > 0 ? q.size(1) % heads_kv == 0 : q.size(1) == 0, "flashattn_ext: the ", heads_kv,
              " key/value heads of the cache must divide the ", q.size(1), " query heads");
  TORCH_CHECK(k4.size(3) == q.size(3), "flashattn_ext: key_cache head dim ", k4.size(3),
              " does not match query head dim ", q.size(3));
  TORCH_CHECK(paged || k4.size(0) == batch, "flashattn_ext: key_cache has batch size ", k4.size(0),
              " but query has ", batch);

  TORCH_CHECK(args.cache_seqlens.dim() == 1 && args.cache_seqlens.size(0) == batch,
              "flashattn_ext: cache_seqlens must be 1-d with one length per sequence (", batch, "), got shape ",
              args.cache_seqlens.sizes());
  check_device(args.cache_seqlens, "cache_seqlens", q);
  TORCH_CHECK_TYPE(args.cache_seqlens.scalar_type() == at::kInt || args.cache_seqlens.scalar_type() == at::kLong,
                   "flashattn_ext: cache_seqlens must be int32 or int64, got ", args.cache_seqlens.scalar_type());

  DecodeParams params;
  params.cache_seqlens = index_view(args.cache_seqlens);
  int64_t capacity = k4.size(2);
  if (paged) {
    const at::Tensor& block_table = *args.block_table;
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
                "flashattn_ext: block_table must be 2-d (batch = ", batch, ", blocks per sequence), got shape ",
                block_table.sizes());
    check_device(block_table, "block_table", q);
    TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
                     "flashattn_ext: block_table must be int32 or int64, got ", block_table.scalar_type());
    TORCH_CHECK_VALUE(k4.size(2) > 0, "flashattn_ext: the cache's blocks must hold at least one row, got shape ",
                      args.k_cache.sizes());
    params.block_table = index_view(block_table);
    params.block_size = k4.size(2);
    params.num_blocks = k4.size(0);
    TORCH_CHECK_VALUE(!c10::mul_overflows(block_table.size(1), params.block_size, &capacity),
                      "flashattn_ext: block_table's ", block_table.size(1), " blocks a sequence of ",
                      params.block_size, " rows hold more keys than an int64 counts");
  }

  TORCH_CHECK(args.k_new.has_value() == args.v_new.has_value(),
              "flashattn_ext: key_new and value_new must be given together");
  if (args.k_new.has_value()) {
    const at::Tensor &k_new = *args.k_new, &v_new = *args.v_new;
    check_rank4(k_new, "key_new");
    check_rank4(v_new, "value_new");
    check_like(k_new, "key_new", q);
    check_like(v_new, "value_new", q);
    const std::vector<int64_t> k_shape{batch, heads_kv, k_new.size(2), k4.size(3)};
    const std::vector<int64_t> v_shape{batch, heads_kv, k_new.size(2), v4.size(3)};
    TORCH_CHECK(k_new.sizes() == at::IntArrayRef(k_shape) && v_new.sizes() == at::IntArrayRef(v_shape),
                "flashattn_ext: key_new and value_new must have shapes ", at::IntArrayRef(k_shape), " and ",
                at::IntArrayRef(v_shape), " (batch, cache heads, new tokens, head dim), got ", k_new.sizes(), " and ",
                v_new.sizes());
    for (const auto& [cache, name] : {std::pair{&args.k_cache, "key_cache"}, std::pair{&args.v_cache, "value_cache"}}) {
      TORCH_CHECK(at::has_internal_overlap(*cache) != at::MemOverlap::Yes, "flashattn_ext: ", name,
                  " has elements that share memory (an expanded view?): the new keys and values cannot be written "
                  "into it");
    }
    params.k_new = view_of(k_new);
    params.v_new = view_of(v_new);
    params.len_new = k_new.size(2);
  }

  AttentionProblem& p = params.problem;
  p.batch = batch;
  p.heads_q = q.size(1);
  p.heads_kv = heads_kv;
  p.len_q = q.size(2);
  p.len_k = capacity;
  p.head_dim = q.size(3);
  p.head_dim_v = v4.size(3);
  check_alibi(options.alibi_slopes, p.batch, p.heads_q, q);
  set_options(p, options);

  for (const auto& [scale, name] :
       {std::pair{&args.key_scale, "key_scale"}, std::pair{&args.value_scale, "value_scale"}}) {
    if (!fp8) {
      TORCH_CHECK_VALUE(!scale->has_value(), "flashattn_ext: ", name, " is for FP8 (float8_e4m3fn) caches; this "
                        "cache is ", args.k_cache.scalar_type());
      continue;
    }
    TORCH_CHECK_VALUE(scale->has_value(), "flashattn_ext: an FP8 (float8_e4m3fn) cache needs key_scale and "
                      "value_scale (the factor each stored value stands for), got no ", name);
    const at::Tensor& t = **scale;
    check_device(t, name, q);
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "flashattn_ext: ", name, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.numel() == 1 ? t.dim() <= 1 : t.dim() == 1 && t.size(0) == heads_kv, "flashattn_ext: ", name,
                " must be one scale (shape () or (1,)) or one a key/value head (", heads_kv, ",), got shape ",
                t.sizes());
  }
  if (fp8) {
    const at::Tensor &k_scale = *args.key_scale, &v_scale = *args.value_scale;
    TORCH_CHECK(k_scale.numel() == v_scale.numel(), "flashattn_ext: key_scale and value_scale must both be one "
                "scale or both one a head, got shapes ", k_scale.sizes(), " and ", v_scale.sizes());
    TORCH_CHECK(k_scale.numel() == 1 || (k_scale.stride(0) == 1 && v_scale.stride(0) == 1), "flashattn_ext: "
                "key_scale and value_scale must be contiguous, got strides ", k_scale.strides(), " and ",
                v_scale.strides());
    params.k_scale = k_scale.data_ptr<float>();
    params.v_scale = v_scale.data_ptr<float>();
    params.scale_stride_head = k_scale.numel() == 1 ? 0 : 1;
  }

  out = empty_in_layout_of(q, {p.batch, p.heads_q, p.len_q, p.head_dim_v});
  lse = at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(lse_dtype(q.scalar_type())));
  params.q = view_of(q);
  params.out = view_of(out);
  params.lse = lse.data_ptr();
  params.k_cache = view_of(k4);
  params.v_cache = view_of(v4);
  return params;
}

void check_decode_values_on_host(const DecodeParams& params) {
  const AttentionProblem& p = params.problem;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t cached = params.cache_seqlens.at(0, b);
    TORCH_CHECK_VALUE(params.length_fits(b), "flashattn_ext: sequence ", b, " has ", cached, " cached keys",
                      params.len_new > 0 ? " and " + std::to_string(params.len_new) + " new ones" : "",
                      ", but its cache holds ", p.len_k);
    if (params.block_table.data == nullptr) continue;
    const int64_t length = cached + params.len_new;  // (at most the capacity: no overflow)
    for (int64_t block = 0; block * params.block_size < length; ++block) {
      const int64_t index = params.block_table.at(b, block);
      TORCH_CHECK_VALUE(params.is_cache_block(index), "flashattn_ext: block_table[", b, ", ", block, "] is ", index,
                        ", not a block of the cache (", params.num_blocks, " blocks)");
    }
  }
}

void check_decode_values(const DecodeArguments& args, const DecodeParams& params) {
  // (cpu() of a host tensor is that tensor: no copy.)
  const at::Tensor cache_seqlens = args.cache_seqlens.cpu();
  const std::optional<at::Tensor> block_table =
      args.block_table.has_value() ? std::optional<at::Tensor>(args.block_table->cpu()) : std::nullopt;
  DecodeParams host = params;
  host.cache_seqlens = index_view(cache_seqlens);
  if (block_table.has_value()) host.block_table = index_view(*block_table);
  check_decode_values_on_host(host);
}

}  // namespace flashattn_ext
