// The bfloat16 products on AVX512_BF16 (vdpbf16ps, vcvtneps2bf16; the row
// path's over a bfloat16 cache too) and the int8 products on AVX512_VNNI
// (vpdpbusd): the AVX-512 flags, -mavx512bf16 and -mavx512vnni. This file
// alone is compiled with them; its bfloat16 tables run only where the
// dispatcher found AVX512_BF16 in CPUID, its int8 table where it found
// AVX512_VNNI, with the AVX-512 level's float kernels.
#include "kernels/simd/bf16_kernels.h"
#include "kernels/simd/bf16_rows_native.h"
#include "kernels/simd/int8_quantize.h"
#include "kernels/simd/int8_vnni.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {

const Bf16KernelTable& avx512_native_bf16_kernels() {
  static const Bf16KernelTable table = [] {
    Bf16KernelTable t = simd::Bf16Kernels<simd::Avx512F32, true, avx512_kernels_f32>::table(
        "bf16_products__avx512bf16_mr12_nr32", Isa::kAvx512);
    t.scores_bf16_rows = simd::Avx512Bf16Rows::scores;
    t.accumulate_pv_bf16_rows = simd::Avx512Bf16Rows::accumulate_pv;
    // Where the products run as float32 (Bf16Products::kFloat), the AVX-512
    // level's kernel.
    t.scores_bf16_split = avx512_bf16_kernels().scores_bf16_split;
    return t;
  }();
  return table;
}

const Int8KernelTable& avx512_vnni_int8_kernels() {
  static const Int8KernelTable table = [] {
    Int8KernelTable t =
        simd::Avx512VnniInt8Kernels::table("int8_products__avx512vnni", Isa::kAvx512);
    t.quantize = simd::Avx512Int8Quantize::quantize;
    return t;
  }();
  return table;
}

}  // namespace attnx
