// Portable kernels: plain C++ that any compiler can build for any CPU.
//
// They are written so that the compiler vectorises them for the baseline
// instruction set without reassociating sums: dot products keep kLanes
// independent partial sums (an order fixed by the code, so results do not
// depend on the compiler's choices or the thread count), and the other loops
// are element-wise.
#include <cmath>

#include "kernels/kernel_table.h"

namespace attnx {
namespace {

constexpr int kLanes = 8;

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) partial[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) partial[l] += a[i] * b[i];
  // Pairwise fold of the lanes: a fixed order.
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  return partial[0];
}

template <typename T>
void scores(const T* q, const T* k, int64_t ldk, int64_t n_keys, int64_t dim, T scale, T* dst) {
  for (int64_t j = 0; j < n_keys; ++j) dst[j] = scale * dot(q, k + j * ldk, dim);
}

template <typename T>
void accumulate_pv(const T* p, const T* v, int64_t ldv, int64_t n_keys, int64_t dim, T* acc) {
  for (int64_t j = 0; j < n_keys; ++j) {
    const T pj = p[j];
    if (pj == T(0)) continue;  // a masked key: its value must not reach the row (0 * NaN)
    const T* vj = v + j * ldv;
    for (int64_t d = 0; d < dim; ++d) acc[d] += pj * vj[d];
  }
}

template <typename T>
T exp_shift_sum(T* x, int64_t n, T shift) {
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

template <typename T>
void scale(T* y, int64_t n, T alpha) {
  for (int64_t j = 0; j < n; ++j) y[j] *= alpha;
}

template <typename T>
void linear_rows(const T* const* x, int64_t rows, const T* wt, int64_t k, int64_t n, const T* bias,
                 T* const* y) {
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y[r];
    for (int64_t c = 0; c < n; ++c) yr[c] = bias ? bias[c] : T(0);
  }
  // Each weight row is loaded once for all the rows of the group.
  for (int64_t i = 0; i < k; ++i) {
    const T* w = wt + i * n;
    for (int64_t r = 0; r < rows; ++r) {
      const T xi = x[r][i];
      T* yr = y[r];
      for (int64_t c = 0; c < n; ++c) yr[c] += xi * w[c];
    }
  }
}

template <typename T>
KernelTable<T> make_table(const char* name) {
  return KernelTable<T>{name, scores<T>, accumulate_pv<T>, exp_shift_sum<T>, scale<T>,
                        linear_rows<T>};
}

}  // namespace

const KernelTable<float>& scalar_kernels_f32() {
  static const KernelTable<float> table = make_table<float>("f32_attention__scalar");
  return table;
}

const KernelTable<double>& scalar_kernels_f64() {
  static const KernelTable<double> table = make_table<double>("f64_attention__scalar");
  return table;
}

}  // namespace attnx
