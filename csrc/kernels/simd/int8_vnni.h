// The int8 products (kernels/int8_table.h) on AVX512_VNNI: vpdpbusd sums
// four products of unsigned and signed bytes into each int32 lane. The same
// bits as the plain loops of int8_kernels.h: exact integer sums, the same
// float32 steps around them. Included by the avx512_bf16 level's file alone
// (compiled with -mavx512vnni).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/simd/int8_kernels.h"

namespace attnx::simd {
namespace {

struct Avx512VnniInt8Kernels {
  // The first n < 64 bytes of p (all 64 for n >= 64), zeros after.
  static __mmask64 bytes_mask(int64_t n) { return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1; }
  static __m512i load_bytes(const int8_t* p, __mmask64 mask) {
    return _mm512_maskz_loadu_epi8(mask, p);
  }

  // The first n lanes of 16 (none for n <= 0).
  static __mmask16 lanes_mask(int64_t n) {
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
  }

  // Per 128-bit lane L: [sum of a0's lane L, a1's, a2's, a3's].
  static __m512i lane_sums4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  }
  // [sum a0, sum a1, sum a2, sum a3] of four vectors' int32 lanes.
  static __m128i sum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i u = lane_sums4(a0, a1, a2, a3);
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }
  // sum4 of four rows' four vectors at once: 128-bit lane r holds row r's.
  static __m512i sum4x4(const __m512i (&a)[4][4]) {
    const __m512i u0 = lane_sums4(a[0][0], a[0][1], a[0][2], a[0][3]);
    const __m512i u1 = lane_sums4(a[1][0], a[1][1], a[1][2], a[1][3]);
    const __m512i u2 = lane_sums4(a[2][0], a[2][1], a[2][2], a[2][3]);
    const __m512i u3 = lane_sums4(a[3][0], a[3][1], a[3][2], a[3][3]);
    const __m512i w01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, 0x44), _mm512_shuffle_i32x4(u0, u1, 0xEE));
    const __m512i w23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u2, u3, 0x44), _mm512_shuffle_i32x4(u2, u3, 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(w01, w23, 0x88), _mm512_shuffle_i32x4(w01, w23, 0xDD));
  }

  // What a query row's sum loses where the keys go in as k + 128 (below):
  // 128 * sum_i q[i].
  static int32_t key_bias_offset(const int8_t* q, int64_t dim) {
    int32_t sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += q[i];
    return 128 * sum;
  }
  // Four rows' values by 128-bit lane: lane r holds v[r] (sum4x4's order).
  static __m512i by_lane(const int32_t* v) {
    return _mm512_set_epi32(v[3], v[3], v[3], v[3], v[2], v[2], v[2], v[2], v[1], v[1], v[1], v[1],
                            v[0], v[0], v[0], v[0]);
  }
  static __m512 by_lane(const float* v) {
    return _mm512_set_ps(v[3], v[3], v[3], v[3], v[2], v[2], v[2], v[2], v[1], v[1], v[1], v[1],
                         v[0], v[0], v[0], v[0]);
  }
  // dst[r][j..j + 3] from four rows' sums of keys j..j + 3, 128-bit lane r
  // holding row r's: (q scale * k scale) * float(sum - offset).
  static void store_four_rows(__m512i sums, __m512i offsets, __m512 row_scales,
                              const float* k_scales, float* const* dst, int64_t j) {
    const __m512 factor = _mm512_mul_ps(row_scales, _mm512_broadcast_f32x4(_mm_loadu_ps(k_scales + j)));
    const __m512 s4 = _mm512_mul_ps(factor, _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offsets)));
    _mm_storeu_ps(dst[0] + j, _mm512_castps512_ps128(s4));
    _mm_storeu_ps(dst[1] + j, _mm512_extractf32x4_ps(s4, 1));
    _mm_storeu_ps(dst[2] + j, _mm512_extractf32x4_ps(s4, 2));
    _mm_storeu_ps(dst[3] + j, _mm512_extractf32x4_ps(s4, 3));
  }

  // Scores of R query rows, four keys at a time. vpdpbusd multiplies
  // unsigned bytes by signed ones: the keys go in as k + 128 (unsigned), and
  // each row's sum loses 128 * sum_i q_i again. C: the 64-byte chunks of a
  // row where dim is 64 C (the loads whole, the loop unrolled), else 0.
  template <int R, int C>
  static void scores_group(const int8_t* const* q, const float* q_scales, const int8_t* const* k,
                           const float* k_scales, int64_t n_keys, int64_t listed, int64_t dim,
                           float* const* dst, int64_t ahead) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    int32_t offset[R];
    for (int r = 0; r < R; ++r) offset[r] = key_bias_offset(q[r], dim);
    const int64_t chunks = C ? C : (dim + 63) / 64;
    // Four rows: their offsets and scales by 128-bit lane (sum4x4's order).
    __m512i offsets = _mm512_setzero_si512();
    __m512 row_scales = _mm512_setzero_ps();
    if constexpr (R == 4) offsets = by_lane(offset), row_scales = by_lane(q_scales);
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      if (ahead && j + ahead + 4 <= listed)
        for (int u = 0; u < 4; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      const int8_t* kr[4] = {k[j], k[j + 1], k[j + 2], k[j + 3]};
      __m512i acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask64 mask = C ? ~__mmask64(0) : bytes_mask(dim - 64 * c);
        __m512i ku[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          ku[u] = _mm512_xor_si512(C ? _mm512_loadu_si512(kr[u] + 64 * c)
                                     : load_bytes(kr[u] + 64 * c, mask),
                                   bias);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512i qv = C ? _mm512_loadu_si512(q[r] + 64 * c) : load_bytes(q[r] + 64 * c, mask);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], ku[u], qv);
        }
      }
      if constexpr (R == 4) {
        store_four_rows(sum4x4(acc), offsets, row_scales, k_scales, dst, j);
        continue;
      }
      const __m128 ks = _mm_loadu_ps(k_scales + j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m128i sums = _mm_sub_epi32(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]),
                                           _mm_set1_epi32(offset[r]));
        const __m128 factor = _mm_mul_ps(_mm_set1_ps(q_scales[r]), ks);
        _mm_storeu_ps(dst[r] + j, _mm_mul_ps(factor, _mm_cvtepi32_ps(sums)));
      }
    }
    for (; j < n_keys; ++j) {
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      for (int64_t i = 0; i < dim; i += 64) {
        const __mmask64 mask = bytes_mask(dim - i);
        const __m512i ku = _mm512_xor_si512(load_bytes(k[j] + i, mask), bias);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_dpbusd_epi32(acc[r], ku, load_bytes(q[r] + i, mask));
      }
      for (int r = 0; r < R; ++r) {
        const int32_t sum = _mm512_reduce_add_epi32(acc[r]) - offset[r];
        dst[r][j] = (q_scales[r] * k_scales[j]) * static_cast<float>(sum);
      }
    }
  }

  // Four rows' scores at a head dim of 128, four keys at a time, with fewer
  // shuffles than scores_group<4, 2>'s sum4x4 and the same sums: the rows'
  // bytes are rotated across the 128-bit lanes of four query operands (in
  // operand t, lane group g holds row (g + t) % 4's bytes of that group), so
  // that a key's four accumulators, each rotated back by its t, add up to one
  // vector whose group r holds row r's partial sums. One shuffle in place of
  // about two per key and row (measurements: docs/tuning.md).
  static void scores_four_rows_128(const int8_t* const* q, const float* q_scales,
                                   const int8_t* const* k, const float* k_scales, int64_t n_keys,
                                   int64_t listed, float* const* dst, int64_t ahead) {
    constexpr int64_t dim = 128;
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    int32_t offset[4];
    for (int r = 0; r < 4; ++r) offset[r] = key_bias_offset(q[r], dim);
    const __m512i offsets = by_lane(offset);
    const __m512 row_scales = by_lane(q_scales);
    __m512i rotated[2][4];
    for (int c = 0; c < 2; ++c)
      for (int t = 0; t < 4; ++t) {
        __m512i v = _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g)
          v = _mm512_mask_loadu_epi8(v, __mmask64(0xFFFF) << (16 * g), q[(g + t) % 4] + 64 * c);
        rotated[c][t] = v;
      }
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      if (ahead && j + ahead + 4 <= listed)
        for (int u = 0; u < 4; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      __m512i acc[4][4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) acc[u][t] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const __m512i ku = _mm512_xor_si512(_mm512_loadu_si512(k[j + u] + 64 * c), bias);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) acc[u][t] = _mm512_dpbusd_epi32(acc[u][t], ku, rotated[c][t]);
        }
      // Group g of operand t held row (g + t) % 4: lane group L takes group
      // L - t of it (shuffle immediates 0x93, 0x4E, 0x39 for t = 1, 2, 3).
      __m512i by_row[4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
        by_row[u] = _mm512_add_epi32(
            _mm512_add_epi32(acc[u][0], _mm512_shuffle_i32x4(acc[u][1], acc[u][1], 0x93)),
            _mm512_add_epi32(_mm512_shuffle_i32x4(acc[u][2], acc[u][2], 0x4E),
                             _mm512_shuffle_i32x4(acc[u][3], acc[u][3], 0x39)));
      // 128-bit lane r: row r's sums of keys j..j + 3.
      store_four_rows(lane_sums4(by_row[0], by_row[1], by_row[2], by_row[3]), offsets, row_scales,
                      k_scales, dst, j);
    }
    if (j == n_keys) return;
    // The last keys (fewer than four), row by row.
    for (int r = 0; r < 4; ++r) {
      float* tail = dst[r] + j;
      scores_group<1, 2>(q + r, q_scales + r, k + j, k_scales + j, n_keys - j, listed - j, dim,
                         &tail, 0);
    }
  }

  template <int R>
  static void scores_rows(const int8_t* const* q, const float* q_scales, const int8_t* const* k,
                          const float* k_scales, int64_t n_keys, int64_t listed, int64_t dim,
                          float* const* dst, int64_t ahead) {
    // Head dims of 128 (the common one) unrolled, the others in the loop.
    if (dim == 128) {
      if constexpr (R == 4)
        return scores_four_rows_128(q, q_scales, k, k_scales, n_keys, listed, dst, ahead);
      return scores_group<R, 2>(q, q_scales, k, k_scales, n_keys, listed, dim, dst, ahead);
    }
    scores_group<R, 0>(q, q_scales, k, k_scales, n_keys, listed, dim, dst, ahead);
  }

  static void scores(const int8_t* const* q, const float* q_scales, int rows,
                     const int8_t* const* k, const float* k_scales, int64_t n_keys,
                     int64_t listed, int64_t dim, float* const* dst) {
    int8_scores_in_row_groups<Avx512VnniInt8Kernels>(q, q_scales, rows, k, k_scales, n_keys,
                                                     listed, dim, dst);
  }

  // The quantized probabilities of a row (Int8Probabilities, in vectors):
  // levels[j] for j < n, zeros up to the next multiple of 4.
  static Int8Probabilities quantize(const float* p, const float* scales, int64_t n,
                                    uint8_t* levels) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = lanes_mask(n - j);
      const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), _mm512_maskz_loadu_ps(m, scales + j));
      nan |= _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
      top = _mm512_max_ps(w, top);  // the second operand where w is NaN
    }
    Int8Probabilities q;
    q.top = _mm512_reduce_max_ps(top);
    q.nan = nan != 0;
    q.set_inverse();
    const __m512 inv = _mm512_set1_ps(q.inv), top1 = _mm512_set1_ps(q.top);
    const __m512 k127 = _mm512_set1_ps(127.0f), zero = _mm512_setzero_ps();
    const int64_t padded = (n + 3) / 4 * 4;
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 m = lanes_mask(n - j);
      const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), _mm512_maskz_loadu_ps(m, scales + j));
      __m512 y = q.inv_finite ? _mm512_mul_ps(w, inv) : _mm512_mul_ps(_mm512_div_ps(w, top1), k127);
      y = _mm512_min_ps(_mm512_max_ps(y, zero), k127);  // max: 0 where y is NaN
      const __mmask16 keep = lanes_mask(padded - j);
      _mm_mask_storeu_epi8(levels + j, keep, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
    }
    return q;
  }

  // sums[r][t] += the products of rows r0..r3's bytes [d0, d0 + 64) with
  // their levels (keys j..j + 3 of levels[r]), interleaved as pv_chunk says.
  // Full: the chunk's 64 bytes are all in the rows, loaded without a mask
  // (masked loads from L3 took 1.13x the time of plain ones: docs/tuning.md).
  template <int R, bool Full>
  [[gnu::always_inline]] static inline void add_quad(__m512i (&sums)[R][4],
                                                     const uint8_t* const* levels, int64_t j,
                                                     const int8_t* r0, const int8_t* r1,
                                                     const int8_t* r2, const int8_t* r3,
                                                     int64_t d0, __mmask64 mask) {
    const auto load = [mask](const int8_t* at) {
      return Full ? _mm512_loadu_si512(at) : load_bytes(at, mask);
    };
    const __m512i v0 = load(r0 + d0), v1 = load(r1 + d0), v2 = load(r2 + d0), v3 = load(r3 + d0);
    const __m512i a = _mm512_unpacklo_epi8(v0, v1), b = _mm512_unpackhi_epi8(v0, v1);
    const __m512i c = _mm512_unpacklo_epi8(v2, v3), e = _mm512_unpackhi_epi8(v2, v3);
    const __m512i x0 = _mm512_unpacklo_epi16(a, c), x1 = _mm512_unpackhi_epi16(a, c);
    const __m512i x2 = _mm512_unpacklo_epi16(b, e), x3 = _mm512_unpackhi_epi16(b, e);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      __builtin_memcpy(&quad, levels[r] + j, 4);
      const __m512i pb = _mm512_set1_epi32(quad);
      sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], pb, x0);
      sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], pb, x1);
      sums[r][2] = _mm512_dpbusd_epi32(sums[r][2], pb, x2);
      sums[r][3] = _mm512_dpbusd_epi32(sums[r][3], pb, x3);
    }
  }

  // P.V of R rows over one chunk of 64 columns: four value rows' bytes
  // interleaved, so that each int32 lane takes one column's four products;
  // the lanes come out permuted (lane e of 128-bit lane L of sums[t] holds
  // column 16 L + 4 t + e) and are put back in order when added to acc.
  template <int R, bool Full>
  static void pv_chunk(const uint8_t* const* levels, const float* factors, const int8_t* const* v,
                       int64_t n_keys, int64_t d0, int64_t dim, float* const* acc,
                       int64_t ahead, int64_t listed) {
    const __mmask64 mask = bytes_mask(dim - d0);
    __m512i sums[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) sums[r][t] = _mm512_setzero_si512();
    int8_in_key_quads(v, n_keys, dim, ahead, listed,
                      [&](int64_t j, const int8_t* r0, const int8_t* r1, const int8_t* r2,
                          const int8_t* r3) {
                        add_quad<R, Full>(sums, levels, j, r0, r1, r2, r3, d0, mask);
                      });
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i lo01 = _mm512_shuffle_i32x4(sums[r][0], sums[r][1], 0x44);
      const __m512i lo23 = _mm512_shuffle_i32x4(sums[r][2], sums[r][3], 0x44);
      const __m512i hi01 = _mm512_shuffle_i32x4(sums[r][0], sums[r][1], 0xEE);
      const __m512i hi23 = _mm512_shuffle_i32x4(sums[r][2], sums[r][3], 0xEE);
      const __m512i cols[4] = {_mm512_shuffle_i32x4(lo01, lo23, 0x88), _mm512_shuffle_i32x4(lo01, lo23, 0xDD),
                               _mm512_shuffle_i32x4(hi01, hi23, 0x88), _mm512_shuffle_i32x4(hi01, hi23, 0xDD)};
      const __m512 factor = _mm512_set1_ps(factors[r]);
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const int64_t d = d0 + 16 * L;
        if (d >= dim) break;
        const __mmask16 m = lanes_mask(dim - d);
        float* out = acc[r] + d;
        _mm512_mask_storeu_ps(out, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(cols[L]), factor,
                                                      _mm512_maskz_loadu_ps(m, out)));
      }
    }
  }

  // pv_chunk, whole loads where the chunk's 64 columns all lie in the rows.
  template <int R>
  static void pv_any_chunk(const uint8_t* const* levels, const float* factors,
                           const int8_t* const* v, int64_t n_keys, int64_t d0, int64_t dim,
                           float* const* acc, int64_t ahead, int64_t listed) {
    if (dim - d0 >= 64)
      return pv_chunk<R, true>(levels, factors, v, n_keys, d0, dim, acc, ahead, listed);
    pv_chunk<R, false>(levels, factors, v, n_keys, d0, dim, acc, ahead, listed);
  }

  // Four rows at a time, the rest one by one (as scores).
  static void pv_rows(int count, const uint8_t* const* lv, const float* factors,
                      const int8_t* const* v, int64_t n_keys, int64_t d0, int64_t dim,
                      float* const* out, int64_t ask, int64_t listed) {
    if (count == 4) return pv_any_chunk<4>(lv, factors, v, n_keys, d0, dim, out, ask, listed);
    for (int r = 0; r < count; ++r)
      pv_any_chunk<1>(lv + r, factors + r, v, n_keys, d0, dim, out + r, r == 0 ? ask : 0, listed);
  }

  static void accumulate_pv(const float* const* p, int rows, const int8_t* const* v,
                            const float* v_scales, int64_t n_keys, int64_t listed, int64_t dim,
                            float* const* acc) {
    int8_accumulate_pv_in_row_groups<Avx512VnniInt8Kernels, 4, 64>(p, rows, v, v_scales, n_keys,
                                                                    listed, dim, acc);
  }

  static Int8KernelTable table(const char* name, Isa isa) {
    return Int8KernelTable{name, isa, &scores, &accumulate_pv, nullptr};
  }
};

}  // namespace
}  // namespace attnx::simd
