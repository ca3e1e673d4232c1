// AVX-512 kernels (AVX512F/DQ/BW/VL + FMA). This file alone is compiled with
// those flags; it runs only where the dispatcher found them in CPUID.
#include "kernels/simd/attention_kernels.h"
#include "kernels/simd/bf16_kernels.h"
#include "kernels/simd/bf16_rows_split.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {

const KernelTable<float>& avx512_kernels_f32() {
  static const KernelTable<float> table =
      simd::Kernels<simd::Avx512F32>::table("f32_attention__avx512f_mr12_nr32", Isa::kAvx512);
  return table;
}

const KernelTable<double>& avx512_kernels_f64() {
  static const KernelTable<double> table =
      simd::Kernels<simd::Avx512F64>::table("f64_attention__avx512f_mr12_nr16", Isa::kAvx512);
  return table;
}

// The bfloat16 products, emulated (see simd/bf16_kernels.h).
const Bf16KernelTable& avx512_bf16_kernels() {
  static const Bf16KernelTable table = [] {
    Bf16KernelTable t = simd::Bf16Kernels<simd::Avx512F32, false, avx512_kernels_f32>::table(
        "bf16_products__avx512f_emulated_mr12_nr32", Isa::kAvx512);
    t.scores_bf16_split = simd::Avx512SplitBf16Rows::scores;
    return t;
  }();
  return table;
}

}  // namespace attnx
