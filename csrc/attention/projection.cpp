// The projections of multi-head attention: y = x . w^T + bias.
//
//   pack w^T in panels of NR columns     (in x NR each, zero-padded)
//   parallel for each (batch, block of rows, panel):
//     y[rows, panel] = bias[panel] + x[rows, :] . panel     (the kernel's gemm)
//
// Packing makes each panel's rows contiguous, so the register-blocked gemm
// streams it while broadcasting x. Every output value is accumulated over
// `in` in the same order whatever the thread count.
#include <algorithm>
#include <vector>

#include "attention/projection.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

constexpr int64_t kRowBlock = 96;  // rows of x per task: a multiple of every MR

}  // namespace

template <typename T>
void linear_forward(const StridedView<const T, 3>& x, const RowMajorView<const T>& w,
                    const T* bias, const StridedView<T, 3>& y) {
  const int64_t N = x.shape[0], L = x.shape[1], in = x.shape[2], out = w.rows;
  if (N == 0 || L == 0 || out == 0) return;
  const KernelTable<T>& kt = active_kernels(T());
  const int64_t nr = kt.panel_width;
  const int64_t panels = (out + nr - 1) / nr;

  std::vector<T> packed(size_t(panels * in * nr), T(0));
  for (int64_t o = 0; o < out; ++o) {
    T* panel = packed.data() + (o / nr) * in * nr + o % nr;
    const T* wo = w.row(o);
    for (int64_t i = 0; i < in; ++i) panel[i * nr] = wo[i];
  }

  const int64_t row_blocks = (L + kRowBlock - 1) / kRowBlock;
  const int64_t tasks = N * row_blocks * panels;
  const int nthreads = threads_for(double(N) * double(L) * double(in) * double(out));
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t p = t % panels, nb = t / panels;
    const int64_t n = nb / row_blocks, l0 = (nb % row_blocks) * kRowBlock;
    const int64_t rows = std::min(kRowBlock, L - l0);
    const int64_t cols = std::min(nr, out - p * nr);
    kt.gemm(rows, cols, in, x.at(n, l0), x.stride[1], 1, packed.data() + p * in * nr, nr,
            y.at(n, l0) + p * nr, y.stride[1], bias ? GemmInit::kBiasColumns : GemmInit::kZero,
            bias ? bias + p * nr : nullptr);
  }
}

template void linear_forward<float>(const StridedView<const float, 3>&,
                                    const RowMajorView<const float>&, const float*,
                                    const StridedView<float, 3>&);
template void linear_forward<double>(const StridedView<const double, 3>&,
                                     const RowMajorView<const double>&, const double*,
                                     const StridedView<double, 3>&);

}  // namespace attnx
