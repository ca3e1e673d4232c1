// The row path's scores over a bfloat16 cache for precision "bfloat16" on
// the float route (Bf16Products::kFloat; kernels/bf16_table.h:
// scores_bf16_split). A 64-byte load holds 32 stored elements as 16 pairs;
// a shift left by 16 makes the even ones float32 and a mask the odd ones,
// two instructions for 32 elements where the float32 table's kernels take
// two for 16 (vpmovzxwd, vpslld). The query rows come split the same way
// (split_bf16_pairs), so each product is the one the default forms; only
// the order of the sums differs. Included by the AVX-512 level's file alone.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/bf16_table.h"
#include "kernels/simd/kernel_helpers.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx::simd {
namespace {

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

}  // namespace
}  // namespace attnx::simd
