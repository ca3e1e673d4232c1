// The row path's scores over a bfloat16 cache for precision "bfloat16" on
// the float route (Bf16Products::kFloat; kernels/bf16_table.h:
// scores_bf16_split). One load holds stored elements as pairs (32 in 64
// bytes on AVX-512, 16 in 32 on AVX2); a shift left by 16 makes the even
// ones float32 and a mask the odd ones: two instructions for a whole load,
// where the float32 table's kernels take two for half as many (vpmovzxwd,
// vpslld). The query rows come split the same way (split_bf16_pairs), so
// each product is the one those kernels form; only the order of the sums
// differs. Four query rows share each key's widening (AVX2's float32 row
// kernels take two rows at a time, and widen each key twice for four).
// Included by the AVX-512 and AVX2 levels' files, each building its own.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/bf16_table.h"
#include "kernels/simd/kernel_helpers.h"
#if defined(__AVX512F__)
#include "kernels/simd/vec_avx512.h"
#else
#include "kernels/simd/vec_avx2.h"
#endif

namespace attnx::simd {
namespace {

#if defined(__AVX512F__)
struct Avx512SplitBf16Rows {
  using V = __m512;

  // Query row r's products with a key's elements [i, i + 32) (a whole
  // chunk: even and odd halves) added to acc.
  static V chunk_products(V acc, __m512i key, const float* q) {
    const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), _mm512_castsi512_ps(_mm512_slli_epi32(key, 16)), acc);
    return _mm512_fmadd_ps(_mm512_loadu_ps(q + 16),
                           _mm512_castsi512_ps(_mm512_and_si512(key, odd_mask)), acc);
  }
  // The same for the elements [i, i + n) past the last whole chunk (n < 32),
  // which stay in order in both rows.
  static V tail_products(V acc, const uint16_t* k, const float* q, int n) {
    for (int h = 0; h < n; h += 16) {
      const int len = n - h < 16 ? n - h : 16;
      const V kv = Avx512F32::load_bf16_operand_partial(k + h, len);
      acc = _mm512_fmadd_ps(Avx512F32::load_partial(q + h, len), kv, acc);
    }
    return acc;
  }

  // Scores of R query rows, four keys at a time; the keys `ahead` rows on
  // asked for into L2 while rows up to `listed` are.
  template <int R>
  static void scores_group(const float* const* q, const uint16_t* const* k, int64_t n_keys,
                           int64_t listed, int64_t dim, float scale, float* const* dst,
                           int64_t ahead) {
    const int64_t whole = dim / 32 * 32;
    const int tail = static_cast<int>(dim - whole);
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      if (ahead && j + ahead + 4 <= listed)
        for (int u = 0; u < 4; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      const uint16_t* kr[4] = {k[j], k[j + 1], k[j + 2], k[j + 3]};
      V acc[4][4];  // R rows (four for reduce_add4x4's type)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
      for (int64_t i = 0; i < whole; i += 32) {
        __m512i kv[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) kv[u] = _mm512_loadu_si512(kr[u] + i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = chunk_products(acc[r][u], kv[u], q[r] + i);
      }
      if (tail)
        for (int r = 0; r < R; ++r)
          for (int u = 0; u < 4; ++u)
            acc[r][u] = tail_products(acc[r][u], kr[u] + whole, q[r] + whole, tail);
      Avx512F32::store_four_keys<R>(acc, scale, dst, j);
    }
    for (; j < n_keys; ++j) {
      for (int r = 0; r < R; ++r) {
        V acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < whole; i += 32)
          acc = chunk_products(acc, _mm512_loadu_si512(k[j] + i), q[r] + i);
        if (tail) acc = tail_products(acc, k[j] + whole, q[r] + whole, tail);
        dst[r][j] = scale * _mm512_reduce_add_ps(acc);
      }
    }
  }

  static void scores(const float* const* q, int rows, const uint16_t* const* k, int64_t n_keys,
                     int64_t listed, int64_t dim, float scale, float* const* dst) {
    const int64_t ahead = prefetch_distance<uint16_t>(true, dim);
    in_row_groups_of_four(rows, ahead, [&](int r0, int count, int64_t a) {
      if (count == 4)
        scores_group<4>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
      else
        scores_group<1>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
    });
  }
};

#else
struct Avx2SplitBf16Rows {
  using V = __m256;

  // The products of a query row with 16 elements of a key (8 pairs) added
  // to acc: q points at the split row's 8 even ones, its odd ones 16 on
  // (the split layout's 32-element chunks, a half at a time).
  static V half_chunk_products(V acc, __m256i key, const float* q) {
    const __m256i odd_mask = _mm256_set1_epi32(int(0xFFFF0000u));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q), _mm256_castsi256_ps(_mm256_slli_epi32(key, 16)), acc);
    return _mm256_fmadd_ps(_mm256_loadu_ps(q + 16),
                           _mm256_castsi256_ps(_mm256_and_si256(key, odd_mask)), acc);
  }
  // The elements past the last whole chunk (n < 32), in order in both rows.
  static V tail_products(V acc, const uint16_t* k, const float* q, int n) {
    for (int h = 0; h < n; h += 8) {
      const int len = n - h < 8 ? n - h : 8;
      const V kv = Avx2F32::load_bf16_operand_partial(k + h, len);
      acc = _mm256_fmadd_ps(Avx2F32::load_partial(q + h, len), kv, acc);
    }
    return acc;
  }
  // Lane i: the sum of the lanes of the i-th of a, b, c, d.
  static __m128 sums4(V a, V b, V c, V d) {
    const V h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }

  // Scores of R query rows, K keys at a time: four rows two keys at a time,
  // or one row four (accumulators and widened keys in 16 registers).
  template <int R, int K>
  static void scores_group(const float* const* q, const uint16_t* const* k, int64_t n_keys,
                           int64_t listed, int64_t dim, float scale, float* const* dst,
                           int64_t ahead) {
    static_assert(R * K == 8 || R * K == 4);
    const int64_t whole = dim / 32 * 32;
    const int tail = static_cast<int>(dim - whole);
    int64_t j = 0;
    for (; j + K <= n_keys; j += K) {
      if (ahead && j + ahead + K <= listed)
        for (int u = 0; u < K; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      const uint16_t* kr[K];
      for (int u = 0; u < K; ++u) kr[u] = k[j + u];
      V acc[R][K];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < K; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t i = 0; i < whole; i += 32)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i kv[K];
#pragma GCC unroll 4
          for (int u = 0; u < K; ++u)
            kv[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr[u] + i + 16 * h));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int u = 0; u < K; ++u)
              acc[r][u] = half_chunk_products(acc[r][u], kv[u], q[r] + i + 8 * h);
        }
      if (tail)
        for (int r = 0; r < R; ++r)
          for (int u = 0; u < K; ++u)
            acc[r][u] = tail_products(acc[r][u], kr[u] + whole, q[r] + whole, tail);
      const __m128 s = _mm_set1_ps(scale);
      if constexpr (R == 4) {  // acc[r][u] -> lane 2r + u of rows 0-1, then rows 2-3
        const __m128 lo = _mm_mul_ps(s, sums4(acc[0][0], acc[0][1], acc[1][0], acc[1][1]));
        const __m128 hi = _mm_mul_ps(s, sums4(acc[2][0], acc[2][1], acc[3][0], acc[3][1]));
        _mm_storel_pi(reinterpret_cast<__m64*>(dst[0] + j), lo);
        _mm_storeh_pi(reinterpret_cast<__m64*>(dst[1] + j), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(dst[2] + j), hi);
        _mm_storeh_pi(reinterpret_cast<__m64*>(dst[3] + j), hi);
      } else {
        _mm_storeu_ps(dst[0] + j, _mm_mul_ps(s, sums4(acc[0][0], acc[0][1], acc[0][2], acc[0][3])));
      }
    }
    for (; j < n_keys; ++j) {
      for (int r = 0; r < R; ++r) {
        V acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < whole; i += 32)
          for (int h = 0; h < 2; ++h)
            acc = half_chunk_products(
                acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + i + 16 * h)),
                q[r] + i + 8 * h);
        if (tail) acc = tail_products(acc, k[j] + whole, q[r] + whole, tail);
        dst[r][j] = scale * Avx2F32::reduce_add(acc);
      }
    }
  }

  static void scores(const float* const* q, int rows, const uint16_t* const* k, int64_t n_keys,
                     int64_t listed, int64_t dim, float scale, float* const* dst) {
    const int64_t ahead = prefetch_distance<uint16_t>(true, dim);
    in_row_groups_of_four(rows, ahead, [&](int r0, int count, int64_t a) {
      if (count == 4)
        scores_group<4, 2>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
      else
        scores_group<1, 4>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
    });
  }
};
#endif

}  // namespace
}  // namespace attnx::simd
