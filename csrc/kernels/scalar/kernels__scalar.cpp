// Portable kernels: the same templates over plain 8-value "vectors", built
// for the baseline instruction set of any CPU (and any architecture).
#include "kernels/simd/attention_kernels.h"
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

}  // namespace attnx
