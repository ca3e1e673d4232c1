// Passes over whole arrays of one instruction set, over a vector type `Vec`:
// scaling, the transposing pack of a query tile, checks of finiteness and of
// mask blocks, and the widening of 16-bit storage.
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
struct ArrayKernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
  static constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  static void scale(const T* x, int64_t n, T alpha, T* y) {
    const V a = Vec::set1(alpha);
    map_row<Vec>(x, n, y, [a](V v) { return Vec::mul(v, a); });
  }

  static void scale_columns(T* x, int64_t rows, int64_t ld, int64_t cols, const T* factors) {
    for (int64_t j = 0; j < cols; j += W) {
      const V f = Vec::load(factors + j);
      for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * ld + j;
        Vec::store(xr, Vec::mul(Vec::load(xr), f));
      }
    }
  }

  // x[r * ld + j] = cap * tanh(x[r * ld + j]) for r < rows, j < cols (any
  // count: the tail of a row by a partial load and store): x holds the
  // scores divided by the cap (see SdpaArgs::query_scale).
  static void softcap(T* x, int64_t rows, int64_t ld, int64_t cols, T cap) {
    map_rows<Vec>(x, rows, ld, cols, [cap](V y) { return Vec::tanh_times(y, cap); });
  }

  // dst[c * lanes + r] = scale * src[r * ld + c] for r < rows, c < cols, and
  // 0 for rows <= r < lanes (a multiple of W): W x W blocks transposed in
  // registers.
  static void pack_transposed(const T* src, int64_t ld, int64_t rows, int64_t cols, T scale,
                              T* dst, int64_t lanes) {
    const V s = Vec::set1(scale);
    for (int64_t r0 = 0; r0 < lanes; r0 += W) {
      if (r0 >= rows) {  // padding lanes only
        for (int64_t c = 0; c < cols; ++c) Vec::store(dst + c * lanes + r0, Vec::zero());
        continue;
      }
      const T* src_rows = src + r0 * ld;
      int64_t c0 = 0;
      if (r0 + W <= rows) {
        // Whole blocks: straight-line loads, transpose and stores.
        for (; c0 + W <= cols; c0 += W) {
          V block[W];
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) block[i] = Vec::mul(Vec::load(src_rows + i * ld + c0), s);
          Vec::transpose(block);
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) Vec::store(dst + (c0 + i) * lanes + r0, block[i]);
        }
      }
      for (; c0 < cols; c0 += W) {
        const int width = static_cast<int>(min64(W, cols - c0));
        V block[W];
        for (int i = 0; i < W; ++i)
          block[i] = r0 + i < rows
                         ? Vec::mul(width == W ? Vec::load(src + (r0 + i) * ld + c0)
                                               : Vec::load_partial(src + (r0 + i) * ld + c0, width),
                                    s)
                         : Vec::zero();
        Vec::transpose(block);
        for (int i = 0; i < width; ++i) Vec::store(dst + (c0 + i) * lanes + r0, block[i]);
      }
    }
  }

  // Whether the rows x cols entries x[r * ld + c] hold no NaN or infinity:
  // x * 0 is 0 for a finite x and NaN for NaN and +-inf, summed over the rows
  // in four chains of multiply-adds (a long row goes at the loads' speed, not
  // at one chain's latency) and reduced once.
  static bool all_finite(const T* x, int64_t ld, int64_t rows, int64_t cols) {
    V probe = Vec::zero(), p1 = Vec::zero(), p2 = Vec::zero(), p3 = Vec::zero();
    const V zero = Vec::zero();
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * ld;
      int64_t j = 0;
      for (; j + 4 * W <= cols; j += 4 * W) {
        probe = Vec::fmadd(Vec::load(row + j), zero, probe);
        p1 = Vec::fmadd(Vec::load(row + j + W), zero, p1);
        p2 = Vec::fmadd(Vec::load(row + j + 2 * W), zero, p2);
        p3 = Vec::fmadd(Vec::load(row + j + 3 * W), zero, p3);
      }
      for (; j + W <= cols; j += W) probe = Vec::fmadd(Vec::load(row + j), zero, probe);
      if (j < cols)
        probe = Vec::fmadd(Vec::load_partial(row + j, static_cast<int>(cols - j)), zero, probe);
    }
    probe = Vec::add(Vec::add(probe, p1), Vec::add(p2, p3));
    return Vec::reduce_add(probe) == T(0);
  }

  static int block_state(const T* x, int64_t ld, int64_t rows, int64_t cols) {
    constexpr uint32_t kAllLanes = (uint32_t(1) << W) - 1;
    const V zero = Vec::zero(), closed = Vec::set1(kNegInf);
    // Lanes past a row's end count as both; a row is checked whole, so that
    // the loop holds no branch but the row's.
    const int tail = static_cast<int>(cols % W);
    const uint32_t past_end = tail ? kAllLanes & ~((uint32_t(1) << tail) - 1) : 0;
    uint32_t all_zero = kAllLanes, all_closed = kAllLanes;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * ld;
      int64_t c = 0;
      for (; c + W <= cols; c += W) {
        const V v = Vec::load(row + c);
        all_zero &= Vec::equal_lanes(v, zero);
        all_closed &= Vec::equal_lanes(v, closed);
      }
      if (tail) {
        const V v = Vec::load_partial(row + c, tail);
        all_zero &= Vec::equal_lanes(v, zero) | past_end;
        all_closed &= Vec::equal_lanes(v, closed) | past_end;
      }
      if (all_zero != kAllLanes && all_closed != kAllLanes) return 0;
    }
    return (all_zero == kAllLanes ? kBlockAllZero : 0) |
           (all_closed == kAllLanes ? kBlockAllClosed : 0);
  }

  // ---- widening of 16-bit storage (float vectors only) -------------------
  // dst[i] = src[i] widened to float, W at a time; the tail by a partial load
  // and store, so nothing past src[n-1] is read or past dst[n-1] written.
  template <bool kBfloat16>
  static void widen(const uint16_t* src, int64_t n, T* dst) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      if constexpr (kBfloat16)
        Vec::store(dst + i, Vec::load_widen_bf16(src + i));
      else
        Vec::store(dst + i, Vec::load_widen_f16(src + i));
    }
    if (i < n) {
      const int len = static_cast<int>(n - i);
      if constexpr (kBfloat16)
        Vec::store_partial(dst + i, Vec::load_widen_bf16_partial(src + i, len), len);
      else
        Vec::store_partial(dst + i, Vec::load_widen_f16_partial(src + i, len), len);
    }
  }
  // dst[i] = scale * src[i] for int8 rows (their dequantized values).
  static void widen_int8(const int8_t* src, int64_t n, T scale, T* dst) {
    const V s = Vec::set1(scale);
    int64_t i = 0;
    for (; i + W <= n; i += W) Vec::store(dst + i, Vec::mul(s, Vec::load_widen_i8(src + i)));
    if (i < n) {
      const int len = static_cast<int>(n - i);
      Vec::store_partial(dst + i, Vec::mul(s, Vec::load_widen_i8_partial(src + i, len)), len);
    }
  }
  static void widen_float16(const uint16_t* src, int64_t n, float* dst) {
    widen<false>(src, n, dst);
  }
  static void widen_bfloat16(const uint16_t* src, int64_t n, float* dst) {
    widen<true>(src, n, dst);
  }
};

}  // namespace
}  // namespace attnx::simd
