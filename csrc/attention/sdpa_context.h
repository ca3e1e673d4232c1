// What every task of a call of scaled dot-product attention shares: the
// call, the kernels, the plan, and what the driver prepared for the paths.
#pragma once

#include "attention/masking/mask_blocks.h"
#include "attention/sdpa_common.h"
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
};

}  // namespace attnx::sdpa
