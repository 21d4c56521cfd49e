// attention_forward: forward_tiles (forward.h) with the output, its tile
// products by ReducedProducts where the 16-bit inputs take them (see
// takes_reduced_products), else ConvertedProducts.
#include "cpu/flash_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/forward.h"
#include "cpu/products.h"
#include "cpu/tiles.h"

namespace flashattn_ext::cpu {

// The kernels' parts (tiles.h and the rest) live in detail.
using namespace detail;

template <typename T>
void attention_forward(const FwdParams& params) {
  auto* lse = static_cast<Lse<T>*>(params.lse);
  if constexpr (kIs16Bit<T>) {
    if (takes_reduced_products<T>()) {
      forward_tiles<T, /*kWithOutput=*/true, Lse<T>, ReducedProducts<T>>(params, lse);
      return;
    }
  }
  forward_tiles<T>(params, lse);
}

#define FLASHATTN_EXT_INSTANTIATE(T) template void attention_forward<T>(const FwdParams&);
FLASHATTN_EXT_CPU_FOR_EACH_TYPE(FLASHATTN_EXT_INSTANTIATE)
#undef FLASHATTN_EXT_INSTANTIATE

}  // namespace flashattn_ext::cpu
