#include "attention/narrowing.h"

#include <cmath>
#include <cstring>

namespace attnx {
namespace {

uint16_t half_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return uint16_t(sign | 0x7c00u);
    uint32_t m = (abs & 0x007fffffu) >> 13;
    uint16_t r = uint16_t(0x7c00u + m);
    if (r == 0x7c00u) ++r;
    return uint16_t(sign | r);
  }
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    if (abs < 0x33000000u) return uint16_t(sign);
    const uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) ... bits dropped: 113 - e + 13
    const uint32_t drop = shift - 0 + 13 - 12;
    (void)drop;
    const uint32_t s = 125 - e + 1;  // total right shift = 126 - e
    uint32_t h = m >> (s);
    const uint32_t rem = m & ((1u << s) - 1);
    const uint32_t halfway = 1u << (s - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

uint16_t bfloat16_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) return uint16_t((x >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return uint16_t((x + rounding) >> 16);
}

}  // namespace

void narrow_to_float16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_of(src[i]);
}
void narrow_to_float16(const double* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_of(static_cast<float>(src[i]));
}
void narrow_to_bfloat16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16_of(src[i]);
}
void narrow_to_bfloat16(const double* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16_of(static_cast<float>(src[i]));
}

}  // namespace attnx
