// The register-tiled gemm of one instruction set, over a vector type `Vec`:
// the flash tile's two products and the projections.
// Included by attention_kernels.h alone, so that it is compiled only with
// the flags of the instruction set that runs it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/kernel_table.h"
#include "kernels/simd/kernel_helpers.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// Register tile of gemm: MR rows x 2 vectors of C held in registers.
constexpr int kPanelVectors = 2;
// The longest run of k that one accumulator sums before its sum is folded
// into C: float32 rounding error grows with the length of a sum, and runs of
// 128 make a projection over E = 768 about as accurate as BLAS (x 1024 x 768
// times w^T: max error 5.1e-6 as one run, 1.1e-6 in runs, OpenBLAS 2.4e-6),
// for a fold of the tile into C (in L1) every 128 steps. gemm_panels
// calls the tile once per run, so that the tile's code holds no fold.
constexpr int64_t kSumRun = 128;

// Whether gemm's A has unit row stride (a_row == 1), known when the tile is
// compiled: its broadcasts then address A from one pointer at constant
// offsets m, where two runtime strides take more address registers than
// x86-64 has and the k loop spills its counters. That is the flash tile's
// P.V, whose A is the probabilities, a column of queries per key: faster
// alone and in the attention (measurements: docs/tuning.md). (Row-major
// tiles for the scores, a_col == 1, were as fast alone and slower in the
// attention.)
enum class ALayout {
  kStrided,     // A(m, k) = a[m * a_row + k * a_col]
  kColumnMajor  // a_row == 1
};

// One step of the tile's k loop, the rank-1 update of a row of C by a
// broadcast element of A and a row of B. The float gemm's: A and B hold T,
// and a step is a multiply-add. (The bfloat16 products, bf16_kernels.h, step
// over pairs of bfloat16 with the same tiles.)
template <class Vec>
struct FmaStep {
  using T = typename Vec::T;
  using V = typename Vec::V;
  using A = T;  // an element of A
  using B = T;  // an element of a row of B: one lane of a vector
  static constexpr int64_t kRun = kSumRun;  // steps per run (see kSumRun)
  static V load(const B* p) { return Vec::load(p); }
  static V load_partial(const B* p, int n) { return Vec::load_partial(p, n); }
  static V broadcast(A x) { return Vec::set1(x); }
  static V update(V a, V b, V acc) { return Vec::fmadd(a, b, acc); }
};

template <class Vec>
struct GemmKernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
  static constexpr int NR = kPanelVectors * W;  // panel width
  static constexpr int kWideWidth = Vec::kWideVectors * W;  // gemm_wide's panel width

  // One MR x (NV * W) register tile: C tile = init + A(MR rows) . B(K x NV*W),
  // K steps of Step (FmaStep: k; the bfloat16 products: pairs of k).
  // The accumulators are plain locals, never address-taken, so that they
  // stay in registers through the k loop. kA says whether A's row stride is
  // 1 (see ALayout).
  template <int MR, int NV, bool kFullWidth, ALayout kA = ALayout::kStrided,
            class Step = FmaStep<Vec>>
  static void gemm_tile(int64_t K, const typename Step::A* a, int64_t a_row, int64_t a_col,
                        const typename Step::B* b, int64_t ldb, T* c, int64_t ldc, int n,
                        GemmInit init, const T* init_values) {
    using AElem = typename Step::A;
    using BElem = typename Step::B;
    // Lanes of each vector of a (possibly partial) row of the tile.
    int len[NV];
    for (int v = 0; v < NV; ++v) len[v] = kFullWidth ? W : imax(imin(n - v * W, W), 0);
    // A row of C or of the bias (T), or of B (Step's elements: T too in the
    // float gemm).
    auto load_row = [len](auto p, int v) {
      if constexpr (std::is_same_v<decltype(p), const T*> || std::is_same_v<decltype(p), T*>)
        return kFullWidth ? Vec::load(p + v * W)
                          : (len[v] ? Vec::load_partial(p + v * W, len[v]) : Vec::zero());
      else
        return kFullWidth ? Step::load(p + v * W)
                          : (len[v] ? Step::load_partial(p + v * W, len[v]) : Vec::zero());
    };
    // Every branch of step 1 sets every accumulator; GCC cannot see that
    // through the portable vector's lane array in the one-vector tiles.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
    V acc[MR][NV];
    // Step 1: initialise the accumulators.
    if (init == GemmInit::kBiasColumns) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const V bias = load_row(init_values, v);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[m][v] = bias;
      }
    } else if (init == GemmInit::kZero || init == GemmInit::kAddSum) {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zero();
    } else if (init == GemmInit::kBiasRows) {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V bias = Vec::set1(init_values[m]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = bias;
      }
    } else {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V s = init == GemmInit::kScaleRows ? Vec::set1(init_values[m]) : Vec::set1(T(1));
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          acc[m][v] = load_row(c + m * ldc, v);
          if (init == GemmInit::kScaleRows) acc[m][v] = Vec::mul(acc[m][v], s);
        }
      }
    }
    // Step 2: rank-1 updates, one per k: broadcast A(m, k), multiply-add B row k.
    if constexpr (kA == ALayout::kStrided && MR >= 8 && MR % 4 == 0) {
      // Rows at a runtime stride, as MR / 4 pointers each read at 0, 1, 2
      // and 3 strides: one index register per row (the general loop below)
      // is more than x86-64 has, and the spilled indices cost more loads
      // than the tile's multiply-adds can hide. (The AVX-512 tiles of 12
      // and 8 rows, the flash tile's scores and its last rows of P.V, had
      // reloaded four spilled indices per k in the general loop; in the
      // quads the attention takes less time or as long: docs/tuning.md.)
      const AElem* quad[MR / 4];
#pragma GCC unroll 4
      for (int i = 0; i < MR / 4; ++i) quad[i] = a + 4 * i * a_row;
      const int64_t s1 = a_row, s2 = 2 * a_row, s3 = 3 * a_row;
#pragma GCC unroll 2
      for (int64_t k = 0; k < K; ++k) {
        const BElem* bk = b + k * ldb;
        V bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) bv[v] = load_row(bk, v);
        const int64_t ko = k * a_col;
#pragma GCC unroll 4
        for (int i = 0; i < MR / 4; ++i) {
          const AElem* p = quad[i] + ko;
          const V a0 = Step::broadcast(p[0]), a1 = Step::broadcast(p[s1]),
                  a2 = Step::broadcast(p[s2]), a3 = Step::broadcast(p[s3]);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) {
            acc[4 * i][v] = Step::update(a0, bv[v], acc[4 * i][v]);
            acc[4 * i + 1][v] = Step::update(a1, bv[v], acc[4 * i + 1][v]);
            acc[4 * i + 2][v] = Step::update(a2, bv[v], acc[4 * i + 2][v]);
            acc[4 * i + 3][v] = Step::update(a3, bv[v], acc[4 * i + 3][v]);
          }
        }
      }
    } else
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
      const BElem* bk = b + k * ldb;
      V bv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) bv[v] = load_row(bk, v);
      const AElem* ak = a + k * a_col;
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V am = Step::broadcast(ak[m * (kA == ALayout::kColumnMajor ? 1 : a_row)]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = Step::update(am, bv[v], acc[m][v]);
      }
    }
    // Step 3: store.
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      T* cm = c + m * ldc;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        if (init == GemmInit::kAddSum) acc[m][v] = Vec::add(load_row(cm, v), acc[m][v]);
        if (kFullWidth)
          Vec::store(cm + v * W, acc[m][v]);
        else if (len[v])
          Vec::store_partial(cm + v * W, acc[m][v], len[v]);
      }
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  }

  // The tile for the last `rows` < MR rows: recurse down to that count.
  template <int MR, int NV, bool kFullWidth, class Step = FmaStep<Vec>>
  static void gemm_rows(int rows, int64_t K, const typename Step::A* a, int64_t a_row,
                        int64_t a_col, const typename Step::B* b, int64_t ldb, T* c,
                        int64_t ldc, int n, GemmInit init, const T* init_values) {
    if constexpr (MR > 1) {
      if (rows < MR)
        return gemm_rows<MR - 1, NV, kFullWidth, Step>(rows, K, a, a_row, a_col, b, ldb, c, ldc,
                                                       n, init, init_values);
    }
    gemm_tile<MR, NV, kFullWidth, ALayout::kStrided, Step>(K, a, a_row, a_col, b, ldb, c, ldc, n,
                                                           init, init_values);
  }

  // One panel of C (n columns from c, B's from b, init_values offset to the
  // panel's columns) MR rows at a time, each row tile over k in runs of
  // Step::kRun steps (kSumRun elements): the first run starts C as `init`
  // says, each later one sums from zero and adds to C.
  // Tiles of MR rows take the layout kA; the last, shorter ones the general
  // tile.
  template <int MR, int NV, bool kFullWidth, ALayout kA = ALayout::kStrided,
            class Step = FmaStep<Vec>>
  static void gemm_panel(int64_t M, int64_t K, const typename Step::A* a, int64_t a_row,
                         int64_t a_col, const typename Step::B* b, int64_t ldb, T* c,
                         int64_t ldc, int n, GemmInit init, const T* init_values) {
    for (int64_t m0 = 0; m0 < M;) {
      // A last tile of fewer than MR / 2 rows has too few accumulators to
      // hide the multiply-add latency: the last MR + r rows then go as two
      // tiles of about half that (32 rows, MR = 6: 6 6 6 6 4 4, not ... 6 2).
      const int64_t left = M - m0;
      int rows = static_cast<int>(min64(MR, left));
      if (left > MR && left < MR + MR / 2) rows = static_cast<int>((left + 1) / 2);
      const int64_t r0 = m0;
      m0 += rows;
      const T* init_m = init == GemmInit::kScaleRows || init == GemmInit::kBiasRows
                            ? init_values + r0
                            : init_values;
      for (int64_t k0 = 0;;) {
        const int64_t run = min64(Step::kRun, K - k0);
        const typename Step::A* a_tile = a + r0 * a_row + k0 * a_col;
        const GemmInit run_init = k0 == 0 ? init : GemmInit::kAddSum;
        if (kA != ALayout::kStrided && rows == MR)
          gemm_tile<MR, NV, kFullWidth, kA, Step>(run, a_tile, a_row, a_col, b + k0 * ldb, ldb,
                                                  c + r0 * ldc, ldc, n, run_init, init_m);
        else
          gemm_rows<MR, NV, kFullWidth, Step>(rows, run, a_tile, a_row, a_col, b + k0 * ldb,
                                              ldb, c + r0 * ldc, ldc, n, run_init, init_m);
        k0 += run;
        if (k0 >= K) break;
      }
    }
  }

  // gemm over panels NV vectors wide, MR rows at a time. kColumnMajor: full
  // panels on a column-major A (a_row == 1) take the tile of that layout
  // (gemm's own tiles, not gemm_wide's: the flash tile's P.V).
  template <int MR, int NV, class Step = FmaStep<Vec>,
            bool kColumnMajor = Vec::kColumnMajorTile && MR == Vec::kGemmRows &&
                                NV == kPanelVectors>
  static void gemm_panels(int64_t M, int64_t N, int64_t K, const typename Step::A* a,
                          int64_t a_row, int64_t a_col, const typename Step::B* b, int64_t ldb,
                          T* c, int64_t ldc, GemmInit init, const T* init_values) {
    constexpr int kWidth = NV * W;
    for (int64_t n0 = 0; n0 < N; n0 += kWidth) {
      const int n = static_cast<int>(min64(kWidth, N - n0));
      const T* init_n = init == GemmInit::kBiasColumns ? init_values + n0 : init_values;
      if (n == kWidth) {
        if constexpr (kColumnMajor) {
          if (a_row == 1) {
            gemm_panel<MR, NV, true, ALayout::kColumnMajor, Step>(
                M, K, a, a_row, a_col, b + n0, ldb, c + n0, ldc, n, init, init_n);
            continue;
          }
        }
        gemm_panel<MR, NV, true, ALayout::kStrided, Step>(M, K, a, a_row, a_col, b + n0, ldb,
                                                          c + n0, ldc, n, init, init_n);
      } else if (NV > 1 && n == W) {
        // A panel of one vector (a few queries, a head dim of 16): a tile one
        // vector wide spends no multiply-adds on the empty vectors, and holds
        // more rows (see kOneVectorRows). The sums go in the same order: the
        // same bits.
        constexpr int kRows = Vec::kOneVectorRows;
        if constexpr (kColumnMajor) {
          if (a_row == 1) {
            gemm_panel<kRows, 1, true, ALayout::kColumnMajor, Step>(
                M, K, a, a_row, a_col, b + n0, ldb, c + n0, ldc, n, init, init_n);
            continue;
          }
        }
        gemm_panel<kRows, 1, true, ALayout::kStrided, Step>(M, K, a, a_row, a_col, b + n0, ldb,
                                                            c + n0, ldc, n, init, init_n);
      } else {
        gemm_panel<MR, NV, false, ALayout::kStrided, Step>(M, K, a, a_row, a_col, b + n0, ldb,
                                                           c + n0, ldc, n, init, init_n);
      }
    }
  }

  static void gemm(int64_t M, int64_t N, int64_t K, const T* a, int64_t a_row, int64_t a_col,
                   const T* b, int64_t ldb, T* c, int64_t ldc, GemmInit init,
                   const T* init_values) {
    gemm_panels<Vec::kGemmRows, kPanelVectors>(M, N, K, a, a_row, a_col, b, ldb, c, ldc, init,
                                               init_values);
  }

  // The same with the ISA's wide register tile (where registers allow, 4-vector
  // panels and half the rows: fewer loads per multiply-add), for a B that is
  // wide and contiguous.
  static void gemm_wide(int64_t M, int64_t N, int64_t K, const T* a, int64_t a_row,
                        int64_t a_col, const T* b, int64_t ldb, T* c, int64_t ldc, GemmInit init,
                        const T* init_values) {
    gemm_panels<Vec::kWideRows, Vec::kWideVectors>(M, N, K, a, a_row, a_col, b, ldb, c, ldc, init,
                                                   init_values);
  }

  // The FMA peak the tiles aim at: kFmaProbeChains independent chains of
  // multiply-adds in registers.
  static T fma_probe(int64_t iterations) {
    V acc[kFmaProbeChains];
    for (int c = 0; c < kFmaProbeChains; ++c) acc[c] = Vec::set1(T(c));
    // x <- 0.999 x + 1 tends to 1000: no overflow, no subnormals.
    const V a = Vec::set1(T(0.999)), b = Vec::set1(T(1));
    for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < kFmaProbeChains; ++c) acc[c] = Vec::fmadd(acc[c], a, b);
    }
    V sum = acc[0];
    for (int c = 1; c < kFmaProbeChains; ++c) sum = Vec::add(sum, acc[c]);
    return Vec::reduce_add(sum);
  }
};

}  // namespace
}  // namespace attnx::simd
