// A portable "vector" of W plain values, so the same kernel templates build
// for any CPU. Each operation is an element-wise loop the compiler may
// vectorise for the baseline instruction set.
#pragma once

#include <cmath>
#include <limits>

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

template <typename Scalar>
struct Portable {
  using T = Scalar;
  static constexpr int W = 8;
  static constexpr int kGemmRows = 4;
  struct V {
    T lane[W];
  };

  template <typename F>
  static V map(F f) {
    V r;
    for (int i = 0; i < W; ++i) r.lane[i] = f(i);
    return r;
  }
  static V zero() { return set1(T(0)); }
  static V set1(T x) {
    return map([x](int) { return x; });
  }
  static V load(const T* p) {
    return map([p](int i) { return p[i]; });
  }
  static void store(T* p, V v) {
    for (int i = 0; i < W; ++i) p[i] = v.lane[i];
  }
  static V load_partial(const T* p, int n) {
    return map([p, n](int i) { return i < n ? p[i] : T(0); });
  }
  static void store_partial(T* p, V v, int n) {
    for (int i = 0; i < n; ++i) p[i] = v.lane[i];
  }
  static V add(V a, V b) {
    return map([&](int i) { return a.lane[i] + b.lane[i]; });
  }
  static V sub(V a, V b) {
    return map([&](int i) { return a.lane[i] - b.lane[i]; });
  }
  static V mul(V a, V b) {
    return map([&](int i) { return a.lane[i] * b.lane[i]; });
  }
  static V fmadd(V a, V b, V c) {
    return map([&](int i) { return a.lane[i] * b.lane[i] + c.lane[i]; });
  }
  static V max_ignoring_nan(V running, V x) {
    return map([&](int i) { return x.lane[i] > running.lane[i] ? x.lane[i] : running.lane[i]; });
  }
  static T reduce_add(V v) {
    // Pairwise, a fixed order.
    for (int width = W / 2; width > 0; width /= 2)
      for (int i = 0; i < width; ++i) v.lane[i] += v.lane[i + width];
    return v.lane[0];
  }
  static T reduce_max(V v) {
    T m = v.lane[0];
    for (int i = 1; i < W; ++i) m = v.lane[i] > m ? v.lane[i] : m;
    return m;
  }
  static V exp_shift(V m) {
    return map([&](int i) {
      return m.lane[i] == -std::numeric_limits<T>::infinity() ? T(0) : m.lane[i];
    });
  }
  static V exp(V x) {
    return map([&](int i) { return std::exp(x.lane[i]); });
  }
  static V exp2(V x) {
    return map([&](int i) { return std::exp2(x.lane[i]); });
  }
  static void transpose(V (&r)[W]) {
    for (int i = 0; i < W; ++i)
      for (int j = i + 1; j < W; ++j) {
        const T x = r[i].lane[j];
        r[i].lane[j] = r[j].lane[i];
        r[j].lane[i] = x;
      }
  }
};

}  // namespace
}  // namespace attnx::simd
