// The passes of transformer layers around their products, over a vector type
// `Vec`: the feed-forward block's activation and the residual sum with its
// layer norm. Included by attention_kernels.h alone, so that it is compiled
// only with the flags of the instruction set that runs it.
#pragma once

#include <cmath>
#include <cstdint>

#include "attnx/activation.h"
#include "kernels/kernel_table.h"
#include "kernels/simd/kernel_helpers.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

template <class Vec>
struct LayerKernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;

  static void activate(T* x, int64_t rows, int64_t ld, int64_t cols, Activation kind) {
    if (kind == Activation::kRelu)
      map_rows<Vec>(x, rows, ld, cols, [](V v) { return Vec::relu(v); });
    else if (kind == Activation::kGelu)
      map_rows<Vec>(x, rows, ld, cols, [](V v) { return Vec::gelu(v); });
  }

  // The row's values are summed by W lanes and then across them, and the
  // tail one by one after that: one order, whatever the thread count.
  static void add_layer_norm(const T* x, const T* y, int64_t n, const T* weight, const T* bias,
                             T eps, T* sum_out, T* out) {
    // s = x + y, kept in sum_out, else in out (read back by the passes below).
    T* s = sum_out ? sum_out : out;
    const int64_t whole = n / W * W;
    V acc = Vec::zero();
    for (int64_t j = 0; j < whole; j += W) {
      const V v = y ? Vec::add(Vec::load(x + j), Vec::load(y + j)) : Vec::load(x + j);
      Vec::store(s + j, v);
      acc = Vec::add(acc, v);
    }
    T total = Vec::reduce_add(acc);
    for (int64_t j = whole; j < n; ++j) {
      s[j] = y ? x[j] + y[j] : x[j];
      total += s[j];
    }
    if (!out) return;
    const T mean = total / T(n);
    const V m = Vec::set1(mean);
    V sq = Vec::zero();
    for (int64_t j = 0; j < whole; j += W) {
      const V d = Vec::sub(Vec::load(s + j), m);
      sq = Vec::fmadd(d, d, sq);
    }
    T squares = Vec::reduce_add(sq);
    for (int64_t j = whole; j < n; ++j) squares += (s[j] - mean) * (s[j] - mean);
    const T rstd = T(1) / std::sqrt(squares / T(n) + eps);
    const V r = Vec::set1(rstd);
    for (int64_t j = 0; j < whole; j += W) {
      V v = Vec::mul(Vec::sub(Vec::load(s + j), m), r);
      if (weight) v = Vec::mul(v, Vec::load(weight + j));
      if (bias) v = Vec::add(v, Vec::load(bias + j));
      Vec::store(out + j, v);
    }
    for (int64_t j = whole; j < n; ++j) {
      T v = (s[j] - mean) * rstd;
      if (weight) v *= weight[j];
      if (bias) v += bias[j];
      out[j] = v;
    }
  }
};

}  // namespace
}  // namespace attnx::simd
