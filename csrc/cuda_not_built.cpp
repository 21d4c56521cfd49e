// Compiled instead of csrc/cuda/ in a CPU-only build, so that CUDA tensors get
// an error that says why rather than a missing-kernel message from the dispatcher.
#include <torch/library.h>

namespace flashattn_ext {
namespace {

void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "flashattn_ext: ", op.schema().name(),
                              " got CUDA tensors, but this build of flashattn_ext has no CUDA support; "
                              "reinstall it where nvcc and a CUDA-enabled torch are present");
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("attention_forward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("attention_backward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("dropout_mask", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("sinks_backward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("decode_attention", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("varlen_forward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("varlen_backward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kernel_route", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
}

}  // namespace flashattn_ext
