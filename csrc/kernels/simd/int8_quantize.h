// quantize_int8 on AVX2 and AVX-512 vectors (Int8KernelTable::quantize): the
// largest magnitude's bits by an unsigned integer maximum, then x / scale
// rounded and clipped lane by lane, in kernels/int8_quantize.h's float32
// steps (a division, not a multiplication by 1 / scale): the plain loops'
// bits. The query rows of every step with int8 products, and every row
// appended to an int8 cache, go through here. Included by the files of the
// levels that run them (compiled with their flags).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/int8_quantize.h"

namespace attnx::simd {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512Int8Quantize {
  static float quantize(const float* src, int64_t n, int8_t* dst) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i top = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_loadu_si512(src + i), magnitude));
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, src + i), magnitude));
    }
    const float scale = int8_scale_of(static_cast<uint32_t>(_mm512_reduce_max_epu32(top)));
    if (!(scale > 0)) {  // zeros, NaN
      for (int64_t j = 0; j < n; ++j) dst[j] = 0;
      return scale;
    }
    const __m512 s = _mm512_set1_ps(scale), shift = _mm512_set1_ps(kInt8RoundingShift);
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 q = _mm512_sub_ps(_mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(src + i), s), shift), shift);
      const __m512i levels = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, q)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtsepi32_epi8(levels));
    }
    for (; i < n; ++i) dst[i] = int8_level(src[i], scale);
    return scale;
  }
};
#endif

#if defined(__AVX2__)
struct Avx2Int8Quantize {
  static float quantize(const float* src, int64_t n, int8_t* dst) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    __m256i top = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      top = _mm256_max_epu32(
          top, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), magnitude));
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
    uint32_t top_bits = 0;
    for (uint32_t lane : lanes) top_bits = lane > top_bits ? lane : top_bits;
    for (; i < n; ++i) {
      const uint32_t m = int8_magnitude_bits(src[i]);
      top_bits = m > top_bits ? m : top_bits;
    }
    const float scale = int8_scale_of(top_bits);
    if (!(scale > 0)) {  // zeros, NaN
      for (int64_t j = 0; j < n; ++j) dst[j] = 0;
      return scale;
    }
    const __m256 s = _mm256_set1_ps(scale), shift = _mm256_set1_ps(kInt8RoundingShift);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 q = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(src + i), s), shift), shift);
      const __m256i levels = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, q)));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(levels),
                                            _mm256_extracti128_si256(levels, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(words, words));
    }
    for (; i < n; ++i) dst[i] = int8_level(src[i], scale);
    return scale;
  }
};
#endif

}  // namespace
}  // namespace attnx::simd
