// Linear layers of multi-head attention and of transformer layers:
// y = act(x . w^T + bias), row by row.
#pragma once

#include <cstdint>

#include "attention/cache_line_array.h"
#include "attnx/activation.h"
#include "attnx/precision.h"
#include "attnx/strided_view.h"

namespace attnx {

// A weight matrix w (rows x cols) packed for bfloat16 products: w^T rounded
// and laid out as pairs along cols, in panels of the bfloat16 table's panel
// width (zero past the last row of w), where the products run as pairs;
// else w rounded, as float32 rows (Bf16Products). It owns its storage, or
// is a view of some rows of another's (bf16_weight_rows).
struct Bf16Weights {
  CacheLineArray<uint32_t> data;
  CacheLineArray<float> rounded;
  const uint32_t* panels_begin = nullptr;  // the pairs' first panel
  const float* rounded_begin = nullptr;    // rows x cols, rows cols apart (float32 products)
  int64_t rows = 0, cols = 0;
  int64_t width = 0;  // columns of w^T per panel
  int64_t pairs = 0;  // (cols + 1) / 2: rows of a panel

  bool float_products() const { return rounded_begin != nullptr; }
  const uint32_t* panel(int64_t p) const { return panels_begin + p * pairs * width; }
  RowMajorView<const float> rounded_rows() const {
    return RowMajorView<const float>{rounded_begin, rows, cols, cols};
  }
};

Bf16Weights pack_bf16_weights(const RowMajorView<const float>& w);

// A view of rows [r0, r0 + n) of packed weights (which must outlive it):
// linear_forward reads from it what it would from those rows packed alone
// (a panel's columns past row r0 + n are never read); false where r0 does
// not begin a panel (the pairs lie in whole panels).
bool bf16_weight_rows(const Bf16Weights& w, int64_t r0, int64_t n, Bf16Weights& view);

// y[n, l, :] = act(w . x[n, l, :] + bias) for every (n, l).
// x: (N, L, in) and y: (N, L, out), last dims contiguous; w: (out, in);
// bias: (out) or null. The activation is applied to each block of y as soon
// as its sums are complete, while it is still in cache.
// With Precision::kBFloat16 (T = float), x and w are rounded to bfloat16
// and the sums are float32; `packed`, where given, is w packed by
// pack_bf16_weights (else w is packed by the call).
template <typename T>
void linear_forward(const StridedView<const T, 3>& x, const RowMajorView<const T>& w,
                    const T* bias, const StridedView<T, 3>& y,
                    Activation act = Activation::kNone,
                    Precision precision = Precision::kNative,
                    const Bf16Weights* packed = nullptr);

// Whether linear_forward of `rows` rows (N * L) reads x's rows in place (up
// to kDotRowsMax rows) or copies them, transposed, rather than packing w:
// then one call over stacked weights does better than several over the
// same x.
template <typename T>
bool linear_copies_input(int64_t rows);

// Whether linear_forward computes y = x . w^T for `rows` rows of x and an
// (out x in) w as y^T = w . x^T (few rows, or not many and a large w).
template <typename T>
bool linear_transposes(int64_t rows, int64_t out, int64_t in);

// The steps of linear_forward for such few rows, for a caller that keeps the
// rows transposed from one layer to the next: the N * L rows of x are the
// lanes of x^T, `lanes` of them (transposed_lanes: N * L rounded up to whole
// vectors), row r = n * L + l.
template <typename T>
int64_t transposed_lanes(int64_t rows);
// xt (in x lanes) = x^T; lanes past the rows are 0.
template <typename T>
void transpose_input(const StridedView<const T, 3>& x, int64_t lanes, T* xt);
// yt (w.rows x lanes) = act(w . xt + bias 1^T) (xt: w.cols x lanes; bias optional).
template <typename T>
void linear_transposed(const RowMajorView<const T>& w, const T* bias, const T* xt, int64_t lanes,
                       T* yt, Activation act = Activation::kNone);
// y (N, L, out) = the first N * L lanes of yt (out x lanes), transposed.
template <typename T>
void transpose_output(const T* yt, int64_t lanes, const StridedView<T, 3>& y);

}  // namespace attnx
