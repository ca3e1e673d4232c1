// AVX2 + FMA + F16C kernels. This file alone is compiled with -mavx2 -mfma
// -mf16c; it runs only where the dispatcher found all three in CPUID.
#include "kernels/simd/attention_kernels.h"
#include "kernels/simd/bf16_kernels.h"
#include "kernels/simd/bf16_rows_split.h"
#include "kernels/simd/int8_avx2.h"
#include "kernels/simd/int8_quantize.h"
#include "kernels/simd/vec_avx2.h"

namespace attnx {

const KernelTable<float>& avx2_kernels_f32() {
  static const KernelTable<float> table =
      simd::Kernels<simd::Avx2F32>::table("f32_attention__avx2_fma_mr6_nr16", Isa::kAvx2);
  return table;
}

const KernelTable<double>& avx2_kernels_f64() {
  static const KernelTable<double> table =
      simd::Kernels<simd::Avx2F64>::table("f64_attention__avx2_fma_mr6_nr8", Isa::kAvx2);
  return table;
}

// The bfloat16 products, emulated (see simd/bf16_kernels.h).
const Bf16KernelTable& avx2_bf16_kernels() {
  static const Bf16KernelTable table = [] {
    Bf16KernelTable t = simd::Bf16Kernels<simd::Avx2F32, false, avx2_kernels_f32>::table(
        "bf16_products__avx2_fma_emulated_mr4_nr16", Isa::kAvx2);
    t.scores_bf16_split = simd::Avx2SplitBf16Rows::scores;
    return t;
  }();
  return table;
}

// The int8 products on vpmaddubsw (see simd/int8_avx2.h).
const Int8KernelTable& avx2_int8_kernels() {
  static const Int8KernelTable table = [] {
    Int8KernelTable t = simd::Avx2Int8Kernels::table("int8_products__avx2_maddubs", Isa::kAvx2);
    t.quantize = simd::Avx2Int8Quantize::quantize;
    return t;
  }();
  return table;
}

}  // namespace attnx
