// Portable kernels: the same templates over plain 8-value "vectors", built
// for the baseline instruction set of any CPU (and any architecture).
#include "kernels/simd/attention_kernels.h"
#include "kernels/simd/bf16_kernels.h"
#include "kernels/simd/int8_kernels.h"
#include "kernels/simd/vec_portable.h"

namespace attnx {

const KernelTable<float>& scalar_kernels_f32() {
  static const KernelTable<float> table =
      simd::Kernels<simd::Portable<float>>::table("f32_attention__scalar_mr4_nr16", Isa::kScalar);
  return table;
}

const KernelTable<double>& scalar_kernels_f64() {
  static const KernelTable<double> table = simd::Kernels<simd::Portable<double>>::table(
      "f64_attention__scalar_mr4_nr16", Isa::kScalar);
  return table;
}

// The bfloat16 products, emulated (see simd/bf16_kernels.h).
const Bf16KernelTable& scalar_bf16_kernels() {
  static const Bf16KernelTable table =
      simd::Bf16Kernels<simd::Portable<float>, false, scalar_kernels_f32>::table(
          "bf16_products__scalar_emulated_mr4_nr16", Isa::kScalar);
  return table;
}

const Int8KernelTable& portable_int8_kernels() {
  static const Int8KernelTable table =
      simd::PortableInt8Kernels::table("int8_products__portable", Isa::kScalar);
  return table;
}

// The int8 products on the float32 row kernels (see simd/int8_kernels.h).
const Int8KernelTable& scalar_int8_kernels() {
  static const Int8KernelTable table =
      simd::FloatExactInt8Kernels<scalar_kernels_f32>::table("int8_products__scalar", Isa::kScalar);
  return table;
}

}  // namespace attnx
