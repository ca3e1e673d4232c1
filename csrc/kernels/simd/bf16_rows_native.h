// The row path's bfloat16 products over a bfloat16 cache, read in place by
// AVX512_BF16's vdpbf16ps (kernels/bf16_table.h: scores_bf16_rows,
// accumulate_pv_bf16_rows): each instruction takes 32 stored elements as
// they lie, where the float32 kernels widen every element first. Included by
// the avx512_bf16 level's file alone (compiled with -mavx512bf16).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/simd/kernel_helpers.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx::simd {
namespace {

struct Avx512Bf16Rows {
  static __mmask32 elements_mask(int64_t n) {
    return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1;
  }
  static __mmask16 lanes_mask(int64_t n) {
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
  }
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  static int64_t rows_ahead(int64_t dim) { return prefetch_distance<uint16_t>(true, dim); }

  // Scores of R query rows (bfloat16), four keys at a time.
  template <int R>
  static void scores_group(const uint16_t* const* q, const uint16_t* const* k, int64_t n_keys,
                           int64_t listed, int64_t dim, float scale, float* const* dst,
                           int64_t ahead) {
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      if (ahead && j + ahead + 4 <= listed)
        for (int u = 0; u < 4; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      const uint16_t* kr[4] = {k[j], k[j + 1], k[j + 2], k[j + 3]};
      __m512 acc[4][4];  // R rows (four for reduce_add4x4's type)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
      for (int64_t c = 0; 32 * c < dim; ++c) {
        const __mmask32 mask = elements_mask(dim - 32 * c);
        __m512i kv[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          kv[u] = _mm512_maskz_loadu_epi16(mask, kr[u] + 32 * c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512i qv = _mm512_maskz_loadu_epi16(mask, q[r] + 32 * c);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = dot(acc[r][u], kv[u], qv);
        }
      }
      Avx512F32::store_four_keys<R>(acc, scale, dst, j);
    }
    for (; j < n_keys; ++j) {
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < dim; i += 32) {
        const __mmask32 mask = elements_mask(dim - i);
        const __m512i kv = _mm512_maskz_loadu_epi16(mask, k[j] + i);
        for (int r = 0; r < R; ++r) acc[r] = dot(acc[r], kv, _mm512_maskz_loadu_epi16(mask, q[r] + i));
      }
      for (int r = 0; r < R; ++r) dst[r][j] = scale * _mm512_reduce_add_ps(acc[r]);
    }
  }

  static void scores(const uint16_t* const* q, int rows, const uint16_t* const* k, int64_t n_keys,
                     int64_t listed, int64_t dim, float scale, float* const* dst) {
    const int64_t ahead = rows_ahead(dim);
    in_row_groups_of_four(rows, ahead, [&](int r0, int count, int64_t a) {
      if (count == 4)
        scores_group<4>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
      else
        scores_group<1>(q + r0, k, n_keys, listed, dim, scale, dst + r0, a);
    });
  }

  // The bfloat16 bits of p[j] and p[j + 1] (bfloat16 values as float32: their
  // top halves) as one pair, the first in the low half; 0 past n.
  static int32_t pair_of(const float* p, int64_t j, int64_t n) {
    uint32_t lo, hi = 0;
    __builtin_memcpy(&lo, p + j, 4);
    if (j + 1 < n) __builtin_memcpy(&hi, p + j + 1, 4);
    return static_cast<int32_t>((lo >> 16) | (hi & 0xFFFF0000u));
  }

  // acc[r][d0, d0 + 64) += P.V of R rows over two keys at a time: their value
  // rows interleaved, so that each lane takes one column's two products. The
  // lanes are permuted (lane e of 128-bit lane L of the vectors t of chunk c
  // hold column d0 + 32 c + 8 L + 4 t + e) as acc is loaded and put back in
  // order as it is stored.
  template <int R>
  static void pv_chunk(const float* const* p, const uint16_t* const* v, int64_t n_keys,
                       int64_t d0, int64_t dim, float* const* acc, int64_t ahead,
                       int64_t listed) {
    __m512 sums[R][2][2];
    __mmask32 masks[2];
    __mmask16 lanes[2][2];
    for (int c = 0; c < 2; ++c) {
      masks[c] = elements_mask(dim - d0 - 32 * c);
      lanes[c][0] = lanes_mask(dim - d0 - 32 * c);
      lanes[c][1] = lanes_mask(dim - d0 - 32 * c - 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        // Columns 0-15 and 16-31 of the chunk, into the permuted order.
        const __m512 lo = _mm512_maskz_loadu_ps(lanes[c][0], acc[r] + d0 + 32 * c);
        const __m512 hi = _mm512_maskz_loadu_ps(lanes[c][1], acc[r] + d0 + 32 * c + 16);
        // lo = [A0 A1 A2 A3] (four columns a block), hi = [B0 B1 B2 B3]:
        // t = 0 takes A0 A2 B0 B2, t = 1 A1 A3 B1 B3.
        sums[r][c][0] = _mm512_shuffle_f32x4(lo, hi, 0x88);
        sums[r][c][1] = _mm512_shuffle_f32x4(lo, hi, 0xDD);
      }
    for (int64_t j = 0; j < n_keys; j += 2) {
      if (ahead && j + ahead + 2 <= listed)
        for (int u = 0; u < 2; ++u) prefetch_rows(v[j + ahead + u], 0, 1, dim);
      const uint16_t* r0 = v[j];
      const uint16_t* r1 = v[j + 1 < n_keys ? j + 1 : j];  // at probability 0
      int32_t pair[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) pair[r] = pair_of(p[r], j, n_keys);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const __m512i v0 = _mm512_maskz_loadu_epi16(masks[c], r0 + d0 + 32 * c);
        const __m512i v1 = _mm512_maskz_loadu_epi16(masks[c], r1 + d0 + 32 * c);
        const __m512i x0 = _mm512_unpacklo_epi16(v0, v1), x1 = _mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512i pb = _mm512_set1_epi32(pair[r]);
          sums[r][c][0] = dot(sums[r][c][0], pb, x0);
          sums[r][c][1] = dot(sums[r][c][1], pb, x1);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        // Back to columns 0-15 = [A0 A1 A2 A3] and 16-31 = [B0 B1 B2 B3].
        const __m512 t0 = sums[r][c][0], t1 = sums[r][c][1];
        const __m512 a = _mm512_shuffle_f32x4(t0, t1, 0x44);  // A0 A2 A1 A3
        const __m512 b = _mm512_shuffle_f32x4(t0, t1, 0xEE);  // B0 B2 B1 B3
        _mm512_mask_storeu_ps(acc[r] + d0 + 32 * c, lanes[c][0], _mm512_shuffle_f32x4(a, a, 0xD8));
        _mm512_mask_storeu_ps(acc[r] + d0 + 32 * c + 16, lanes[c][1], _mm512_shuffle_f32x4(b, b, 0xD8));
      }
  }

  static void pv_rows(int count, const float* const* p, const uint16_t* const* v, int64_t n_keys,
                      int64_t d0, int64_t dim, float* const* acc, int64_t ahead, int64_t listed) {
    if (count == 4) return pv_chunk<4>(p, v, n_keys, d0, dim, acc, ahead, listed);
    for (int r = 0; r < count; ++r)
      pv_chunk<1>(p + r, v, n_keys, d0, dim, acc + r, r == 0 ? ahead : 0, listed);
  }

  static void accumulate_pv(const float* const* p, int rows, const uint16_t* const* v,
                            int64_t n_keys, int64_t listed, int64_t dim, float* const* acc) {
    if (n_keys <= 0) return;
    const int64_t ahead = rows_ahead(dim);
    for (int r0 = 0; r0 < rows; r0 += 4) {
      const int count = rows - r0 < 4 ? rows - r0 : 4;
      // Only the first group streams the values; the others find them in cache.
      const int64_t a = r0 == 0 ? ahead : 0;
      for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t ask = d0 == 0 ? a : 0;
        pv_rows(count, p + r0, v, n_keys, d0, dim, acc + r0, ask, listed);
      }
    }
  }
};

}  // namespace
}  // namespace attnx::simd
