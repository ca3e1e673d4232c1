// Rounding of float32 to bfloat16 on the bits, as AVX512_BF16's vcvtneps2bf16
// rounds: to nearest, ties to even; a subnormal input becomes a zero of its
// sign (the instruction treats its input as DAZ); a NaN becomes a quiet NaN
// that keeps its sign and the top of its payload. Integer arithmetic only, so
// that no floating-point mode can change the bits. The vector types
// (vec_*.h) do the same lane by lane.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set.
namespace {

constexpr uint32_t kBf16AbsMask = 0x7fffffffu;    // all but the sign
constexpr uint32_t kBf16Infinity = 0x7f800000u;   // float32 +inf: above it, a NaN
constexpr uint32_t kBf16MinNormal = 0x00800000u;  // float32 2^-126: below it, 0 or subnormal
constexpr uint32_t kBf16Quiet = 0x00400000u;      // a float32 NaN's quiet bit
constexpr uint32_t kBf16High = 0xffff0000u;       // the bfloat16 half of a float32
constexpr uint32_t kBf16HalfUlp = 0x7fffu;        // half a bfloat16 ulp, less one

inline uint32_t bits_of_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// The float32 bits of the bfloat16 nearest the float32 `bits` (low half 0).
inline uint32_t round_bf16_bits(uint32_t bits) {
  const uint32_t magnitude = bits & kBf16AbsMask;
  if (magnitude > kBf16Infinity) return (bits | kBf16Quiet) & kBf16High;
  if (magnitude < kBf16MinNormal) return bits & ~kBf16AbsMask;
  // Ties to even: half an ulp, less one where the kept last bit is 0. An
  // infinity stays one; the largest values round up to one.
  return (bits + kBf16HalfUlp + ((bits >> 16) & 1u)) & kBf16High;
}

}  // namespace
}  // namespace attnx::simd
