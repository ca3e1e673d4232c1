// Linear layers of multi-head attention: y = x . w^T + bias, row by row.
#pragma once

#include "attnx/strided_view.h"

namespace attnx {

// y[n, l, :] = w . x[n, l, :] + bias for every (n, l).
// x: (N, L, in) and y: (N, L, out), last dims contiguous; w: (out, in);
// bias: (out) or null.
template <typename T>
void linear_forward(const StridedView<const T, 3>& x, const RowMajorView<const T>& w,
                    const T* bias, const StridedView<T, 3>& y);

// Whether linear_forward of `rows` rows (N * L) copies x, transposed, rather
// than packing w: then the fewer calls over the same x, the fewer copies.
template <typename T>
bool linear_copies_input(int64_t rows);

}  // namespace attnx
