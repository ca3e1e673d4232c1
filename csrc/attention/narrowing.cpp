// Narrowing to float16 / bfloat16 storage: the rules are in narrowing.h.
//
// Each value is converted by integer arithmetic on its bits. Every case (NaN, overflow,
// normal, subnormal) is computed and the right one selected, without branches, so that the
// loops stay simple for the compiler.
#include "attention/narrowing.h"

#include "kernels/int8_quantize.h"
#include "kernels/int8_table.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <cstring>

namespace attnx {
namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Binary16 bits of the float32 with bits f.
inline uint16_t float16_of_bits(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7fffffffu;  // |x|
  // NaN: the significand's top 10 bits, never all zero.
  const uint32_t payload = (a >> 13) & 0x3ffu;
  const uint32_t nan = 0x7c00u | payload | static_cast<uint32_t>(payload == 0);
  // Normal half (|x| >= 2^-14): drop 13 bits, rounding to nearest even (a carry into the
  // exponent is the right result), and rebias the exponent from 127 to 15.
  const uint32_t normal = ((a + 0x0fffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
  // Subnormal half (|x| < 2^-14): the significand, implicit bit included, in units of 2^-24,
  // is m * 2^(e - 150 + 24) = m >> (126 - e); the shift clamped to [14, 31] keeps it
  // defined for every exponent (from 31 up the result is 0, as it must be below 2^-25).
  const int32_t e = static_cast<int32_t>(a >> 23);
  int32_t shift = 126 - e;
  shift = shift < 14 ? 14 : shift;
  shift = shift > 31 ? 31 : shift;
  const uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const uint32_t subnormal =
      (m + ((1u << (shift - 1)) - 1u) + ((m >> shift) & 1u)) >> shift;
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a >= 0x477ff000u ? 0x7c00u : h;  // from half-way above 65504 (inf included): inf
  h = a > 0x7f800000u ? nan : h;
  return static_cast<uint16_t>(sign | h);
}

// Binary16 bits of the float64 with bits d, rounded once.
inline uint16_t float16_of_bits(uint64_t d) {
  const uint32_t sign = static_cast<uint32_t>(d >> 48) & 0x8000u;
  const uint64_t a = d & 0x7fffffffffffffffull;
  const uint32_t payload = static_cast<uint32_t>(a >> 42) & 0x3ffu;
  const uint32_t nan = 0x7c00u | payload | static_cast<uint32_t>(payload == 0);
  // Normal half: drop 42 bits, rebias the exponent from 1023 to 15.
  const uint32_t normal = static_cast<uint32_t>(
      ((a + 0x1ffffffffffull + ((a >> 42) & 1u)) >> 42) - (1008ull << 10));
  // Subnormal half: m * 2^(e - 1075 + 24) = m >> (1051 - e), the shift clamped to [43, 63].
  const int32_t e = static_cast<int32_t>(a >> 52);
  int32_t shift = 1051 - e;
  shift = shift < 43 ? 43 : shift;
  shift = shift > 63 ? 63 : shift;
  const uint64_t m = (a & 0x000fffffffffffffull) | 0x0010000000000000ull;
  const uint32_t subnormal = static_cast<uint32_t>(
      (m + ((1ull << (shift - 1)) - 1u) + ((m >> shift) & 1u)) >> shift);
  uint32_t h = a < 0x3f10000000000000ull ? subnormal : normal;
  h = a >= 0x40effe0000000000ull ? 0x7c00u : h;
  h = a > 0x7ff0000000000000ull ? nan : h;
  return static_cast<uint16_t>(sign | h);
}

// Bfloat16 bits of the float32 with bits f.
inline uint16_t bfloat16_of_bits(uint32_t f) {
  const uint32_t rounded = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
  const uint32_t nan = ((f >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<uint16_t>((f & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace

void narrow_to_float16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float16_of_bits(bits_of(src[i]));
}

void narrow_to_float16(const double* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float16_of_bits(bits_of(src[i]));
}

void narrow_to_bfloat16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16_of_bits(bits_of(src[i]));
}

void narrow_to_bfloat16(const double* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i)
    dst[i] = bfloat16_of_bits(bits_of(static_cast<float>(src[i])));
}

// float32 rows on the active int8 table's vectors where it has them (the
// same bits as the plain loops); float64 ones in the plain loops, each value
// rounded to float32.
float quantize_int8(const float* src, int64_t n, int8_t* dst) {
  const auto vectors = active_int8_kernels().quantize;
  return vectors ? vectors(src, n, dst) : quantize_int8_plain(src, n, dst);
}
float quantize_int8(const double* src, int64_t n, int8_t* dst) {
  return quantize_int8_plain(src, n, dst);
}

}  // namespace attnx
