// The rules every attention path follows for non-finite scores, in one place
// (the kernels apply the same in their vectors).
//
// - A score of -inf (a masked key) contributes probability 0.
// - A row whose scores are all -inf (fully masked) gives a zero output row
//   and zero weights, never NaN.
// - A NaN score, or +inf, makes its row NaN: it is never silently dropped.
#pragma once

#include <cmath>
#include <limits>

namespace attnx {

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// Running maximum that ignores NaN (a NaN score then yields a NaN
// probability through exp, which is what propagates it).
template <typename T>
inline T max_ignoring_nan(T running, T x) {
  return x > running ? x : running;
}

// The value subtracted before exp. When every score so far is -inf the max
// is -inf and exp(-inf - -inf) would be NaN: subtracting 0 instead makes the
// masked scores 0 and keeps a NaN score NaN.
template <typename T>
inline T exp_shift(T row_max) {
  return row_max == kNegInf<T> ? T(0) : row_max;
}

}  // namespace attnx
