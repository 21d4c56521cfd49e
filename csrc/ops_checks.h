// The argument checks and views that the ops' preparations share
// (ops_attention.cpp, ops_packed.cpp, ops_decode.cpp); defined, and described,
// in ops_checks.cpp. Internal to those files: the interface is ops.h.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>

#include "flash_params.h"
#include "ops.h"

namespace flashattn_ext {

void check_floating(const at::Tensor& t, const char* name);
void check_like(const at::Tensor& t, const char* name, const at::Tensor& q);
void check_rank4(const at::Tensor& t, const char* name);
void check_options(const AttentionOptions& options);
void open_wide_window(AttentionProblem& p);
void check_alibi(const std::optional<at::Tensor>& slopes, int64_t batch, int64_t heads_q, const at::Tensor& q);
void set_alibi(AttentionProblem& p, const std::optional<at::Tensor>& slopes);
void set_options(AttentionProblem& p, const AttentionOptions& options);
AttentionProblem check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const AttentionOptions& options);
void check_saved(const at::Tensor& t, const char* name, at::IntArrayRef expected_shape, at::ScalarType dtype,
                 const at::Tensor& q);
at::Tensor empty_in_layout_of(const at::Tensor& q, std::array<int64_t, 4> sizes);
IndexView index_view(const at::Tensor& t);

}  // namespace flashattn_ext
