// The int8 products (kernels/int8_table.h) on AVX2: vpmaddubsw multiplies
// unsigned bytes by signed ones and adds each pair of products into an
// int16 lane, vpmaddwd adds pairs of those into int32 lanes. The same bits as
// the plain loops of int8_kernels.h and as int8_vnni.h: exact integer sums,
// the same float32 steps around them. Included by the avx2 level's file
// alone (compiled with -mavx2 -mfma).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/simd/int8_kernels.h"

namespace attnx::simd {
namespace {

struct Avx2Int8Kernels {
  // Bytes [at, at + 32) of a row of n bytes, zeros past its end: a copy
  // where the row ends inside them, so that no load reads past the row.
  static __m256i load_chunk(const int8_t* row, int64_t at, int64_t n) {
    if (n - at >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + at));
    alignas(32) int8_t buf[32] = {};
    std::memcpy(buf, row + at, static_cast<size_t>(n - at));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }

  // acc's int32 lanes plus the products of q and k's 32 bytes, four a lane:
  // |k| (unsigned) times q with k's signs, in pairs, then pairs of pairs. A
  // pair is at most 2 * 127 * 128 in magnitude (q in [-127, 127], which
  // keeps its negation exact): no int16 lane saturates.
  static __m256i dot_add(__m256i acc, __m256i k, __m256i q, __m256i ones) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(q, k));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }

  // [sum a0, sum a1, sum a2, sum a3] of four vectors' int32 lanes.
  static __m128i sum4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }

  // The scores of R query rows against the K keys from k[0]: dst[r][at + u]
  // = (q_scales[r] * k_scales[u]) * float(sum). C: the 32-byte chunks of a
  // row where dim is 32 C (whole loads, the loop unrolled), else 0.
  template <int R, int K, int C>
  static void scores_tile(const int8_t* const* q, const float* q_scales, const int8_t* const* k,
                          const float* k_scales, int64_t dim, float* const* dst, int64_t at) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[R * K];
#pragma GCC unroll 8
    for (int i = 0; i < R * K; ++i) acc[i] = _mm256_setzero_si256();
    const int64_t chunks = C ? C : (dim + 31) / 32;
#pragma GCC unroll 4
    for (int64_t c = 0; c < chunks; ++c) {
      __m256i ku[K];
#pragma GCC unroll 4
      for (int u = 0; u < K; ++u)
        ku[u] = C ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[u] + 32 * c))
                  : load_chunk(k[u], 32 * c, dim);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i qv = C ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32 * c))
                             : load_chunk(q[r], 32 * c, dim);
#pragma GCC unroll 4
        for (int u = 0; u < K; ++u) acc[r * K + u] = dot_add(acc[r * K + u], ku[u], qv, ones);
      }
    }
    // The sums in (row, key) order, four at a time.
    constexpr int kSums = (R * K + 3) / 4 * 4;
    alignas(16) int32_t sums[kSums];
    const __m256i zero = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int i = 0; i < kSums; i += 4) {
      const auto part = [&](int n) { return n < R * K ? acc[n] : zero; };
      _mm_store_si128(reinterpret_cast<__m128i*>(sums + i),
                      sum4(part(i), part(i + 1), part(i + 2), part(i + 3)));
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < K; ++u)
        dst[r][at + u] = (q_scales[r] * k_scales[u]) * static_cast<float>(sums[r * K + u]);
  }

  // R rows against every key: K keys a step (the rows' sums in 8 registers
  // of 16), the last ones one by one.
  template <int R, int C>
  static void scores_all_keys(const int8_t* const* q, const float* q_scales,
                              const int8_t* const* k, const float* k_scales, int64_t n_keys,
                              int64_t listed, int64_t dim, float* const* dst, int64_t ahead) {
    constexpr int K = R >= 4 ? 2 : 4;
    int64_t j = 0;
    for (; j + K <= n_keys; j += K) {
      if (ahead && j + ahead + K <= listed)
        for (int u = 0; u < K; ++u) prefetch_rows(k[j + ahead + u], 0, 1, dim);
      scores_tile<R, K, C>(q, q_scales, k + j, k_scales + j, dim, dst, j);
    }
    for (; j < n_keys; ++j) scores_tile<R, 1, C>(q, q_scales, k + j, k_scales + j, dim, dst, j);
  }

  template <int R>
  static void scores_rows(const int8_t* const* q, const float* q_scales, const int8_t* const* k,
                          const float* k_scales, int64_t n_keys, int64_t listed, int64_t dim,
                          float* const* dst, int64_t ahead) {
    // Head dims of 128 (the common one) unrolled, the others in the loop.
    if (dim == 128)
      return scores_all_keys<R, 4>(q, q_scales, k, k_scales, n_keys, listed, dim, dst, ahead);
    scores_all_keys<R, 0>(q, q_scales, k, k_scales, n_keys, listed, dim, dst, ahead);
  }

  static void scores(const int8_t* const* q, const float* q_scales, int rows,
                     const int8_t* const* k, const float* k_scales, int64_t n_keys,
                     int64_t listed, int64_t dim, float* const* dst) {
    int8_scores_in_row_groups<Avx2Int8Kernels>(q, q_scales, rows, k, k_scales, n_keys, listed,
                                               dim, dst);
  }

  // The first n of 8 lanes (none for n <= 0), as a mask of int32 lanes.
  static __m256i lanes_mask(int64_t n) {
    const int m = n >= 8 ? 8 : n <= 0 ? 0 : static_cast<int>(n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }

  // The quantized probabilities of a row (Int8Probabilities, in vectors):
  // levels[j] for j < n, zeros up to the next multiple of 8.
  static Int8Probabilities quantize(const float* p, const float* scales, int64_t n,
                                    uint8_t* levels) {
    __m256 top = _mm256_setzero_ps();
    int nan = 0;
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i m = lanes_mask(n - j);
      const __m256 w =
          _mm256_mul_ps(_mm256_maskload_ps(p + j, m), _mm256_maskload_ps(scales + j, m));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
      top = _mm256_max_ps(w, top);  // the second operand where w is NaN
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    Int8Probabilities q;
    for (float lane : lanes) q.top = lane > q.top ? lane : q.top;
    q.nan = nan != 0;
    q.set_inverse();
    const __m256 inv = _mm256_set1_ps(q.inv), top1 = _mm256_set1_ps(q.top);
    const __m256 k127 = _mm256_set1_ps(127.0f), zero = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i m = lanes_mask(n - j);
      const __m256 w =
          _mm256_mul_ps(_mm256_maskload_ps(p + j, m), _mm256_maskload_ps(scales + j, m));
      __m256 y = q.inv_finite ? _mm256_mul_ps(w, inv) : _mm256_mul_ps(_mm256_div_ps(w, top1), k127);
      y = _mm256_min_ps(_mm256_max_ps(y, zero), k127);  // max: 0 where y is NaN
      const __m256i words = _mm256_cvtps_epi32(y);
      const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(words),
                                             _mm256_extracti128_si256(words, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(levels + j), _mm_packus_epi16(halves, halves));
    }
    return q;
  }

  // sums[r][t] += the products of value rows r0..r3's bytes [d0, d0 + 32)
  // with their levels (keys j..j + 3 of levels[r]), interleaved so that an
  // int32 lane takes one column's four products: lane e of 128-bit lane L
  // of sums[r][t] holds column d0 + 16 L + 4 t + e.
  template <int R, bool Full>
  [[gnu::always_inline]] static inline void add_quad(__m256i (&sums)[R][4],
                                                     const uint8_t* const* levels, int64_t j,
                                                     const int8_t* r0, const int8_t* r1,
                                                     const int8_t* r2, const int8_t* r3,
                                                     int64_t d0, int64_t dim, __m256i ones) {
    const auto load = [&](const int8_t* row) {
      return Full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d0))
                  : load_chunk(row, d0, dim);
    };
    const __m256i v0 = load(r0), v1 = load(r1), v2 = load(r2), v3 = load(r3);
    const __m256i a = _mm256_unpacklo_epi8(v0, v1), b = _mm256_unpackhi_epi8(v0, v1);
    const __m256i c = _mm256_unpacklo_epi8(v2, v3), e = _mm256_unpackhi_epi8(v2, v3);
    const __m256i x[4] = {_mm256_unpacklo_epi16(a, c), _mm256_unpackhi_epi16(a, c),
                          _mm256_unpacklo_epi16(b, e), _mm256_unpackhi_epi16(b, e)};
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, levels[r] + j, 4);
      // Levels in [0, 127] times values in [-128, 127]: a pair stays within int16.
      const __m256i pb = _mm256_set1_epi32(quad);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t)
        sums[r][t] = _mm256_add_epi32(sums[r][t],
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(pb, x[t]), ones));
    }
  }

  // P.V of R rows (their sums in 8 of the 16 registers) over one chunk of
  // 32 columns, four keys a step; the columns are put back in order when
  // added to acc.
  template <int R, bool Full>
  static void pv_chunk(const uint8_t* const* levels, const float* factors, const int8_t* const* v,
                       int64_t n_keys, int64_t d0, int64_t dim, float* const* acc,
                       int64_t ahead, int64_t listed) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[R][4];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) sums[r][t] = _mm256_setzero_si256();
    int8_in_key_quads(v, n_keys, dim, ahead, listed,
                      [&](int64_t j, const int8_t* r0, const int8_t* r1, const int8_t* r2,
                          const int8_t* r3) {
                        add_quad<R, Full>(sums, levels, j, r0, r1, r2, r3, d0, dim, ones);
                      });
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m256i cols[4] = {_mm256_permute2x128_si256(sums[r][0], sums[r][1], 0x20),
                               _mm256_permute2x128_si256(sums[r][2], sums[r][3], 0x20),
                               _mm256_permute2x128_si256(sums[r][0], sums[r][1], 0x31),
                               _mm256_permute2x128_si256(sums[r][2], sums[r][3], 0x31)};
      const __m256 factor = _mm256_set1_ps(factors[r]);
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const int64_t d = d0 + 8 * L;
        if (d >= dim) break;
        float* out = acc[r] + d;
        const __m256 terms = _mm256_cvtepi32_ps(cols[L]);
        if (dim - d >= 8) {
          _mm256_storeu_ps(out, _mm256_fmadd_ps(terms, factor, _mm256_loadu_ps(out)));
        } else {
          const __m256i m = lanes_mask(dim - d);
          _mm256_maskstore_ps(out, m, _mm256_fmadd_ps(terms, factor, _mm256_maskload_ps(out, m)));
        }
      }
    }
  }

  // Two rows at a time, or the last one alone; whole loads where the
  // chunk's 32 columns all lie in the rows.
  static void pv_rows(int count, const uint8_t* const* lv, const float* factors,
                      const int8_t* const* v, int64_t n_keys, int64_t d0, int64_t dim,
                      float* const* out, int64_t ask, int64_t listed) {
    const bool full = dim - d0 >= 32;
    if (count == 2) {
      if (full) return pv_chunk<2, true>(lv, factors, v, n_keys, d0, dim, out, ask, listed);
      return pv_chunk<2, false>(lv, factors, v, n_keys, d0, dim, out, ask, listed);
    }
    if (full) return pv_chunk<1, true>(lv, factors, v, n_keys, d0, dim, out, ask, listed);
    pv_chunk<1, false>(lv, factors, v, n_keys, d0, dim, out, ask, listed);
  }

  static void accumulate_pv(const float* const* p, int rows, const int8_t* const* v,
                            const float* v_scales, int64_t n_keys, int64_t listed, int64_t dim,
                            float* const* acc) {
    int8_accumulate_pv_in_row_groups<Avx2Int8Kernels, 2, 32>(p, rows, v, v_scales, n_keys, listed,
                                                             dim, acc);
  }

  static Int8KernelTable table(const char* name, Isa isa) {
    return Int8KernelTable{name, isa, &scores, &accumulate_pv, nullptr};
  }
};

}  // namespace
}  // namespace attnx::simd
