// The projections of multi-head attention.
//
//   wt = transpose(w)                    (in, out), once per call
//   parallel for each group of kLinearRows rows of x:
//     y_rows = bias + x_rows . wt        (the kernel's linear_rows)
//
// Transposing makes the inner loop an element-wise multiply-add along the
// output row, which vectorises without reordering any sum: each output value
// is accumulated over `in` in the same order whatever the thread count.
#include <algorithm>
#include <vector>

#include "attention/projection.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {

template <typename T>
void linear_forward(const StridedView<const T, 3>& x, const RowMajorView<const T>& w,
                    const T* bias, const StridedView<T, 3>& y) {
  const int64_t N = x.shape[0], L = x.shape[1], in = x.shape[2], out = w.rows;
  if (N == 0 || L == 0 || out == 0) return;
  const KernelTable<T>& kt = active_kernels(T());

  std::vector<T> wt(size_t(in) * size_t(out));
  for (int64_t o = 0; o < out; ++o) {
    const T* wo = w.row(o);
    for (int64_t i = 0; i < in; ++i) wt[i * out + o] = wo[i];
  }

  const int64_t groups_per_batch = (L + kLinearRows - 1) / kLinearRows;
  const int64_t tasks = N * groups_per_batch;
  const int nthreads = threads_for(double(N) * double(L) * double(in) * double(out));
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n = t / groups_per_batch;
    const int64_t l0 = (t % groups_per_batch) * kLinearRows;
    const int64_t rows = std::min<int64_t>(kLinearRows, L - l0);
    const T* x_rows[kLinearRows];
    T* y_rows[kLinearRows];
    for (int64_t r = 0; r < rows; ++r) {
      x_rows[r] = x.at(n, l0 + r);
      y_rows[r] = y.at(n, l0 + r);
    }
    kt.linear_rows(x_rows, rows, wt.data(), in, out, bias, y_rows);
  }
}

template void linear_forward<float>(const StridedView<const float, 3>&,
                                    const RowMajorView<const float>&, const float*,
                                    const StridedView<float, 3>&);
template void linear_forward<double>(const StridedView<const double, 3>&,
                                     const RowMajorView<const double>&, const double*,
                                     const StridedView<double, 3>&);

}  // namespace attnx
