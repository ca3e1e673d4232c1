// The bfloat16 products of one instruction set (kernels/bf16_table.h), over
// a float vector type `Vec`: the float gemm's register tiles (gemm_kernels.h)
// stepping over pairs of bfloat16, the rounding to bfloat16 and the packing
// of pairs. kNative: AVX512_BF16's instructions (the file that instantiates
// it is compiled with -mavx512bf16); else the same arithmetic emulated with
// float32 multiply-adds and integer rounding, to the same bits.
//
// What vdpbf16ps does, checked on AMD Zen 4 against the emulation below
// (docs/tuning.md): acc' = (acc + a.high b.high) + a.low b.low, two float32
// additions each rounded to nearest even, of products that are exact (two
// bfloat16 significands of 8 bits make at most 16). An emulation that adds
// the low products first, or the two products before acc, gives other bits
// in about one result in ten. The instruction also treats subnormal inputs
// (acc and the operands) as zero and flushes subnormal results, both
// intermediate and final, to zero; the emulation does neither, so that the
// tables agree to the bit where no operand, product or sum is subnormal.
// Included only by kernels/<isa>/kernels__<isa>.cpp, compiled with that
// instruction set's flags.
#pragma once

#include <cstdint>

#include "kernels/bf16_table.h"
#include "kernels/simd/bf16_bits.h"
#include "kernels/simd/gemm_kernels.h"
#include "kernels/simd/kernel_helpers.h"
#include "kernels/simd/row_kernels.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// gemm's step over pairs: a step is one pair of k, two products per lane,
// and a run of kSumRun elements is kSumRun / 2 pairs, so that the sums are
// folded into C where the float gemm folds its own.
template <class Vec, bool kNative>
struct PairStep {
  using V = typename Vec::V;
  using A = uint32_t;
  using B = uint32_t;
  static constexpr int64_t kRun = kSumRun / 2;
  static V load(const B* p) { return Vec::load_pairs(p); }
  static V load_partial(const B* p, int n) { return Vec::load_pairs_partial(p, n); }
  static V broadcast(A x) { return Vec::set1_pair(x); }
  static V update(V a, V b, V acc) {
    if constexpr (kNative) {
      return Vec::dot_pairs(a, b, acc);
    } else {
      // The high products first, as vdpbf16ps. The halves of b are the same
      // for every row of the tile, those of a for every vector: the
      // compiler computes each once per step.
      acc = Vec::fmadd(Vec::pair_high(a), Vec::pair_high(b), acc);
      return Vec::fmadd(Vec::pair_low(a), Vec::pair_low(b), acc);
    }
  }
};

// Floats: the float32 table of the same level, whose row kernels read the
// rows rounded once (rounds_once): called through it, so that a level
// compiled apart (avx512_bf16) holds no second copy of them.
template <class Vec, bool kNative, const KernelTable<float>& (*Floats)()>
struct Bf16Kernels {
  using V = typename Vec::V;
  using Gemm = GemmKernels<Vec>;
  using Step = PairStep<Vec, kNative>;
  static constexpr int W = Vec::W;
  // The register tile: Vec::kPairGemmRows x kPanelVectors, the float gemm's
  // but where the emulation's halves of A and B need registers of their own
  // (AVX2), with its column-major tile for P.V. A tile's shape changes the
  // order of no sum: every shape gives the same bits.
  static constexpr int kRows = Vec::kPairGemmRows;
  static constexpr int kVectors = kPanelVectors;

  static void gemm(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t a_row,
                   int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                   GemmInit init, const float* init_values) {
    Gemm::template gemm_panels<kRows, kVectors, Step, Vec::kColumnMajorTile>(
        M, N, K2, a, a_row, a_col, b, ldb, c, ldc, init, init_values);
  }

  // x rounded to bfloat16 (bf16_bits.h), as float32 values.
  static V round_vector(V x) {
    if constexpr (kNative)
      return Vec::round_bf16_native(x);
    else
      return Vec::round_bf16(x);
  }

  static void round(const float* src, int64_t n, uint16_t* dst) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      if constexpr (kNative)
        Vec::round_store_bf16_native(dst + i, Vec::load(src + i));
      else
        Vec::store_bf16(dst + i, Vec::round_bf16(Vec::load(src + i)));
    }
    const int tail = static_cast<int>(n - i);
    if (tail)
      Vec::store_bf16_partial(dst + i, round_vector(Vec::load_partial(src + i, tail)), tail);
  }

  static void round_in_place(float* x, int64_t n) { map_row<Vec>(x, n, x, round_vector); }

  // One pair from the values at lo and hi (null: none, 0), scaled and rounded.
  static uint32_t pair_of(const float* lo, const float* hi, float scale) {
    const auto rounded = [scale](const float* p) {
      return round_bf16_bits(bits_of_float(*p * scale));
    };
    return rounded(lo) >> 16 | (hi != nullptr ? rounded(hi) : 0u);
  }

  static void pack_pairs(const float* src, int64_t ld_k, int64_t ld_n, int64_t K, int64_t N,
                         float scale, uint32_t* dst, int64_t ldd) {
    const int64_t pairs = (K + 1) / 2;
    const V s = Vec::set1(scale);
    const auto scaled = [s](const float* p) { return round_vector(Vec::mul(Vec::load(p), s)); };
    int64_t p_done = 0, n_done = 0;  // what the vector loops below leave to the scalar one
    if (ld_n == 1) {
      // Rows of pairs from pairs of rows of X: W columns at a time.
      for (int64_t p = 0; p < pairs; ++p) {
        const float* lo = src + 2 * p * ld_k;
        const bool has_hi = 2 * p + 1 < K;
        uint32_t* out = dst + p * ldd;
        int64_t n = 0;
        for (; n + W <= N; n += W)
          Vec::store_pairs(out + n, Vec::make_pairs(scaled(lo + n),
                                                    has_hi ? scaled(lo + ld_k + n) : Vec::zero()));
        for (; n < N; ++n) out[n] = pair_of(lo + n, has_hi ? lo + ld_k + n : nullptr, scale);
      }
      return;
    }
    if (ld_k == 1) {
      // Transposing: a pair's two values are adjacent in a column of X (a
      // row of src). Blocks of W columns x W pairs: each column's 2W values
      // make W pairs in one vector, and a transpose turns the W vectors
      // into W rows of dst.
      const int64_t full_pairs = K / (2 * W) * W;
      for (int64_t n0 = 0; n0 + W <= N; n0 += W) {
        for (int64_t p0 = 0; p0 < full_pairs; p0 += W) {
          V r[W];
          for (int i = 0; i < W; ++i) {
            const float* col = src + (n0 + i) * ld_n + 2 * p0;
            r[i] = Vec::adjacent_pairs(scaled(col), scaled(col + W));
          }
          Vec::transpose(r);
          for (int j = 0; j < W; ++j) Vec::store_pairs(dst + (p0 + j) * ldd + n0, r[j]);
        }
      }
      p_done = full_pairs;
      n_done = N / W * W;
    }
    // What is left (any layout), one pair at a time: the pairs from p_done
    // of every column, and those below it of the columns from n_done.
    for (int64_t n = 0; n < N; ++n)
      for (int64_t p = n < n_done ? p_done : 0; p < pairs; ++p) {
        const float* lo = src + 2 * p * ld_k + n * ld_n;
        dst[p * ldd + n] = pair_of(lo, 2 * p + 1 < K ? lo + ld_k : nullptr, scale);
      }
  }

  // The wide tile: the float gemm_wide's shape where the instruction does
  // the products; the emulations keep gemm's tile.
  static constexpr int kWideRows = kNative ? Vec::kWideRows : kRows;
  static constexpr int kWideVectors = kNative ? Vec::kWideVectors : kVectors;

  static void gemm_wide(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t a_row,
                        int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                        GemmInit init, const float* init_values) {
    Gemm::template gemm_panels<kWideRows, kWideVectors, Step, false>(
        M, N, K2, a, a_row, a_col, b, ldb, c, ldc, init, init_values);
  }

  // kFmaProbeChains chains of vdpbf16ps (Bf16KernelTable::dot_probe).
  static float dot_probe(int64_t iterations) {
    if constexpr (kNative) {
      V acc[kFmaProbeChains];
      for (int c = 0; c < kFmaProbeChains; ++c) acc[c] = Vec::set1(float(c));
      // acc += 2^-10 (2^-10 + 2^-10): no overflow, no subnormals.
      const V a = Vec::set1_pair(0x3a803a80u);
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < kFmaProbeChains; ++c) acc[c] = Vec::dot_pairs(a, a, acc[c]);
      }
      V sum = acc[0];
      for (int c = 1; c < kFmaProbeChains; ++c) sum = Vec::add(sum, acc[c]);
      return Vec::reduce_add(sum);
    } else {
      return float(iterations);
    }
  }

  // The float32 row kernels over keys and values whose float32 elements
  // are rounded as they are loaded (16-bit and int8 ones are taken as
  // stored: see attention/sdpa_bf16.h).
  struct RoundingLoads : Vec {
    static V load(const float* p) { return round_vector(Vec::load(p)); }
    static V load_partial(const float* p, int n) { return round_vector(Vec::load_partial(p, n)); }
  };
  using Rows = RowKernels<Vec, RoundingLoads>;

  // Where more query rows than one group of the row kernels (Vec::
  // kRowGroup) read the same keys or values, each group would round every
  // element again: the rows are rounded once instead, a sub-block at a time
  // into a buffer that stays in L1, and the float32 kernels read that (the
  // same bits: they multiply the same rounded elements in the same order).
  // A sub-block is a multiple of 4 rows, as the kernels group keys by four
  // from a call's first.
  static constexpr int64_t kRoundedFloats = 4096;  // 16 KiB
  // The most rows of a sub-block, and of the query rows of a call.
  static constexpr int64_t kRoundedRowsMax = 128;

  static int64_t rounded_stride(int64_t dim) { return (dim + W - 1) / W * W; }
  static bool rounds_once(int rows, int64_t dim) {
    return rows > Vec::kRowGroup && rows <= kRoundedRowsMax &&
           rounded_stride(dim) * 16 <= kRoundedFloats;
  }

  // f(rounded, j0, n) for rows [j0, j0 + n) of `rows`, rounded; rows up to
  // `listed` are asked for ahead as the row kernels ask.
  template <typename F>
  static void in_rounded_sub_blocks(const float* const* rows, int64_t n_rows, int64_t listed,
                                    int64_t dim, F&& f) {
    alignas(64) float buffer[kRoundedFloats];
    const float* rounded[kRoundedRowsMax];
    const int64_t ld = rounded_stride(dim);
    const int64_t sub = min64(kRoundedRowsMax, kRoundedFloats / ld) / 4 * 4;
    const int64_t ahead = prefetch_distance<float>(true, dim);
    for (int64_t j0 = 0; j0 < n_rows; j0 += sub) {
      const int64_t n = min64(sub, n_rows - j0);
      for (int64_t j = 0; j < n; ++j) {
        if (ahead && j0 + j + ahead < listed) prefetch_rows(rows[j0 + j + ahead], 0, 1, dim);
        rounded[j] = buffer + j * ld;
        map_row<Vec>(rows[j0 + j], dim, buffer + j * ld, round_vector);
      }
      f(rounded, j0, n);
    }
  }

  static void scores_rounded(const float* const* q, int rows, const float* const* k,
                             int64_t n_keys, int64_t listed, int64_t dim, float scale,
                             float* const* dst) {
    if (!rounds_once(rows, dim))
      return Rows::scores_listed_native(q, rows, k, n_keys, listed, dim, scale, dst);
    in_rounded_sub_blocks(k, n_keys, listed, dim,
                          [&](const float* const* keys, int64_t j0, int64_t n) {
                            float* d[kRoundedRowsMax];
                            for (int r = 0; r < rows; ++r) d[r] = dst[r] + j0;
                            Floats().scores_listed(q, rows,
                                                   reinterpret_cast<const void* const*>(keys),
                                                   nullptr, 0, n, n, dim, scale, d);
                          });
  }

  static void accumulate_pv_rounded(const float* const* p, int rows, const float* const* v,
                                    int64_t n_keys, int64_t listed, int64_t dim,
                                    float* const* acc) {
    if (!rounds_once(rows, dim))
      return Rows::accumulate_pv_listed_native(p, rows, v, n_keys, listed, dim, acc);
    in_rounded_sub_blocks(v, n_keys, listed, dim,
                          [&](const float* const* values, int64_t j0, int64_t n) {
                            const float* pr[kRoundedRowsMax];
                            for (int r = 0; r < rows; ++r) pr[r] = p[r] + j0;
                            Floats().accumulate_pv_listed(
                                pr, rows, reinterpret_cast<const void* const*>(values), nullptr,
                                0, n, n, dim, acc);
                          });
  }

  static Bf16KernelTable table(const char* name, Isa isa) {
    return Bf16KernelTable{name,           isa,   kNative,    kVectors * W,
                           gemm,           round, round_in_place, pack_pairs,
                           kWideVectors * W, kNative ? gemm_wide : gemm,
                           scores_rounded, accumulate_pv_rounded,
                           kNative ? dot_probe : nullptr, nullptr, nullptr, nullptr};
  }
};

}  // namespace
}  // namespace attnx::simd
