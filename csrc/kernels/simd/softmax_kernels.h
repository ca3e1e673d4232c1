// Softmax steps of one instruction set, over a vector type `Vec`: the flash
// tile's online softmax down its query lanes, and a row's max and exp-sum.
// Included by attention_kernels.h alone, so that it is compiled only with
// the flags of the instruction set that runs it.
#pragma once

#include <cstdint>
#include <limits>

#include "kernels/kernel_table.h"
#include "kernels/simd/kernel_helpers.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

template <class Vec>
struct SoftmaxKernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
  static constexpr int QT = Vec::kQueryTileVectors * W;  // queries per flash tile
  static constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  // ---- online softmax over a (keys x QT queries) tile --------------------
  // e^(s - m) is computed as 2^((s - m) log2 e): the difference is taken
  // first, in natural units, so a large mask value added to the scores
  // (-1e4 is common) costs no precision; exp2 then needs no range reduction.
  static void softmax_tile(T* s, int64_t rows, int lanes, T* m, T* l, T* alpha,
                           const LineRequests& ahead) {
    if (lanes == QT) return softmax_lanes<Vec::kQueryTileVectors>(s, rows, 0, m, l, alpha, &ahead);
    for (int lane0 = 0; lane0 < lanes; lane0 += W)
      softmax_lanes<1>(s, rows, lane0, m, l, alpha, lane0 == 0 ? &ahead : nullptr);
  }

  // softmax_tile for NV vectors of lanes from lane0. The vectors go side by
  // side through each key row: their running maxima and sums are NV
  // independent chains, where one vector at a time waits on the latency of
  // each max and add (the same operations in the same order per lane: the
  // same bits).
  template <int NV>
  static void softmax_lanes(T* s, int64_t rows, int lane0, T* m, T* l, T* alpha,
                            const LineRequests* ahead) {
    // Step 1: the new running max of each query (NaN scores ignored), in
    // kMaxChains independent chains of rows, merged at the end: one chain
    // would wait a max's latency per row, and nothing else can run until
    // the max is known. The maximum is the same in any order (up to the sign
    // of a zero maximum, which no exp below can see).
    constexpr int kMaxChains = 4;
    V block_max[kMaxChains][NV];
#pragma GCC unroll 4
    for (int c = 0; c < kMaxChains; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) block_max[c][v] = Vec::set1(kNegInf);
    int64_t j = 0;
    for (; j + kMaxChains <= rows; j += kMaxChains) {
#pragma GCC unroll 4
      for (int c = 0; c < kMaxChains; ++c) {
        const T* sj = s + (j + c) * QT + lane0;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          block_max[c][v] = Vec::max_ignoring_nan(block_max[c][v], Vec::load(sj + v * W));
      }
    }
    for (; j < rows; ++j) {
      const T* sj = s + j * QT + lane0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        block_max[0][v] = Vec::max_ignoring_nan(block_max[0][v], Vec::load(sj + v * W));
    }
#pragma GCC unroll 4
    for (int c = 1; c < kMaxChains; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        block_max[0][v] = Vec::max_ignoring_nan(block_max[0][v], block_max[c][v]);
    V m_old[NV], shift[NV], sum[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      m_old[v] = Vec::load(m + lane0 + v * W);
      const V m_new = Vec::max_ignoring_nan(m_old[v], block_max[0][v]);
      Vec::store(m + lane0 + v * W, m_new);
      // 0 replaces a -inf max.
      shift[v] = Vec::exp_shift(m_new);
      sum[v] = Vec::zero();
    }
    // Step 2: exponentiate against it, summing; per row, a line of each
    // range of `ahead`.
    const int64_t requests0 = ahead ? min64(rows, ahead->ranges[0].size()) : 0;
    const int64_t requests1 = ahead ? min64(rows, ahead->ranges[1].size()) : 0;
    const V log2e = Vec::set1(T(1.4426950408889634073599246810018921L));
    for (int64_t j = 0; j < rows; ++j) {
      if (j < requests0) request_line(ahead->ranges[0], ahead->ranges[0].begin + j);
      if (j < requests1) request_line(ahead->ranges[1], ahead->ranges[1].begin + j);
      T* sj = s + j * QT + lane0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const V p =
            Vec::exp2_nonpositive(Vec::mul(Vec::sub(Vec::load(sj + v * W), shift[v]), log2e));
        Vec::store(sj + v * W, p);
        sum[v] = Vec::add(sum[v], p);
      }
    }
    // Step 3: rescale factor of what was accumulated, and the new sums.
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const V a = Vec::exp2_nonpositive(Vec::mul(Vec::sub(m_old[v], shift[v]), log2e));
      Vec::store(alpha + lane0 + v * W, a);
      Vec::store(l + lane0 + v * W, Vec::fmadd(a, Vec::load(l + lane0 + v * W), sum[v]));
    }
  }

  static void add_mask_sums(T* s, const T* sums, int64_t keys, int64_t ld, int lanes,
                            T* closed) {
    for (int lane0 = 0; lane0 < lanes; lane0 += W) {
      V count = Vec::zero();
      for (int64_t j = 0; j < keys; ++j) {
        const V sum = Vec::load(sums + j * ld + lane0);
        T* sj = s + j * ld + lane0;
        Vec::store(sj, Vec::add_unless_closed(Vec::load(sj), sum));
        count = Vec::add(count, Vec::closed_indicator(sum));
      }
      Vec::store(closed + lane0, count);
    }
  }

  // ---- one row ------------------------------------------------------------
  static T row_max(const T* x, int64_t n) {
    // A lane never holds NaN (max_ignoring_nan keeps the running value), so
    // the lanes' maximum is the row's; it is the same in any order.
    V m = Vec::set1(kNegInf);
    int64_t j = 0;
    for (; j + W <= n; j += W) m = Vec::max_ignoring_nan(m, Vec::load(x + j));
    T best = Vec::reduce_max(m);
    for (; j < n; ++j) best = x[j] > best ? x[j] : best;
    return best;
  }

  static T exp_shift_sum(T* x, int64_t n, T shift) {
    const V s = Vec::set1(shift);
    V sum = Vec::zero();
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const V p = Vec::exp(Vec::sub(Vec::load(x + j), s));
      Vec::store(x + j, p);
      sum = Vec::add(sum, p);
    }
    if (j < n) {
      // The tail is padded with -inf, whose exp adds exactly 0 to the sum.
      T tail[W];
      const int len = static_cast<int>(n - j);
      for (int t = 0; t < W; ++t) tail[t] = t < len ? x[j + t] : kNegInf;
      const V p = Vec::exp(Vec::sub(Vec::load(tail), s));
      Vec::store_partial(x + j, p, len);
      sum = Vec::add(sum, p);
    }
    return Vec::reduce_add(sum);
  }
};

}  // namespace
}  // namespace attnx::simd
