// What every task of a call of scaled dot-product attention shares: the
// call, the kernels, the plan, and what the driver prepared for the paths.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention/masking/mask_blocks.h"
#include "attention/sdpa_bf16.h"
#include "attention/sdpa_common.h"
#include "attention/sdpa_int8.h"
#include "attention/sdpa_plan.h"
#include "attnx/attention.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

template <typename T>
struct SdpaContext {
  const SdpaArgs<T>& args;
  const KernelTable<T>& kt;
  const SdpaPlan& plan;
  const FiniteRows& finite_values;     // taken where plan.finite_values
  const MaskBlockMap<T>& mask_blocks;  // built where plan.mask_blocks
  T* states;                           // plan.states_size: the rows' states per key chunk
  // With bfloat16 products: the rounded operands (args are then a16), else null.
  const Bf16Operands* bf16 = nullptr;
  // With int8 products: the quantized queries, else null.
  const Int8Queries* int8 = nullptr;
};

// With bfloat16 products, x[0..n) rounded to bfloat16 values in place: the
// operands a path multiplies (the probabilities, or rows of values it reads
// as float32). Else nothing.
template <typename T>
void round_operands(const SdpaContext<T>& c, T* x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (c.bf16) c.bf16->kt16->round_in_place(x, n);
  }
}

// A block's n rows of `cols` elements (ld apart; already in buf where v is
// buf) rounded as round_operands rounds into buf (rows cols apart): the
// operands of a block read where it lies, as a path multiplies them.
template <typename T>
const T* bf16_rounded_rows(const SdpaContext<T>& c, const T* v, int64_t ld, int64_t n,
                           int64_t cols, T* buf) {
  for (int64_t j = 0; j < n; ++j)
    if (v + j * ld != buf + j * cols) std::copy_n(v + j * ld, cols, buf + j * cols);
  round_operands(c, buf, n * cols);
  return buf;
}

}  // namespace attnx::sdpa
