// quantize_int8's arithmetic (attention/narrowing.h states the contract), in
// the pieces that every implementation shares: the plain loops here, and the
// vector ones of the int8 tables (Int8KernelTable::quantize,
// simd/int8_quantize.h), which take the same float32 steps lane by lane:
// the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnx {
// Internal linkage: the kernels' files, built for other instruction sets,
// include this too, and no copy may be merged with another.
namespace {

// Bits of |x| (a float32): for floats without sign, the integers' order is
// the floats' (zero, subnormals, infinity), and every NaN lies above
// infinity, so the largest |x| of a row is the largest of these integers (a
// maximum that vectorizes, where one of floats must skip NaN).
inline uint32_t int8_magnitude_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u & 0x7fffffffu;
}

// A row's scale from the largest of its magnitudes' bits: max |x| / 127, or
// NaN where the row holds a NaN or an infinity.
inline float int8_scale_of(uint32_t top) {
  if (top >= 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  return amax / 127.0f;
}

// To nearest even by adding and taking away 1.5 * 2^23 (|x / scale| is at
// most 127 and a little): what nearbyint gives, in float32 steps that
// vectors take lane by lane.
constexpr float kInt8RoundingShift = 12582912.0f;
inline int8_t int8_level(float x, float scale) {
  const float q = (x / scale + kInt8RoundingShift) - kInt8RoundingShift;
  return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
}

// The whole row in plain loops; S is float or double (each value converted
// to float32 first).
template <typename S>
float quantize_int8_plain(const S* src, int64_t n, int8_t* dst) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, int8_magnitude_bits(static_cast<float>(src[i])));
  const float scale = int8_scale_of(top);
  if (!(scale > 0)) {  // zeros, NaN
    std::fill(dst, dst + n, int8_t(0));
    return scale;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = int8_level(static_cast<float>(src[i]), scale);
  return scale;
}

}  // namespace
}  // namespace attnx
