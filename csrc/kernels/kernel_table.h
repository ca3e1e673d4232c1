// The micro-kernels the attention drivers are built from. Every instruction
// set fills one table of the same function-pointer type; the dispatcher picks
// one table per dtype at import (see dispatch/isa.cpp).
#pragma once

#include <cstdint>

namespace attnx {

template <typename T>
struct KernelTable {
  const char* name;  // e.g. "f32_attention__scalar"

  // dst[j] = scale * <q, k_j> for j < n_keys; key rows are ldk apart.
  void (*scores)(const T* q, const T* k, int64_t ldk, int64_t n_keys, int64_t dim, T scale,
                 T* dst);

  // acc[:dim] += sum_j p[j] * v_j for j < n_keys; value rows are ldv apart.
  void (*accumulate_pv)(const T* p, const T* v, int64_t ldv, int64_t n_keys, int64_t dim,
                        T* acc);

  // x[j] = exp(x[j] - shift) in place; returns the sum of the new values.
  T (*exp_shift_sum)(T* x, int64_t n, T shift);

  // y[j] *= alpha.
  void (*scale)(T* y, int64_t n, T alpha);

  // Up to kLinearRows rows at once: y_r[:n] = bias + x_r[:k] . wt, where wt is
  // the (k, n) row-major transpose of the weight. bias may be null.
  void (*linear_rows)(const T* const* x, int64_t rows, const T* wt, int64_t k, int64_t n,
                      const T* bias, T* const* y);
};

inline constexpr int kLinearRows = 4;

const KernelTable<float>& scalar_kernels_f32();
const KernelTable<double>& scalar_kernels_f64();

// The tables chosen by the dispatcher.
const KernelTable<float>& active_kernels(float);
const KernelTable<double>& active_kernels(double);

}  // namespace attnx
