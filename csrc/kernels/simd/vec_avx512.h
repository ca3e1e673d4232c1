// AVX-512 vectors of float (16 lanes) and double (8 lanes), for kernels
// compiled with -mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma.
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

struct Avx512F32 {
  using T = float;
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kGemmRows = 12;  // 12 x 2 accumulators of 32 registers
  static constexpr int kPairGemmRows = 12;  // the bfloat16 gemm's (bf16_kernels.h)
  // Rows of the one-vector tile: 16 accumulators, so that a block of 16 rows
  // (a head dim or 16 keys, in small calls) is one tile rather than 8 + 8.
  static constexpr int kOneVectorRows = 16;
  static constexpr bool kColumnMajorTile = true;  // gemm tile for a_row == 1 (ALayout)
  static constexpr int kWideRows = 6, kWideVectors = 4;  // 6 x 4 accumulators
  static constexpr int kQueryTileVectors = 2;            // 32 queries per flash tile
  // Query rows the row kernels take through a block of keys at once: 4 rows
  // x 4 keys of accumulators, and the 4 key vectors, stay in 32 registers.
  static constexpr int kRowGroup = 4;

  static V zero() { return _mm512_setzero_ps(); }
  static void hold(V& v) { hold_in_register(v); }
  static V set1(T x) { return _mm512_set1_ps(x); }
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static void store(T* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V load_partial(const T* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_partial(T* p, V v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
  // Loads of 16 (or the first n, zeros above; masked, so nothing past p[n-1]
  // is read) 16-bit floats widened to float. float16 by vcvtph2ps, which is
  // exact and makes a NaN quiet; bfloat16 by shifting its bits into the top
  // half of a float, a NaN made quiet the same way (integer compare: no
  // floating-point flag is raised).
  static constexpr bool kWidens16 = true;
  static V load_widen_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_widen_f16_partial(const uint16_t* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p));
  }
  static V load_widen_bf16(const uint16_t* p) {
    return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_widen_bf16_partial(const uint16_t* p, int n) {
    return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p));
  }
  // bfloat16 values as the operands of products: their bits shifted into
  // the top half of a float (two instructions, where load_widen_bf16 takes
  // five), a NaN left as it is: a product with it is a quiet NaN either way.
  static V load_bf16_operand(const uint16_t* p) {
    return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_bf16_operand_partial(const uint16_t* p, int n) {
    return bf16_bits_to_float(_mm256_maskz_loadu_epi16(first(n), p));
  }
  static V bf16_bits_to_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // 16 (or the first n, zeros above; masked) int8 values as floats, exactly:
  // vpmovsxbd then vcvtdq2ps.
  static V load_widen_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_widen_i8_partial(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), p)));
  }
  static V widen_bf16(__m256i h) {
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_set1_epi32(0x00400000);
    return _mm512_castsi512_ps(_mm512_mask_or_epi32(bits, nan, bits, quiet));
  }
  // Pairs of bfloat16 (kernels/bf16_table.h), one per 32-bit lane, held in
  // a V: element 2p in the low half, 2p + 1 in the high half. The high half
  // is a float32 as it stands; the low one once shifted into the top.
  static V load_pairs(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static V load_pairs_partial(const uint32_t* p, int n) {
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(first(n), p));
  }
  static void store_pairs(uint32_t* p, V v) { _mm512_storeu_si512(p, _mm512_castps_si512(v)); }
  static void store_pairs_partial(uint32_t* p, V v, int n) {
    _mm512_mask_storeu_epi32(p, first(n), _mm512_castps_si512(v));
  }
  static V set1_pair(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(int(x))); }
  static V pair_high(V x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(kBf16High))));
  }
  static V pair_low(V x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(x), 16));
  }
  // Pairs from the bfloat16 values (low halves 0) of lo and hi.
  static V make_pairs(V lo, V hi) {
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_srli_epi32(_mm512_castps_si512(lo), 16), _mm512_castps_si512(hi)));
  }
  // round_bf16_bits (bf16_bits.h) lane by lane: x rounded to bfloat16.
  // Where every lane is a normal number or an infinity, as a rule, the
  // rounding is the addition alone; else the whole rules (round_bf16_any,
  // out of line, so that the code that inlines round_bf16 carries one copy).
  static V round_bf16(V x) {
    const __m512 magnitude = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(kBf16AbsMask))));
    // Not >= the smallest normal number: a zero, a subnormal or a NaN.
    const __mmask16 special = _mm512_cmp_ps_mask(
        magnitude, _mm512_castsi512_ps(_mm512_set1_epi32(int(kBf16MinNormal))), _CMP_NGE_UQ);
    if (__builtin_expect(special != 0, 0)) return round_bf16_any(x);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(int(kBf16HalfUlp))), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(kBf16High))));
  }
  [[gnu::noinline]] static V round_bf16_any(V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(int(kBf16AbsMask)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(int(kBf16Infinity)));
    const __mmask16 tiny =
        _mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32(int(kBf16MinNormal)));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(int(kBf16HalfUlp))), odd);
    r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(int(kBf16Quiet)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(int(kBf16High)));
    r = _mm512_mask_andnot_epi32(r, tiny, _mm512_set1_epi32(int(kBf16AbsMask)), bits);
    return _mm512_castsi512_ps(r);
  }
  // The pairs of 32 consecutive rounded values, x0's 16 then x1's: pair j
  // holds values 2j and 2j + 1 (one vpermt2w of the high halves).
  static V adjacent_pairs(V x0, V x1) {
    alignas(64) static constexpr int16_t kOddWords[32] = {
        1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
        33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_castsi512_ps(_mm512_permutex2var_epi16(
        _mm512_castps_si512(x0), _mm512_load_si512(kOddWords), _mm512_castps_si512(x1)));
  }
  // The bfloat16 halves of 16 rounded values, stored as 16-bit values (vpmovdw).
  static void store_bf16(uint16_t* p, V rounded) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
  }
  static void store_bf16_partial(uint16_t* p, V rounded, int n) {
    _mm512_mask_cvtepi32_storeu_epi16(p, first(n),
                                      _mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  }
#if defined(__AVX512BF16__)
  // The instructions themselves (compiled with -mavx512bf16 only):
  // vdpbf16ps, acc + a.high b.high + a.low b.low (see bf16_kernels.h), and
  // vcvtneps2bf16 (the rounding of round_bf16, in one instruction), widened
  // back to float32 bits.
  static V dot_pairs(V a, V b, V acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a),
                            (__m512bh)_mm512_castps_si512(b));
  }
  static V round_bf16_native(V x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // round_bf16_native and store_bf16 in one: the 16-bit values as they come.
  static void round_store_bf16_native(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
  }
#endif
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // max(running, x) that keeps `running` where x is NaN (vmaxps returns its
  // second operand when either is NaN).
  static V max_ignoring_nan(V running, V x) { return _mm512_max_ps(x, running); }
  static T reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  // out[0..3] = the sums of a, b, c and d, reduced together: pairs of lanes
  // of two vectors interleaved and added, then blocks, 13 operations where
  // four reduce_adds take about 32.
  static void reduce_add4(V a, V b, V c, V d, T* out) {
    const V ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const V cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
    // Each 128-bit block: its four lanes' sums of a, b, c, d.
    const V blocks = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab2, cd2)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(ab2, cd2)));
    const __m256 halves =
        _mm256_add_ps(_mm512_castps512_ps256(blocks), _mm512_extractf32x8_ps(blocks, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
  }
  // out[r][u] = scale * (f[u] * the sum of acc[r][u]) (f null: scale * the sum), r, u < 4:
  // four reduce_add4s taken together, each sum in the same order (so the same bits), the
  // products and stores four lanes at a time. 45 operations reduce the 16 vectors, where four
  // reduce_add4s take 52 and then 16 scalar products and stores.
  static void reduce_add4x4(const V (&acc)[4][4], const T* f, T scale, T* const* out) {
    V blocks[4];  // blocks[r]: each 128-bit block, its four lanes' sums of acc[r][0..3]
    for (int r = 0; r < 4; ++r) {
      const V ab = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][0], acc[r][1]),
                                 _mm512_unpackhi_ps(acc[r][0], acc[r][1]));
      const V cd = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][2], acc[r][3]),
                                 _mm512_unpackhi_ps(acc[r][2], acc[r][3]));
      const __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
      blocks[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab2, cd2)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(ab2, cd2)));
    }
    // Blocks 0 + 2 and 1 + 3 (reduce_add4's halves), two rows a vector ...
    const V w0 = _mm512_add_ps(_mm512_shuffle_f32x4(blocks[0], blocks[1], 0x44),
                               _mm512_shuffle_f32x4(blocks[0], blocks[1], 0xee));
    const V w1 = _mm512_add_ps(_mm512_shuffle_f32x4(blocks[2], blocks[3], 0x44),
                               _mm512_shuffle_f32x4(blocks[2], blocks[3], 0xee));
    // ... then (0 + 2) + (1 + 3): block r holds row r's four sums.
    V sums = _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
    if (f) sums = _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(f)), sums);
    sums = _mm512_mul_ps(set1(scale), sums);
    _mm_storeu_ps(out[0], _mm512_castps512_ps128(sums));
    _mm_storeu_ps(out[1], _mm512_extractf32x4_ps(sums, 1));
    _mm_storeu_ps(out[2], _mm512_extractf32x4_ps(sums, 2));
    _mm_storeu_ps(out[3], _mm512_extractf32x4_ps(sums, 3));
  }
  // dst[r][j + u] = scale * the sum of acc[r][u] for R rows and four keys u:
  // reduce_add4x4 for four rows, reduce_add4 for fewer (the same bits).
  template <int R>
  static void store_four_keys(const V (&acc)[4][4], T scale, T* const* dst, int64_t j) {
    if constexpr (R == 4) {
      T* out[4] = {dst[0] + j, dst[1] + j, dst[2] + j, dst[3] + j};
      reduce_add4x4(acc, nullptr, scale, out);
    } else {
      for (int r = 0; r < R; ++r) {
        T sums[4];
        reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
        for (int u = 0; u < 4; ++u) dst[r][j + u] = scale * sums[u];
      }
    }
  }
  static T reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  // 0 where m is -inf, else m (see attention/softmax_rules.h).
  static V exp_shift(V m) {
    const __mmask16 neg_inf =
        _mm512_cmp_ps_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(neg_inf, m, zero());
  }
  // s + m, or -inf where m is -inf (a closed key: whatever s holds).
  static V add_unless_closed(V s, V m) {
    const __mmask16 closed =
        _mm512_cmp_ps_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(closed, _mm512_add_ps(s, m), m);
  }
  // Bit i set where lane i of x equals lane i of c (never for a NaN).
  static uint32_t equal_lanes(V x, V c) { return _mm512_cmp_ps_mask(x, c, _CMP_EQ_OQ); }
  // 1 in the lanes where m is -inf, else 0.
  static V closed_indicator(V m) {
    const __mmask16 closed =
        _mm512_cmp_ps_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_maskz_mov_ps(closed, set1(1.0f));
  }
  // The primitives of the exponentials (vec_exp.h). A zeroing mask costs
  // nothing, and a lane it zeroes takes no microcode assist where its scalef
  // would underflow: the masks keep every scaling clear of underflow.
  using Mask = __mmask16;
  static constexpr bool kZeroesByMask = true;
  static Mask not_less(V x, V c) { return _mm512_cmp_ps_mask(x, c, _CMP_NLT_UQ); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round_nearest(V x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // r = x - round(x) is one vreduceps, and n = x - r exactly, where
  // vrndscaleps and a subtraction are three operations on port 0: the same
  // r and n (the same bits), and a shorter softmax step (measurements:
  // docs/tuning.md).
  static void split_nearest(V x, V& n, V& r) {
    r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n = _mm512_sub_ps(x, r);
  }
  // p 2^n by vscalefps, in the lanes of keep.
  static V scale_where(Mask keep, V p, V n) { return _mm512_maskz_scalef_ps(keep, p, n); }
  static V exp(V x) { return vector_exp<Avx512F32>(x); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V tanh_times(V y, T c) { return vector_tanh_times_f32<Avx512F32>(y, c); }
  static V gelu(V x) { return vector_gelu_f32<Avx512F32>(x); }
  // max(x, 0), a NaN passing through (max's second operand).
  static V relu(V x) { return max(zero(), x); }
  static V exp2_nonpositive(V x) { return vector_exp2_nonpositive<Avx512F32>(x); }
  // In-register transpose of 16 rows of 16: r[i][j] <- r[j][i].
  static void transpose(V (&r)[16]) {
    V t[16], u[16];
    for (int i = 0; i < 16; i += 2) {  // pairs of rows, per 128-bit lane
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3.
    for (int i = 0; i < 16; i += 4) {
      const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
      const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
      u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // Gather lane L of u[c], u[4 + c], u[8 + c], u[12 + c] into row 4L + c.
    for (int c = 0; c < 4; ++c) {
      const V even01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
      const V odd01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
      const V even23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
      const V odd23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
      r[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
      r[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xdd);
      r[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
      r[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xdd);
    }
  }
};

struct Avx512F64 {
  using T = double;
  using V = __m512d;
  static constexpr int W = 8;
  static constexpr int kGemmRows = 12;
  static constexpr int kOneVectorRows = 16;  // as in Avx512F32
  static constexpr bool kColumnMajorTile = true;
  static constexpr int kWideRows = 6, kWideVectors = 4;
  static constexpr int kQueryTileVectors = 2;  // 16 queries per flash tile
  static constexpr int kRowGroup = 4;          // as in Avx512F32

  static V zero() { return _mm512_setzero_pd(); }
  static void hold(V& v) { hold_in_register(v); }
  static V set1(T x) { return _mm512_set1_pd(x); }
  static V load(const T* p) { return _mm512_loadu_pd(p); }
  static void store(T* p, V v) { _mm512_storeu_pd(p, v); }
  static __mmask8 first(int n) { return static_cast<__mmask8>((1u << n) - 1u); }
  static V load_partial(const T* p, int n) { return _mm512_maskz_loadu_pd(first(n), p); }
  static void store_partial(T* p, V v, int n) { _mm512_mask_storeu_pd(p, first(n), v); }
  static constexpr bool kWidens16 = false;
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V max_ignoring_nan(V running, V x) { return _mm512_max_pd(x, running); }
  static T reduce_add(V v) { return _mm512_reduce_add_pd(v); }
  // As Avx512F32's: out[0..3] = the sums of a, b, c and d.
  static void reduce_add4(V a, V b, V c, V d, T* out) {
    // Each 128-bit block: its two lanes' sums of a and b (of c and d).
    const V ab = _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
    const V cd = _mm512_add_pd(_mm512_unpacklo_pd(c, d), _mm512_unpackhi_pd(c, d));
    // Blocks 0 + 1 and 2 + 3 of ab, then of cd.
    const V pairs = _mm512_add_pd(_mm512_shuffle_f64x2(ab, cd, 0x88), _mm512_shuffle_f64x2(ab, cd, 0xdd));
    const V sums = _mm512_add_pd(pairs, _mm512_shuffle_f64x2(pairs, pairs, 0xb1));
    _mm_storeu_pd(out, _mm512_castpd512_pd128(sums));
    _mm_storeu_pd(out + 2, _mm512_extractf64x2_pd(sums, 2));
  }
  static T reduce_max(V v) { return _mm512_reduce_max_pd(v); }
  static V exp_shift(V m) {
    const __mmask8 neg_inf =
        _mm512_cmp_pd_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_pd(neg_inf, m, zero());
  }
  // As Avx512F32's.
  static V add_unless_closed(V s, V m) {
    const __mmask8 closed =
        _mm512_cmp_pd_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_pd(closed, _mm512_add_pd(s, m), m);
  }
  static uint32_t equal_lanes(V x, V c) { return _mm512_cmp_pd_mask(x, c, _CMP_EQ_OQ); }
  static V closed_indicator(V m) {
    const __mmask8 closed =
        _mm512_cmp_pd_mask(m, set1(-std::numeric_limits<T>::infinity()), _CMP_EQ_OQ);
    return _mm512_maskz_mov_pd(closed, set1(1.0));
  }
  // The primitives of the exponentials (vec_exp.h), as Avx512F32's.
  using Mask = __mmask8;
  static constexpr bool kZeroesByMask = true;
  static Mask not_less(V x, V c) { return _mm512_cmp_pd_mask(x, c, _CMP_NLT_UQ); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static V min(V a, V b) { return _mm512_min_pd(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_pd(a, b, c); }
  static V round_nearest(V x) {
    return _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void split_nearest(V x, V& n, V& r) {
    r = _mm512_reduce_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n = _mm512_sub_pd(x, r);
  }
  static V scale_where(Mask keep, V p, V n) { return _mm512_maskz_scalef_pd(keep, p, n); }
  static V exp(V x) { return vector_exp<Avx512F64>(x); }
  static V tanh_times(V y, T c) { return lanewise_tanh_times<Avx512F64>(y, c); }
  static V gelu(V x) { return lanewise_gelu<Avx512F64>(x); }
  // max(x, 0), a NaN passing through (max's second operand).
  static V relu(V x) { return max(zero(), x); }
  static V exp2_nonpositive(V x) { return vector_exp2_nonpositive<Avx512F64>(x); }
  // In-register transpose of 8 rows of 8.
  static void transpose(V (&r)[8]) {
    V t[8];
    for (int i = 0; i < 8; i += 2) {  // t[2g + c], 128-bit lane L: column 2L + c of rows 2g, 2g+1
      t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);
    }
    for (int c = 0; c < 2; ++c) {
      const V even01 = _mm512_shuffle_f64x2(t[c], t[2 + c], 0x88);
      const V odd01 = _mm512_shuffle_f64x2(t[c], t[2 + c], 0xdd);
      const V even23 = _mm512_shuffle_f64x2(t[4 + c], t[6 + c], 0x88);
      const V odd23 = _mm512_shuffle_f64x2(t[4 + c], t[6 + c], 0xdd);
      r[c] = _mm512_shuffle_f64x2(even01, even23, 0x88);
      r[4 + c] = _mm512_shuffle_f64x2(even01, even23, 0xdd);
      r[2 + c] = _mm512_shuffle_f64x2(odd01, odd23, 0x88);
      r[6 + c] = _mm512_shuffle_f64x2(odd01, odd23, 0xdd);
    }
  }
};

}  // namespace
}  // namespace attnx::simd
