// AVX2 + FMA vectors of float (8 lanes) and double (4 lanes), for kernels
// compiled with -mavx2 -mfma -mf16c.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "kernels/simd/bf16_bits.h"
#include "kernels/simd/hold_register.h"
#include "kernels/simd/vec_exp.h"
#include "kernels/simd/vec_gelu.h"
#include "kernels/simd/vec_tanh.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

namespace avx2_detail {
// Lane masks for partial loads/stores: the first n lanes all-ones.
inline __m256i first_lanes32(int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
}
inline __m256i first_lanes64(int n) {
  const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), lane);
}
// The first n < 8 16-bit values at p, zeros above: AVX2 has no masked 16-bit
// load, so they are copied through a buffer (nothing past p[n-1] is read).
inline __m128i load_u16_partial(const uint16_t* p, int n) {
  alignas(16) uint16_t buf[8] = {};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}
// 8 bfloat16 values -> float: each becomes the top half of a float, and a NaN
// is made quiet (integer compare: no floating-point flag is raised).
inline __m256 widen_bf16(__m128i h) {
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, quiet));
}
}  // namespace avx2_detail

struct Avx2F32 {
  using T = float;
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kGemmRows = 6;  // 6 x 2 accumulators of 16 registers
  // Rows of the emulated bfloat16 gemm's tile (bf16_kernels.h): 4 x 2
  // accumulators, B's two vectors and their four halves, and A's two halves
  // fill the 16 registers; 6 rows spill (measurements: docs/tuning.md).
  static constexpr int kPairGemmRows = 4;
  static constexpr int kOneVectorRows = 6;  // rows of the one-vector tile
  static constexpr bool kColumnMajorTile = true;  // gemm tile for a_row == 1 (ALayout)
  // The wide tile too: 3 x 4 accumulators leave too few of the 16 registers
  // for the 4 vectors of B and the broadcast, and one accumulator spills.
  static constexpr int kWideRows = 6, kWideVectors = 2;
  // Queries per flash tile, in vectors: 32 queries. Against 16, the score
  // tile's rows (6 x 2-vector tiles) are reused by twice as many queries and
  // the P.V gemm's 32 rows split into 6-row tiles with less left over
  // (measurements: docs/tuning.md).
  static constexpr int kQueryTileVectors = 4;
  // Query rows the row kernels take at once: 2 rows x 4 keys of
  // accumulators and the 4 key vectors fit 16 registers (4 rows would not).
  static constexpr int kRowGroup = 2;

  static V zero() { return _mm256_setzero_ps(); }
  static void hold(V& v) { hold_in_register(v); }
  static V set1(T x) { return _mm256_set1_ps(x); }
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_partial(const T* p, int n) {
    return _mm256_maskload_ps(p, avx2_detail::first_lanes32(n));
  }
  static void store_partial(T* p, V v, int n) {
    _mm256_maskstore_ps(p, avx2_detail::first_lanes32(n), v);
  }
  // Loads of 8 (or the first n, zeros above) 16-bit floats widened to float;
  // float16 by F16C's vcvtph2ps, which is exact and makes a NaN quiet.
  static constexpr bool kWidens16 = true;
  static V load_widen_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_widen_f16_partial(const uint16_t* p, int n) {
    return _mm256_cvtph_ps(avx2_detail::load_u16_partial(p, n));
  }
  static V load_widen_bf16(const uint16_t* p) {
    return avx2_detail::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_widen_bf16_partial(const uint16_t* p, int n) {
    return avx2_detail::widen_bf16(avx2_detail::load_u16_partial(p, n));
  }
  // bfloat16 values as the operands of products, as Avx512F32's.
  static V load_bf16_operand(const uint16_t* p) {
    return bf16_bits_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_bf16_operand_partial(const uint16_t* p, int n) {
    return bf16_bits_to_float(avx2_detail::load_u16_partial(p, n));
  }
  static V bf16_bits_to_float(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Pairs of bfloat16, as Avx512F32's.
  static V load_pairs(const uint32_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static V load_pairs_partial(const uint32_t* p, int n) {
    return load_partial(reinterpret_cast<const float*>(p), n);
  }
  static void store_pairs(uint32_t* p, V v) { _mm256_storeu_ps(reinterpret_cast<float*>(p), v); }
  static void store_pairs_partial(uint32_t* p, V v, int n) {
    store_partial(reinterpret_cast<float*>(p), v, n);
  }
  static V set1_pair(uint32_t x) { return _mm256_castsi256_ps(_mm256_set1_epi32(int(x))); }
  static V pair_high(V x) {
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(int(kBf16High))));
  }
  static V pair_low(V x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(x), 16));
  }
  static V make_pairs(V lo, V hi) {
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                               _mm256_castps_si256(hi)));
  }
  // round_bf16_bits (bf16_bits.h) lane by lane. Where every lane is a
  // normal number or an infinity, as a rule, the rounding is the addition
  // alone (8 instructions with the test); else every lane takes the whole
  // rules (round_bf16_any: 14, out of line, so that the code that inlines
  // round_bf16 carries one copy of them).
  static V round_bf16(V x) {
    const __m256 magnitude =
        _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(int(kBf16AbsMask))));
    // Not >= the smallest normal number: a zero, a subnormal or a NaN.
    const __m256 special = _mm256_cmp_ps(
        magnitude, _mm256_castsi256_ps(_mm256_set1_epi32(int(kBf16MinNormal))), _CMP_NGE_UQ);
    if (__builtin_expect(!_mm256_testz_ps(special, special), 0)) return round_bf16_any(x);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r =
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(int(kBf16HalfUlp))), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(kBf16High))));
  }
  // The magnitudes are below 2^31: signed compares order them.
  [[gnu::noinline]] static V round_bf16_any(V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(int(kBf16AbsMask)));
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(int(kBf16Infinity)));
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(kBf16MinNormal)), magnitude);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(int(kBf16HalfUlp))), odd);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(int(kBf16Quiet))), nan);
    r = _mm256_and_si256(r, _mm256_set1_epi32(int(kBf16High)));
    const __m256i sign = _mm256_andnot_si256(_mm256_set1_epi32(int(kBf16AbsMask)), bits);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, sign, tiny));
  }
  // The pairs of 16 consecutive rounded values, x0's 8 then x1's: the high
  // halves packed to 16 bits (vpackusdw packs within 128-bit lanes, and
  // vpermq puts the lanes back in order).
  static V adjacent_pairs(V x0, V x1) {
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(x0), 16),
                                               _mm256_srli_epi32(_mm256_castps_si256(x1), 16));
    return _mm256_castsi256_ps(_mm256_permute4x64_epi64(packed, 0xd8));
  }
  // The bfloat16 halves of 8 rounded values, stored as 16-bit values.
  static __m128i bf16_halves(V rounded) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }
  static void store_bf16(uint16_t* p, V rounded) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_halves(rounded));
  }
  static void store_bf16_partial(uint16_t* p, V rounded, int n) {
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), bf16_halves(rounded));
    for (int i = 0; i < n; ++i) p[i] = buf[i];
  }
  // 8 (or the first n, zeros above) int8 values as floats, exactly:
  // vpmovsxbd then vcvtdq2ps (a partial row through a buffer: nothing past
  // p[n-1] is read).
  static V load_widen_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_widen_i8_partial(const int8_t* p, int n) {
    alignas(16) int8_t buf[16] = {};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return load_widen_i8(buf);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max_ignoring_nan(V running, V x) { return _mm256_max_ps(x, running); }
  static T reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[0..3] = the sums of a, b, c and d, reduced together (see Avx512F32).
  static void reduce_add4(V a, V b, V c, V d, T* out) {
    const V ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const V cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256d ab2 = _mm256_castps_pd(ab), cd2 = _mm256_castps_pd(cd);
    const V blocks = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab2, cd2)),
                                   _mm256_castpd_ps(_mm256_unpackhi_pd(ab2, cd2)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(blocks), _mm256_extractf128_ps(blocks, 1)));
  }
  static T reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V exp_shift(V m) {
    const V neg_inf = _mm256_cmp_ps(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_ps(m, zero(), neg_inf);
  }
  // s + m, or -inf where m is -inf (a closed key: whatever s holds).
  static V add_unless_closed(V s, V m) {
    const V closed = _mm256_cmp_ps(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_ps(_mm256_add_ps(s, m), m, closed);
  }
  // Bit i set where lane i of x equals lane i of c (never for a NaN).
  static uint32_t equal_lanes(V x, V c) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x, c, _CMP_EQ_OQ)));
  }
  // 1 in the lanes where m is -inf, else 0.
  static V closed_indicator(V m) {
    const V closed = _mm256_cmp_ps(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_and_ps(closed, set1(1.0f));
  }
  // The primitives of the exponentials (vec_exp.h).
  using Mask = V;  // all ones in the lanes where true
  static constexpr bool kZeroesByMask = false;
  static Mask not_less(V x, V c) { return _mm256_cmp_ps(x, c, _CMP_NLT_UQ); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round_nearest(V x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void split_nearest(V x, V& n, V& r) {
    n = round_nearest(x);
    r = _mm256_sub_ps(x, n);
  }
  // 2^n for an integral n in [-127, 127]; n = -127 gives the bits of +0.0.
  static V pow2(V n) {
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  }
  // p 2^n for an integral n in [-252, 254], as p 2^(n/2) 2^(n - n/2) from
  // exponent bits: both factors stay normal numbers, and the product rounds
  // once (and overflows to +inf like exp).
  static V scale(V p, V n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const V scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const V scale2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, scale1), scale2);
  }
  static V scale_where(Mask keep, V p, V n) { return _mm256_and_ps(scale(p, n), keep); }
  static V exp(V x) { return vector_exp<Avx2F32>(x); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V tanh_times(V y, T c) { return vector_tanh_times_f32<Avx2F32>(y, c); }
  static V gelu(V x) { return vector_gelu_f32<Avx2F32>(x); }
  // max(x, 0), a NaN passing through (max's second operand).
  static V relu(V x) { return max(zero(), x); }
  static V exp2(V x) { return vector_exp2<Avx2F32>(x); }
  static V exp2_nonpositive(V x) { return vector_exp2_nonpositive<Avx2F32>(x); }
  // In-register transpose of 8 rows of 8.
  static void transpose(V (&r)[8]) {
    V t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3.
    for (int i = 0; i < 8; i += 4) {
      const __m256d a = _mm256_castps_pd(t[i]), b = _mm256_castps_pd(t[i + 1]);
      const __m256d c = _mm256_castps_pd(t[i + 2]), d = _mm256_castps_pd(t[i + 3]);
      u[i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
      u[i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
      u[i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
      u[i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }
};

struct Avx2F64 {
  using T = double;
  using V = __m256d;
  static constexpr int W = 4;
  static constexpr int kGemmRows = 6;
  static constexpr int kOneVectorRows = 6;
  static constexpr bool kColumnMajorTile = true;
  static constexpr int kWideRows = 6, kWideVectors = 2;  // as in Avx2F32
  static constexpr int kQueryTileVectors = 4;             // as in Avx2F32: 16 queries
  static constexpr int kRowGroup = 2;                     // as in Avx2F32

  static V zero() { return _mm256_setzero_pd(); }
  static void hold(V& v) { hold_in_register(v); }
  static V set1(T x) { return _mm256_set1_pd(x); }
  static V load(const T* p) { return _mm256_loadu_pd(p); }
  static void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  static V load_partial(const T* p, int n) {
    return _mm256_maskload_pd(p, avx2_detail::first_lanes64(n));
  }
  static void store_partial(T* p, V v, int n) {
    _mm256_maskstore_pd(p, avx2_detail::first_lanes64(n), v);
  }
  static constexpr bool kWidens16 = false;
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V max_ignoring_nan(V running, V x) { return _mm256_max_pd(x, running); }
  static T reduce_add(V v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
  }
  // out[0..3] = the sums of a, b, c and d, reduced together.
  static void reduce_add4(V a, V b, V c, V d, T* out) {
    const V ab = _mm256_add_pd(_mm256_unpacklo_pd(a, b), _mm256_unpackhi_pd(a, b));
    const V cd = _mm256_add_pd(_mm256_unpacklo_pd(c, d), _mm256_unpackhi_pd(c, d));
    _mm256_storeu_pd(out, _mm256_add_pd(_mm256_permute2f128_pd(ab, cd, 0x20),
                                        _mm256_permute2f128_pd(ab, cd, 0x31)));
  }
  static T reduce_max(V v) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
  }
  static V exp_shift(V m) {
    const V neg_inf = _mm256_cmp_pd(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_pd(m, zero(), neg_inf);
  }
  // As Avx2F32's.
  static V add_unless_closed(V s, V m) {
    const V closed = _mm256_cmp_pd(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_pd(_mm256_add_pd(s, m), m, closed);
  }
  static uint32_t equal_lanes(V x, V c) {
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd(x, c, _CMP_EQ_OQ)));
  }
  static V closed_indicator(V m) {
    const V closed = _mm256_cmp_pd(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm256_and_pd(closed, set1(1.0));
  }
  // The primitives of the exponentials (vec_exp.h), as Avx2F32's.
  using Mask = V;
  static constexpr bool kZeroesByMask = false;
  static Mask not_less(V x, V c) { return _mm256_cmp_pd(x, c, _CMP_NLT_UQ); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V min(V a, V b) { return _mm256_min_pd(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_pd(a, b, c); }
  static V round_nearest(V x) {
    return _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void split_nearest(V x, V& n, V& r) {
    n = round_nearest(x);
    r = _mm256_sub_pd(x, n);
  }
  // 2^n for an integral n in [-1023, 1023]; n = -1023 gives the bits of +0.0.
  static V pow2(V n) {
    const __m256i biased =
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023));
    return _mm256_castsi256_pd(_mm256_slli_epi64(biased, 52));
  }
  // p 2^n for an integral n in [-2044, 2046], as Avx2F32's.
  static V scale(V p, V n) {
    const __m128i ni = _mm256_cvtpd_epi32(n);
    const __m128i n1 = _mm_srai_epi32(ni, 1);
    const __m128i n2 = _mm_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi64x(1023);
    const V scale1 = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(n1), bias), 52));
    const V scale2 = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(n2), bias), 52));
    return _mm256_mul_pd(_mm256_mul_pd(p, scale1), scale2);
  }
  static V scale_where(Mask keep, V p, V n) { return _mm256_and_pd(scale(p, n), keep); }
  static V exp(V x) { return vector_exp<Avx2F64>(x); }
  static V tanh_times(V y, T c) { return lanewise_tanh_times<Avx2F64>(y, c); }
  static V gelu(V x) { return lanewise_gelu<Avx2F64>(x); }
  // max(x, 0), a NaN passing through (max's second operand).
  static V relu(V x) { return max(zero(), x); }
  static V exp2(V x) { return vector_exp2<Avx2F64>(x); }
  static V exp2_nonpositive(V x) { return vector_exp2_nonpositive<Avx2F64>(x); }
  // In-register transpose of 4 rows of 4.
  static void transpose(V (&r)[4]) {
    V t[4];
    for (int i = 0; i < 4; i += 2) {  // t[2g + c], lane L: column 2L + c of rows 2g, 2g+1
      t[i] = _mm256_unpacklo_pd(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_pd(r[i], r[i + 1]);
    }
    for (int c = 0; c < 2; ++c) {
      r[c] = _mm256_permute2f128_pd(t[c], t[2 + c], 0x20);
      r[2 + c] = _mm256_permute2f128_pd(t[c], t[2 + c], 0x31);
    }
  }
};

}  // namespace
}  // namespace attnx::simd
