// The kernels of one instruction set, written once over a vector type `Vec`
// (simd/vec_*.h) and instantiated by each kernels/<isa>/kernels__<isa>.cpp,
// which is compiled with that instruction set's flags. Include it nowhere
// else: the code must only ever be compiled for the ISA that runs it.
//
// The kernels come in five parts, each a struct of static functions over
// `Vec`: the register-tiled gemm (gemm_kernels.h), the softmax steps
// (softmax_kernels.h), the row kernels for a few queries against many keys
// (row_kernels.h), the passes over whole arrays (array_kernels.h) and those
// of transformer layers (layer_kernels.h).
// Kernels<Vec> gathers them into the ISA's KernelTable.
#pragma once

#include <cstdint>

#include "kernels/kernel_table.h"
#include "kernels/simd/array_kernels.h"
#include "kernels/simd/gemm_kernels.h"
#include "kernels/simd/layer_kernels.h"
#include "kernels/simd/row_kernels.h"
#include "kernels/simd/softmax_kernels.h"

namespace attnx::simd {
namespace {

template <class Vec>
struct Kernels {
  using T = typename Vec::T;
  using Gemm = GemmKernels<Vec>;
  using Softmax = SoftmaxKernels<Vec>;
  using Rows = RowKernels<Vec>;
  using Arrays = ArrayKernels<Vec>;
  using Layers = LayerKernels<Vec>;
  using Stored = typename Rows::Stored;

  static KernelTable<T> table(const char* name, Isa isa) {
    KernelTable<T> t{name,
                     isa,
                     Vec::W,
                     Softmax::QT,
                     Gemm::NR,
                     Gemm::kWideWidth,
                     Vec::kRowGroup,
                     Gemm::gemm,
                     Softmax::softmax_tile,
                     Softmax::add_mask_sums,
                     Rows::scores,
                     Rows::accumulate_pv,
                     Softmax::exp_shift_sum,
                     Softmax::row_max,
                     Arrays::scale,
                     Arrays::scale_columns,
                     Arrays::softcap,
                     Arrays::block_state,
                     Arrays::all_finite,
                     Rows::dot_rows,
                     Arrays::pack_transposed,
                     Gemm::gemm_wide,
                     Gemm::fma_probe,
                     nullptr,
                     nullptr,
                     nullptr,
                     {nullptr, nullptr},
                     {nullptr, nullptr},
                     nullptr,
                     nullptr,
                     Layers::activate,
                     Layers::add_layer_norm,
                     Rows::scores_listed,
                     Rows::accumulate_pv_listed};
    if constexpr (Vec::kWidens16) {
      t.widen_float16 = Arrays::widen_float16;
      t.widen_bfloat16 = Arrays::widen_bfloat16;
      t.widen_int8 = Arrays::widen_int8;
      t.scores_16bit[0] = Rows::template scores_of<Stored::kFloat16, uint16_t>;
      t.scores_16bit[1] = Rows::template scores_of<Stored::kBfloat16, uint16_t>;
      t.accumulate_pv_16bit[0] = Rows::template accumulate_pv_of<Stored::kFloat16, uint16_t>;
      t.accumulate_pv_16bit[1] = Rows::template accumulate_pv_of<Stored::kBfloat16, uint16_t>;
      t.scores_int8 = Rows::scores_int8;
      t.accumulate_pv_int8 = Rows::accumulate_pv_int8;
    }
    return t;
  }
};

}  // namespace
}  // namespace attnx::simd
