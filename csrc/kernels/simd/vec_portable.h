// A portable "vector" of W plain values, so the same kernel templates build
// for any CPU. Each operation is an element-wise loop the compiler may
// vectorise for the baseline instruction set.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/simd/bf16_bits.h"
#include "kernels/simd/vec_gelu.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// The float32 bits of an IEEE binary16 value, exactly, in integer arithmetic
// (no floating-point mode such as flush-to-zero can change them). A NaN keeps
// its sign and payload and is made quiet, as x86's vcvtph2ps does.
inline uint32_t float16_to_float32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f)  // infinity or NaN
    return sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u);
  if (exponent != 0)  // normal: rebias 15 -> 127
    return sign | ((exponent + 112) << 23) | (mantissa << 13);
  if (mantissa == 0) return sign;  // +-0
  // Subnormal, mantissa * 2^-24: shift until the implicit bit (bit 10) is set;
  // each shift lowers the exponent from that of 2^-14 (biased 113) by one.
  uint32_t biased = 113;
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    --biased;
  }
  return sign | (biased << 23) | ((mantissa & 0x3ffu) << 13);
}

// The float32 bits of a bfloat16 value: its bits are the top half of the
// float's; a NaN is made quiet, as for float16.
inline uint32_t bfloat16_to_float32_bits(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  return (bits & 0x7fffffffu) > 0x7f800000u ? bits | 0x00400000u : bits;
}

inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename Scalar>
struct Portable {
  using T = Scalar;
  static constexpr int W = 8;
  static constexpr int kGemmRows = 4;
  static constexpr int kPairGemmRows = 4;  // the bfloat16 gemm's (bf16_kernels.h)
  static constexpr int kOneVectorRows = 4;
  // No column-major A tile (see ALayout): a portable tile is large code.
  static constexpr bool kColumnMajorTile = false;
  // The wide tile is the gemm's: a tile of 2 rows x 4 vectors ran no faster
  // and doubled the gemm code of the wheel (measurements: docs/tuning.md).
  static constexpr int kWideRows = 4, kWideVectors = 2;
  static constexpr int kQueryTileVectors = 2;  // 16 queries per flash tile
  static constexpr int kRowGroup = 2;  // query rows the row kernels take at once
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
  static void hold(V&) {}  // nothing to hold (see hold_register.h)
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
  // Loads of W (or the first n, zeros above) 16-bit floats widened to T; for
  // the float vectors only (kWidens16).
  static constexpr bool kWidens16 = sizeof(T) == sizeof(float);
  static V load_widen_f16(const uint16_t* p) { return load_widen_f16_partial(p, W); }
  static V load_widen_f16_partial(const uint16_t* p, int n) {
    return map([p, n](int i) {
      return i < n ? float_from_bits(float16_to_float32_bits(p[i])) : T(0);
    });
  }
  static V load_widen_bf16(const uint16_t* p) { return load_widen_bf16_partial(p, W); }
  static V load_widen_bf16_partial(const uint16_t* p, int n) {
    return map([p, n](int i) {
      return i < n ? float_from_bits(bfloat16_to_float32_bits(p[i])) : T(0);
    });
  }
  // bfloat16 values as the operands of products (Avx512F32's): widened.
  static V load_bf16_operand(const uint16_t* p) { return load_widen_bf16(p); }
  static V load_bf16_operand_partial(const uint16_t* p, int n) {
    return load_widen_bf16_partial(p, n);
  }
  // Pairs of bfloat16, as Avx512F32's (float vectors only): the lanes carry
  // the bits, copied whole.
  static uint32_t bits_of(T x) { return bits_of_float(x); }
  template <typename F>
  static V map_bits(F f) {
    return map([&](int i) { return float_from_bits(f(i)); });
  }
  static V load_pairs(const uint32_t* p) { return load_pairs_partial(p, W); }
  static V load_pairs_partial(const uint32_t* p, int n) {
    return map_bits([p, n](int i) { return i < n ? p[i] : 0u; });
  }
  static void store_pairs(uint32_t* p, V v) { store_pairs_partial(p, v, W); }
  static void store_pairs_partial(uint32_t* p, V v, int n) {
    for (int i = 0; i < n; ++i) p[i] = bits_of(v.lane[i]);
  }
  static V set1_pair(uint32_t x) {
    return map_bits([x](int) { return x; });
  }
  static V pair_high(V x) {
    return map_bits([&](int i) { return bits_of(x.lane[i]) & kBf16High; });
  }
  static V pair_low(V x) {
    return map_bits([&](int i) { return bits_of(x.lane[i]) << 16; });
  }
  static V make_pairs(V lo, V hi) {
    return map_bits([&](int i) { return bits_of(lo.lane[i]) >> 16 | bits_of(hi.lane[i]); });
  }
  static V round_bf16(V x) {
    return map_bits([&](int i) { return round_bf16_bits(bits_of(x.lane[i])); });
  }
  // The pairs of 2W consecutive rounded values, x0's W then x1's.
  static V adjacent_pairs(V x0, V x1) {
    return map_bits([&](int i) {
      const V& x = 2 * i < W ? x0 : x1;
      const int j = 2 * i % W;
      return bits_of(x.lane[j]) >> 16 | (bits_of(x.lane[j + 1]) & kBf16High);
    });
  }
  static void store_bf16(uint16_t* p, V rounded) { store_bf16_partial(p, rounded, W); }
  static void store_bf16_partial(uint16_t* p, V rounded, int n) {
    for (int i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(bits_of(rounded.lane[i]) >> 16);
  }
  // W (or the first n, zeros above) int8 values as T, exactly.
  static V load_widen_i8(const int8_t* p) { return load_widen_i8_partial(p, W); }
  static V load_widen_i8_partial(const int8_t* p, int n) {
    return map([p, n](int i) { return i < n ? T(p[i]) : T(0); });
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
  static void reduce_add4(V a, V b, V c, V d, T* out) {
    out[0] = reduce_add(a), out[1] = reduce_add(b), out[2] = reduce_add(c), out[3] = reduce_add(d);
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
  // s + m, or -inf where m is -inf (a closed key: whatever s holds).
  static V add_unless_closed(V s, V m) {
    return map([&](int i) {
      return m.lane[i] == -std::numeric_limits<T>::infinity() ? m.lane[i] : s.lane[i] + m.lane[i];
    });
  }
  // Bit i set where lane i of x equals lane i of c (never for a NaN).
  static uint32_t equal_lanes(V x, V c) {
    uint32_t bits = 0;
    for (int i = 0; i < W; ++i) bits |= static_cast<uint32_t>(x.lane[i] == c.lane[i]) << i;
    return bits;
  }
  // 1 in the lanes where m is -inf, else 0.
  static V closed_indicator(V m) {
    return map([&](int i) { return m.lane[i] == -std::numeric_limits<T>::infinity() ? T(1) : T(0); });
  }
  static V exp(V x) {
    return map([&](int i) { return std::exp(x.lane[i]); });
  }
  static V exp2(V x) {
    return map([&](int i) { return std::exp2(x.lane[i]); });
  }
  static V exp2_nonpositive(V x) { return exp2(x); }
  // c tanh(x)
  static V tanh_times(V x, T c) {
    return map([&](int i) { return c * std::tanh(x.lane[i]); });
  }
  // max(x, 0); NaN stays NaN
  static V relu(V x) {
    return map([&](int i) { return x.lane[i] < T(0) ? T(0) : x.lane[i]; });
  }
  // x Phi(x)
  static V gelu(V x) {
    return map([&](int i) { return scalar_gelu(x.lane[i]); });
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
