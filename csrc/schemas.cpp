// The flashattn_ext op schemas, the dropout-bits setting they expose, and the
// Python module stub that loads the library.
#include <Python.h>
#include <torch/library.h>

#include <atomic>

#include "ops.h"

namespace flashattn_ext {
namespace {

std::atomic<int> dropout_bits_setting{kDefaultDropoutBits};

void set_dropout_bits(int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 16, "flashattn_ext: set_dropout_bits takes 8 or 16, got ", bits);
  dropout_bits_setting = static_cast<int>(bits);
}

int64_t get_dropout_bits() { return dropout_bits_setting; }

}  // namespace

int dropout_bits() { return dropout_bits_setting; }

// The schemas cover the whole scaled_dot_product_attention surface. Inputs are
// 4-d (batch, heads, seq_len, head_dim) with any strides; key and value may
// have fewer heads than query (GQA) as long as they divide its count.
// alibi_slopes (float32, (batch, query heads), any strides: an expanded (query
// heads,) vector is fine) adds ALiBi's -slope * |i + d - j| to the scores (see
// AttentionProblem); it gets no gradient. sinks (query heads,), any float
// dtype, are attention sinks (merge_sinks in ops.h): the forward's out and lse
// include them, and the backward takes the forward's; sinks_backward gives
// the gradient of the sinks themselves (autograd.cpp calls it).
// With dropout_p > 0 the forward draws from torch's default generator of the
// inputs' device and returns what it drew as rng_state ({seed, offset, bits},
// int64; empty without dropout), so the backward regenerates the same dropout
// mask; dropout_mask gives that mask itself (True: kept), for query rows
// [row_begin, row_end). set_dropout_bits chooses the random numbers' bits (8,
// the default, or 16: dropout.h) for the forwards that follow.
TORCH_LIBRARY(flashattn_ext, m) {
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
      "bool is_causal, bool causal_lower_right, float scale, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor out, Tensor lse, "
      "Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor rng_state, Tensor? attn_mask, float dropout_p, bool is_causal, bool causal_lower_right, float scale, "
      "bool compute_grad_attn_mask, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, "
      "Tensor grad_attn_mask)");
  // A packed batch (varlen): query (total_q, heads, head_dim), key and value
  // (total_k, heads_kv, ...), sequence b in rows cu_seqlens_q[b] to
  // cu_seqlens_q[b + 1] (and cu_seqlens_k's) of each; max_seqlen_* at least
  // every sequence's length; alibi_slopes (sequences, query heads). lse is
  // (heads, total_q). No attn_mask or dropout (see PackedSequences).
  m.def(
      "varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool is_causal, bool causal_lower_right, float scale, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "varlen_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool is_causal, "
      "bool causal_lower_right, float scale, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  m.def("sinks_backward(Tensor grad_out, Tensor out, Tensor lse, Tensor sinks) -> Tensor grad_sinks");
  m.def(
      "dropout_mask(Tensor rng_state, float dropout_p, int batch, int heads, int len_q, int len_k, int row_begin, "
      "int row_end) -> Tensor");
  // Which kernel family would take an attention_forward call (with backward,
  // its attention_backward), and why: (family, reason), from the device's
  // routing table (cuda/route.h), without running it.
  m.def(
      "kernel_route(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "bool causal_lower_right, float scale, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None, bool backward=False) -> (str family, str reason)");
  m.def("set_dropout_bits(int bits) -> ()", &set_dropout_bits);
  m.def("get_dropout_bits() -> int", &get_dropout_bits);
  // Inference: a few query tokens per sequence against a key/value cache,
  // contiguous or paged (with block_table); key_new and value_new, when given,
  // are written into the caches first (see DecodeParams); FP8 (e4m3) caches
  // take key_scale and value_scale.
  m.def(
      "decode_attention(Tensor query, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor cache_seqlens, "
      "Tensor? block_table, Tensor? key_new, Tensor? value_new, bool is_causal, float scale, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "Tensor? key_scale=None, Tensor? value_scale=None) -> (Tensor out, Tensor lse)");
}

}  // namespace flashattn_ext

// `import flashattn_ext._C` loads this library, whose static initializers
// register the ops; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
