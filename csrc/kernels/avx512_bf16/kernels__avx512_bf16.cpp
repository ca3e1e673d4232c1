// The bfloat16 products on AVX512_BF16 (vdpbf16ps, vcvtneps2bf16): the
// AVX-512 flags and -mavx512bf16. This file alone is compiled with them; it
// runs only where the dispatcher found AVX512_BF16 in CPUID, with the
// AVX-512 level's float kernels.
#include "kernels/simd/bf16_kernels.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {

const Bf16KernelTable& avx512_native_bf16_kernels() {
  static const Bf16KernelTable table = simd::Bf16Kernels<simd::Avx512F32, true>::table(
      "bf16_products__avx512bf16_mr12_nr32", Isa::kAvx512);
  return table;
}

}  // namespace attnx
