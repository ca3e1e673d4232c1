// The kernels of one instruction set, written once over a vector type `Vec`
// (simd/vec_*.h) and instantiated by each kernels/<isa>/kernels__<isa>.cpp,
// which is compiled with that instruction set's flags. Include it nowhere
// else: the code must only ever be compiled for the ISA that runs it.
#pragma once

#include <cstdint>
#include <limits>

#include "kernels/kernel_table.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// Streaming row kernels (decoding reads every key and value once, from
// memory) prefetch rows of at least kPrefetchMinRowBytes, 8 rows ahead of
// their reads. Measured on a Zen 3 core, decoding B1 H32 S2048: with rows
// of 512 bytes (128 float32) the hardware prefetchers alone reached about
// 60% of the bandwidth a plain sum does, and prefetching 8 rows (4 KiB)
// ahead took 11-15% off the time (16 rows: about as much, 32: less); with
// rows of 256 bytes (B4 H12 S4096 D64) it added 3-9%, at 4 KiB ahead too.
// The kernels that read four rows at a time a vector of each (dot_rows, the
// scores) ask for the line of each row ahead as they load that vector, not
// for all the lines of four rows at once: a burst of requests fills the
// core's line fill buffers and stalls it. On a Xeon core the projections of
// one token through a 1024-wide layer (dot_rows over 16 MiB of weights)
// took 18% less time (13.5% on two cores), decoding B1 H32 L4 S4096 D128 3%.
constexpr int64_t kPrefetchMinRowBytes = 512;
constexpr int64_t kPrefetchRows = 8;

// How many rows of `dim` elements of P ahead a streaming kernel prefetches;
// 0: none.
template <typename P>
inline int64_t prefetch_distance(bool stream, int64_t dim) {
  return stream && dim * int64_t(sizeof(P)) >= kPrefetchMinRowBytes ? kPrefetchRows : 0;
}

// Asks for the cache lines of `rows` rows of `n` elements, `ld` apart.
template <typename P>
inline void prefetch_rows(const P* first, int64_t ld, int rows, int64_t n) {
#if defined(__GNUC__)
  const char* row = reinterpret_cast<const char*>(first);
  const int64_t bytes = n * int64_t(sizeof(P)), ld_bytes = ld * int64_t(sizeof(P));
  for (int r = 0; r < rows; ++r, row += ld_bytes)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
#else
  (void)first, (void)ld, (void)rows, (void)n;
#endif
}

// Asks for line k of `lines` (see LineRange).
inline void request_line(const LineRange& lines, int64_t k) {
#if defined(__GNUC__)
  const int64_t row = k / lines.row_lines, line = k - row * lines.row_lines;
  __builtin_prefetch(reinterpret_cast<const void*>(
      lines.first + uintptr_t(row * lines.ld_bytes) + uintptr_t(line * 64)));
#else
  (void)lines, (void)k;
#endif
}

// Register tile of gemm: MR rows x 2 vectors of C held in registers.
constexpr int kPanelVectors = 2;
// The longest run of k that one accumulator sums before its sum is folded
// into C: float32 rounding error grows with the length of a sum, and runs of
// 128 make a projection over E = 768 about as accurate as BLAS (x 1024 x 768
// times w^T: max error 5.1e-6 as one run, 1.1e-6 in runs, OpenBLAS 2.4e-6),
// for a fold of the tile into C (in L1) every 128 steps. gemm_panels
// calls the tile once per run, so that the tile's code holds no fold.
constexpr int64_t kSumRun = 128;

// Local min/max: a std:: template instantiated here could be merged by the
// linker with a copy compiled for another instruction set.
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }

// Whether gemm's A has unit row stride (a_row == 1), known when the tile is
// compiled: its broadcasts then address A from one pointer at constant
// offsets m, where two runtime strides take more address registers than
// x86-64 has and the k loop spills its counters. That is the flash tile's
// P.V, whose A is the probabilities, a column of queries per key: alone, one
// AVX-512 core, 193 -> 212 GFLOP/s; in the attention, 1-2% less time (B8 L128
// and L1024, median of 8 interleaved runs). (Row-major tiles for the scores,
// a_col == 1, were as fast alone and slower in the attention.)
enum class ALayout {
  kStrided,     // A(m, k) = a[m * a_row + k * a_col]
  kColumnMajor  // a_row == 1
};

template <class Vec>
struct Kernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
  static constexpr int NR = kPanelVectors * W;  // panel width
  static constexpr int kWideWidth = Vec::kWideVectors * W;  // gemm_wide's panel width
  static constexpr int QT = Vec::kQueryTileVectors * W;  // queries per flash tile
  static constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  // Accumulator vectors of the grouped P.V row kernel: 16 of 32 registers
  // (AVX-512), 8 of 16.
  static constexpr int kPvAccumulators = 4 * Vec::kRowGroup;
  // Keys per sub-block of the row kernels when their rows go in several
  // groups: each group passes over the sub-block's keys (or values) in turn,
  // and 16 KiB of them stay in L1 for the next group, where a whole block
  // (128 keys of 512 bytes: 64 KiB) came from L2 for each.
  template <typename P>
  static int64_t row_sub_block(int64_t dim) {
    const int64_t keys = (16 * 1024) / (dim * int64_t(sizeof(P)) + 1);
    return keys < 16 ? 16 : keys / 4 * 4;
  }

  // ---- gemm -------------------------------------------------------------
  // One MR x (NV * W) register tile: C tile = init + A(MR rows) . B(K x NV*W).
  // The accumulators are plain locals, never address-taken, so that they
  // stay in registers through the k loop. kA says whether A's row stride is
  // 1 (see ALayout).
  template <int MR, int NV, bool kFullWidth, ALayout kA = ALayout::kStrided>
  static void gemm_tile(int64_t K, const T* a, int64_t a_row, int64_t a_col, const T* b,
                        int64_t ldb, T* c, int64_t ldc, int n, GemmInit init,
                        const T* init_values) {
    // Lanes of each vector of a (possibly partial) row of the tile.
    int len[NV];
    for (int v = 0; v < NV; ++v) len[v] = kFullWidth ? W : imax(imin(n - v * W, W), 0);
    auto load_row = [len](const T* p, int v) {
      return kFullWidth ? Vec::load(p + v * W)
                        : (len[v] ? Vec::load_partial(p + v * W, len[v]) : Vec::zero());
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
    if constexpr (kA == ALayout::kStrided && MR >= 16 && MR % 4 == 0) {
      // Rows at a runtime stride, as MR / 4 pointers each read at 0, 1, 2
      // and 3 strides: one index register per row (the general loop below)
      // is more than x86-64 has, and the spilled indices cost more loads
      // than the tile's multiply-adds can hide.
      const T* quad[MR / 4];
#pragma GCC unroll 4
      for (int i = 0; i < MR / 4; ++i) quad[i] = a + 4 * i * a_row;
      const int64_t s1 = a_row, s2 = 2 * a_row, s3 = 3 * a_row;
#pragma GCC unroll 2
      for (int64_t k = 0; k < K; ++k) {
        const T* bk = b + k * ldb;
        V bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) bv[v] = load_row(bk, v);
        const int64_t ko = k * a_col;
#pragma GCC unroll 4
        for (int i = 0; i < MR / 4; ++i) {
          const T* p = quad[i] + ko;
          const V a0 = Vec::set1(p[0]), a1 = Vec::set1(p[s1]), a2 = Vec::set1(p[s2]),
                  a3 = Vec::set1(p[s3]);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) {
            acc[4 * i][v] = Vec::fmadd(a0, bv[v], acc[4 * i][v]);
            acc[4 * i + 1][v] = Vec::fmadd(a1, bv[v], acc[4 * i + 1][v]);
            acc[4 * i + 2][v] = Vec::fmadd(a2, bv[v], acc[4 * i + 2][v]);
            acc[4 * i + 3][v] = Vec::fmadd(a3, bv[v], acc[4 * i + 3][v]);
          }
        }
      }
    } else
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
      const T* bk = b + k * ldb;
      V bv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) bv[v] = load_row(bk, v);
      const T* ak = a + k * a_col;
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V am = Vec::set1(ak[m * (kA == ALayout::kColumnMajor ? 1 : a_row)]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = Vec::fmadd(am, bv[v], acc[m][v]);
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
  template <int MR, int NV, bool kFullWidth>
  static void gemm_rows(int rows, int64_t K, const T* a, int64_t a_row, int64_t a_col,
                        const T* b, int64_t ldb, T* c, int64_t ldc, int n, GemmInit init,
                        const T* init_values) {
    if constexpr (MR > 1) {
      if (rows < MR)
        return gemm_rows<MR - 1, NV, kFullWidth>(rows, K, a, a_row, a_col, b, ldb, c, ldc, n,
                                                 init, init_values);
    }
    gemm_tile<MR, NV, kFullWidth>(K, a, a_row, a_col, b, ldb, c, ldc, n, init, init_values);
  }

  // One panel of C (n columns from c, B's from b, init_values offset to the
  // panel's columns) MR rows at a time, each row tile over k in runs of
  // kSumRun: the first run starts C as `init` says, each later one sums from
  // zero and adds to C.
  // Tiles of MR rows take the layout kA; the last, shorter ones the general
  // tile.
  template <int MR, int NV, bool kFullWidth, ALayout kA = ALayout::kStrided>
  static void gemm_panel(int64_t M, int64_t K, const T* a, int64_t a_row, int64_t a_col,
                         const T* b, int64_t ldb, T* c, int64_t ldc, int n, GemmInit init,
                         const T* init_values) {
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
        const int64_t run = min64(kSumRun, K - k0);
        const T* a_tile = a + r0 * a_row + k0 * a_col;
        const GemmInit run_init = k0 == 0 ? init : GemmInit::kAddSum;
        if (kA != ALayout::kStrided && rows == MR)
          gemm_tile<MR, NV, kFullWidth, kA>(run, a_tile, a_row, a_col, b + k0 * ldb, ldb,
                                            c + r0 * ldc, ldc, n, run_init, init_m);
        else
          gemm_rows<MR, NV, kFullWidth>(rows, run, a_tile, a_row, a_col, b + k0 * ldb, ldb,
                                        c + r0 * ldc, ldc, n, run_init, init_m);
        k0 += run;
        if (k0 >= K) break;
      }
    }
  }

  // gemm over panels NV vectors wide, MR rows at a time.
  template <int MR, int NV>
  static void gemm_panels(int64_t M, int64_t N, int64_t K, const T* a, int64_t a_row,
                          int64_t a_col, const T* b, int64_t ldb, T* c, int64_t ldc,
                          GemmInit init, const T* init_values) {
    constexpr int kWidth = NV * W;
    for (int64_t n0 = 0; n0 < N; n0 += kWidth) {
      const int n = static_cast<int>(min64(kWidth, N - n0));
      const T* init_n = init == GemmInit::kBiasColumns ? init_values + n0 : init_values;
      if (n == kWidth) {
        // gemm's own tile (not gemm_wide's) on a column-major A: the flash
        // tile's P.V.
        if constexpr (Vec::kColumnMajorTile && MR == Vec::kGemmRows && NV == kPanelVectors) {
          if (a_row == 1) {
            gemm_panel<MR, NV, true, ALayout::kColumnMajor>(M, K, a, a_row, a_col, b + n0, ldb,
                                                            c + n0, ldc, n, init, init_n);
            continue;
          }
        }
        gemm_panel<MR, NV, true>(M, K, a, a_row, a_col, b + n0, ldb, c + n0, ldc, n, init,
                                 init_n);
      } else if (NV > 1 && n == W) {
        // A panel of one vector (a few queries, a head dim of 16): a tile one
        // vector wide spends no multiply-adds on the empty vectors, and holds
        // more rows (see kOneVectorRows). The sums go in the same order: the
        // same bits.
        constexpr int kRows = Vec::kOneVectorRows;
        if constexpr (Vec::kColumnMajorTile && MR == Vec::kGemmRows && NV == kPanelVectors) {
          if (a_row == 1) {
            gemm_panel<kRows, 1, true, ALayout::kColumnMajor>(M, K, a, a_row, a_col, b + n0, ldb,
                                                              c + n0, ldc, n, init, init_n);
            continue;
          }
        }
        gemm_panel<kRows, 1, true>(M, K, a, a_row, a_col, b + n0, ldb, c + n0, ldc, n, init,
                                   init_n);
      } else {
        gemm_panel<MR, NV, false>(M, K, a, a_row, a_col, b + n0, ldb, c + n0, ldc, n, init,
                                  init_n);
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

  // ---- online softmax over a (keys x QT queries) tile --------------------
  // e^(s - m) is computed as 2^((s - m) log2 e): the difference is taken
  // first, in natural units, so a large mask value added to the scores
  // (-1e4 is common) costs no precision; exp2 then needs no range reduction.
  static void softmax_tile(T* s, int64_t rows, int lanes, T* m, T* l, T* alpha,
                           const LineRequests& ahead) {
    if (lanes == QT) return softmax_lanes<Vec::kQueryTileVectors>(s, rows, 0, m, l, alpha, &ahead);
    for (int lane0 = 0; lane0 < lanes; lane0 += W)
      softmax_lanes<1>(s, rows, lane0, m, l, alpha, lane0 == 0 ? &ahead : nullptr);
  }

  // softmax_tile for NV vectors of lanes from lane0. The vectors go side by
  // side through each key row: their running maxima and sums are NV
  // independent chains, where one vector at a time waits on the latency of
  // each max and add (the same operations in the same order per lane: the
  // same bits).
  template <int NV>
  static void softmax_lanes(T* s, int64_t rows, int lane0, T* m, T* l, T* alpha,
                            const LineRequests* ahead) {
    // Step 1: the new running max of each query (NaN scores ignored), in
    // kMaxChains independent chains of rows, merged at the end: one chain
    // would wait a max's latency per row, and nothing else can run until
    // the max is known. The maximum is the same in any order (up to the sign
    // of a zero maximum, which no exp below can see).
    constexpr int kMaxChains = 4;
    V block_max[kMaxChains][NV];
#pragma GCC unroll 4
    for (int c = 0; c < kMaxChains; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) block_max[c][v] = Vec::set1(kNegInf);
    int64_t j = 0;
    for (; j + kMaxChains <= rows; j += kMaxChains) {
#pragma GCC unroll 4
      for (int c = 0; c < kMaxChains; ++c) {
        const T* sj = s + (j + c) * QT + lane0;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          block_max[c][v] = Vec::max_ignoring_nan(block_max[c][v], Vec::load(sj + v * W));
      }
    }
    for (; j < rows; ++j) {
      const T* sj = s + j * QT + lane0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        block_max[0][v] = Vec::max_ignoring_nan(block_max[0][v], Vec::load(sj + v * W));
    }
#pragma GCC unroll 4
    for (int c = 1; c < kMaxChains; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        block_max[0][v] = Vec::max_ignoring_nan(block_max[0][v], block_max[c][v]);
    V m_old[NV], shift[NV], sum[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      m_old[v] = Vec::load(m + lane0 + v * W);
      const V m_new = Vec::max_ignoring_nan(m_old[v], block_max[0][v]);
      Vec::store(m + lane0 + v * W, m_new);
      // 0 replaces a -inf max.
      shift[v] = Vec::exp_shift(m_new);
      sum[v] = Vec::zero();
    }
    // Step 2: exponentiate against it, summing; per row, a line of each
    // range of `ahead`.
    const int64_t requests0 = ahead ? min64(rows, ahead->ranges[0].size()) : 0;
    const int64_t requests1 = ahead ? min64(rows, ahead->ranges[1].size()) : 0;
    const V log2e = Vec::set1(T(1.4426950408889634073599246810018921L));
    for (int64_t j = 0; j < rows; ++j) {
      if (j < requests0) request_line(ahead->ranges[0], ahead->ranges[0].begin + j);
      if (j < requests1) request_line(ahead->ranges[1], ahead->ranges[1].begin + j);
      T* sj = s + j * QT + lane0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const V p =
            Vec::exp2_nonpositive(Vec::mul(Vec::sub(Vec::load(sj + v * W), shift[v]), log2e));
        Vec::store(sj + v * W, p);
        sum[v] = Vec::add(sum[v], p);
      }
    }
    // Step 3: rescale factor of what was accumulated, and the new sums.
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const V a = Vec::exp2_nonpositive(Vec::mul(Vec::sub(m_old[v], shift[v]), log2e));
      Vec::store(alpha + lane0 + v * W, a);
      Vec::store(l + lane0 + v * W, Vec::fmadd(a, Vec::load(l + lane0 + v * W), sum[v]));
    }
  }

  static void add_mask_sums(T* s, const T* sums, int64_t keys, int64_t ld, int lanes,
                            T* closed) {
    for (int lane0 = 0; lane0 < lanes; lane0 += W) {
      V count = Vec::zero();
      for (int64_t j = 0; j < keys; ++j) {
        const V sum = Vec::load(sums + j * ld + lane0);
        T* sj = s + j * ld + lane0;
        Vec::store(sj, Vec::add_unless_closed(Vec::load(sj), sum));
        count = Vec::add(count, Vec::closed_indicator(sum));
      }
      Vec::store(closed + lane0, count);
    }
  }

  // ---- row kernels ---------------------------------------------------------
  // Loads of stored elements as vectors of T: T itself, or 16-bit floats
  // (float16, bfloat16) widened on the way in.
  enum class Stored { kNative, kFloat16, kBfloat16 };
  template <Stored kSrc, typename P>
  static V load_stored(const P* p) {
    if constexpr (kSrc == Stored::kFloat16)
      return Vec::load_widen_f16(p);
    else if constexpr (kSrc == Stored::kBfloat16)
      return Vec::load_widen_bf16(p);
    else
      return Vec::load(p);
  }
  template <Stored kSrc, typename P>
  static V load_stored_partial(const P* p, int n) {
    if constexpr (kSrc == Stored::kFloat16)
      return Vec::load_widen_f16_partial(p, n);
    else if constexpr (kSrc == Stored::kBfloat16)
      return Vec::load_widen_bf16_partial(p, n);
    else
      return Vec::load_partial(p, n);
  }

  // scores for R query rows against the keys: each key vector is loaded
  // once for the R rows, and R x 4 sums run side by side (one row's four
  // chains alone wait on the multiply-add latency). Each (row, key) sum is
  // taken in the same order whatever R is, so a row's scores do not depend
  // on the rows it is grouped with.
  template <Stored kSrc, typename P, int R>
  static void scores_group(const T* const* q, const P* k, int64_t ldk, int64_t n_keys,
                           int64_t dim, T scale, T* const* dst, int64_t ahead,
                           int64_t prefetch_end) {
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      const P* kr[4] = {k + j * ldk, k + (j + 1) * ldk, k + (j + 2) * ldk, k + (j + 3) * ldk};
      const P* ka = ahead && j + ahead + 4 <= prefetch_end ? kr[0] + ahead * ldk : nullptr;
      V acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = Vec::zero();
      int64_t i = 0;
      for (; i + W <= dim; i += W) {
        V kv[4];
#if defined(__GNUC__)
        if (ka)
          for (int u = 0; u < 4; ++u) __builtin_prefetch(ka + u * ldk + i);
#endif
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          kv[u] = load_stored<kSrc>(kr[u] + i);
          // Held in a register for the R rows, where GCC would load it
          // again as an operand of each row's multiply-add (AVX2, D128, one
          // core, B1 H8 L4-L8 S1024: 8-9% less time; grouped heads decoding
          // from memory, B1 H32/8 S4096, 3% more).
          if constexpr (R > 1) Vec::hold(kv[u]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const V qi = Vec::load(q[r] + i);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = Vec::fmadd(qi, kv[u], acc[r][u]);
        }
      }
      if (i < dim) {
        const int len = static_cast<int>(dim - i);
        V kv[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) kv[u] = load_stored_partial<kSrc>(kr[u] + i, len);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const V qi = Vec::load_partial(q[r] + i, len);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = Vec::fmadd(qi, kv[u], acc[r][u]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        T sums[4];
        Vec::reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) dst[r][j + u] = scale * sums[u];
      }
    }
    for (; j < n_keys; ++j) {
      const P* kj = k + j * ldk;
      V acc[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = Vec::zero();
      for (int64_t i = 0; i < dim; i += W) {
        const int len = static_cast<int>(min64(W, dim - i));
        const V kv = load_stored_partial<kSrc>(kj + i, len);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = Vec::fmadd(Vec::load_partial(q[r] + i, len), kv, acc[r]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) dst[r][j] = scale * Vec::reduce_add(acc[r]);
    }
  }

  // dst[r][j] = scale * <q[r], k_j> for r < rows, j < n_keys, kRowGroup rows
  // at a time; only the first group streams the keys (the others find them
  // in cache). With more rows than one group, the keys go in sub-blocks that
  // stay in L1 for every group (see row_sub_block).
  template <Stored kSrc, typename P>
  static void scores_of(const T* const* q, int rows, const P* k, int64_t ldk, int64_t n_keys,
                        int64_t dim, T scale, T* const* dst, bool stream) {
    const int64_t ahead = prefetch_distance<P>(stream, dim);
    const int64_t sub = rows > Vec::kRowGroup ? row_sub_block<P>(dim) : n_keys;
    for (int64_t j0 = 0; j0 < n_keys; j0 += sub) {
      const int64_t n = min64(sub, n_keys - j0);
      const P* k0 = k + j0 * ldk;
      for (int r0 = 0; r0 < rows; r0 += Vec::kRowGroup) {
        const int count = imin(rows - r0, Vec::kRowGroup);
        T* d[Vec::kRowGroup];
        for (int i = 0; i < count; ++i) d[i] = dst[r0 + i] + j0;
        const T* const* qg = q + r0;
        const int64_t a = r0 == 0 ? ahead : 0, end = n_keys - j0;
        switch (count) {
          case 1: scores_group<kSrc, P, 1>(qg, k0, ldk, n, dim, scale, d, a, end); break;
          case 2: scores_group<kSrc, P, 2>(qg, k0, ldk, n, dim, scale, d, a, end); break;
          case 3:
            if constexpr (Vec::kRowGroup >= 3)
              scores_group<kSrc, P, 3>(qg, k0, ldk, n, dim, scale, d, a, end);
            break;
          default:
            if constexpr (Vec::kRowGroup >= 4)
              scores_group<kSrc, P, 4>(qg, k0, ldk, n, dim, scale, d, a, end);
            break;
        }
      }
    }
  }

  // dot_rows for R rows of x, 4 rows of w at a time: each vector of a w row
  // is loaded once for the R rows, each of x once for the 4 rows of w.
  template <int R>
  static void dot_rows_of(const T* const* x, const T* w, int64_t ldw, int64_t n, int64_t dim,
                          T* const* y) {
    const int64_t ahead = prefetch_distance<T>(true, dim);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* wj = w + j * ldw;
      const T* wa = ahead && j + ahead + 4 <= n ? wj + ahead * ldw : nullptr;
      V acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = Vec::zero();
      for (int64_t i = 0; i < dim; i += W) {
        const int len = static_cast<int>(min64(W, dim - i));
        V wv[4], xv[R];
#if defined(__GNUC__)
        if (wa)
          for (int u = 0; u < 4; ++u) __builtin_prefetch(wa + u * ldw + i);
#endif
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          wv[u] = len == W ? Vec::load(wj + u * ldw + i) : Vec::load_partial(wj + u * ldw + i, len);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          xv[r] = len == W ? Vec::load(x[r] + i) : Vec::load_partial(x[r] + i, len);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) acc[r][u] = Vec::fmadd(xv[r], wv[u], acc[r][u]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) y[r][j + u] = Vec::reduce_add(acc[r][u]);
    }
    for (; j < n; ++j) {
      const T* wj = w + j * ldw;
      V acc[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = Vec::zero();
      for (int64_t i = 0; i < dim; i += W) {
        const int len = static_cast<int>(min64(W, dim - i));
        const V wv = Vec::load_partial(wj + i, len);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = Vec::fmadd(Vec::load_partial(x[r] + i, len), wv, acc[r]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) y[r][j] = Vec::reduce_add(acc[r]);
    }
  }

  static void dot_rows(const T* const* x, int rows, const T* w, int64_t ldw, int64_t n,
                       int64_t dim, T* const* y) {
    for (int r0 = 0; r0 < rows; r0 += kDotRowsMax) {
      switch (imin(rows - r0, kDotRowsMax)) {
        case 1: dot_rows_of<1>(x + r0, w, ldw, n, dim, y + r0); break;
        case 2: dot_rows_of<2>(x + r0, w, ldw, n, dim, y + r0); break;
        case 3: dot_rows_of<3>(x + r0, w, ldw, n, dim, y + r0); break;
        default: dot_rows_of<4>(x + r0, w, ldw, n, dim, y + r0); break;
      }
    }
  }

  static void scores(const T* const* q, int rows, const T* k, int64_t ldk, int64_t n_keys,
                     int64_t dim, T scale, T* const* dst, bool stream) {
    scores_of<Stored::kNative>(q, rows, k, ldk, n_keys, dim, scale, dst, stream);
  }

  // accumulate_pv_group's pass over the keys for columns [d0, d0 + NV W) of
  // the accumulators; v points at column d0 of the first value row.
  template <Stored kSrc, typename P, int R, int NV>
  static void accumulate_pv_chunk(const T* const* p, const P* v, int64_t ldv, int64_t n_keys,
                                  T* const* acc, int64_t d0, int64_t ahead, int64_t prefetch_end) {
    V a[R][NV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) a[r][u] = Vec::load(acc[r] + d0 + u * W);
    for (int64_t j = 0; j < n_keys; ++j) {
      const P* vj = v + j * ldv;
      if (ahead && j + ahead < prefetch_end) prefetch_rows(vj + ahead * ldv, ldv, 1, NV * W);
      V vv[NV];
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) {
        vv[u] = load_stored<kSrc>(vj + u * W);
        // Loaded once for the R rows (see scores_group).
        if constexpr (R > 1) Vec::hold(vv[u]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const V pj = Vec::set1(p[r][j]);
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u) a[r][u] = Vec::fmadd(pj, vv[u], a[r][u]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) Vec::store(acc[r] + d0 + u * W, a[r][u]);
  }

  // The longest value row whose accumulator stays in registers (one row).
  static constexpr int64_t kLongestRowInRegisters = 8 * W;

  // accumulate_pv_group for rows longer than the registers hold: rather
  // than one pass over the keys per chunk of the row (each reading part of
  // every value row, a strided stream), one pass reading whole rows, with
  // the R accumulators in L1, four keys at a time: each vector of an
  // accumulator is loaded and stored once per four keys, each value vector
  // loaded once for the R rows, so that a multiply-add costs (1 + R) / 4R
  // loads and 1/4 of a store. (The rows one at a time, two keys at a time,
  // took a load per multiply-add and a store per two, and the stores bound
  // them: AVX2, D128, one core, B1 H2 L8 S1024 took 14-18% less time, H8
  // L8 S1024 12-17% less, H8 L4 18% less.) A row alone, decoding from
  // memory, keeps to two keys at a time: with four, each burst of requests
  // ahead doubles, and B1 H32 L1 S2048 took 6-8% more time.
  template <Stored kSrc, typename P, int R>
  static void accumulate_pv_in_l1(const T* const* p, const P* v, int64_t ldv, int64_t n_keys,
                                  int64_t dim, T* const* acc, int64_t ahead,
                                  int64_t prefetch_end) {
    constexpr int kKeys = R == 1 ? 2 : 4;
    // The rows' pointers in locals: GCC cannot tell that the stores into
    // the accumulators leave acc[] as it was, and would load acc[r] again
    // for every vector.
    T* out[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[r] = acc[r];
    int64_t j = 0;
    for (; j + kKeys <= n_keys; j += kKeys) {
      V pk[R][kKeys];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < kKeys; ++u) pk[r][u] = Vec::set1(p[r][j + u]);
      const P* vj = v + j * ldv;
      if (ahead && j + ahead + kKeys <= prefetch_end)
        prefetch_rows(vj + ahead * ldv, ldv, kKeys, dim);
      for (int64_t d = 0; d < dim; d += W) {
        V vv[kKeys];
#pragma GCC unroll 4
        for (int u = 0; u < kKeys; ++u) vv[u] = load_stored<kSrc>(vj + u * ldv + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          V a = Vec::load(out[r] + d);
#pragma GCC unroll 4
          for (int u = 0; u < kKeys; ++u) a = Vec::fmadd(pk[r][u], vv[u], a);
          Vec::store(out[r] + d, a);
        }
      }
    }
    for (; j < n_keys; ++j) {
      const P* vj = v + j * ldv;
      V pj[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) pj[r] = Vec::set1(p[r][j]);
      for (int64_t d = 0; d < dim; d += W) {
        const V vv = load_stored<kSrc>(vj + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          Vec::store(out[r] + d, Vec::fmadd(pj[r], vv, Vec::load(out[r] + d)));
      }
    }
  }

  // accumulate_pv for R rows: each value vector is loaded once for the R
  // rows. Every element takes fma(p_j, v_j, acc) in key order, whatever R
  // and the chunking: the same sums to the bit.
  template <Stored kSrc, typename P, int R>
  static void accumulate_pv_group(const T* const* p, const P* v, int64_t ldv, int64_t n_keys,
                                  int64_t dim, T* const* acc, int64_t ahead, int64_t prefetch_end) {
    // Up to 8 vectors of one row's accumulator stay in registers across the
    // keys, so a value row of up to 8W elements is streamed once; R rows
    // keep kPvAccumulators / R vectors each (the value vectors take most of
    // the other registers), a pass over the keys per chunk of that many.
    constexpr int kVectors = R == 1 ? 8 : kPvAccumulators / R;
    constexpr int kChunk = kVectors * W;
    if (dim > kLongestRowInRegisters && dim % W == 0) {
      accumulate_pv_in_l1<kSrc, P, R>(p, v, ldv, n_keys, dim, acc, ahead, prefetch_end);
      return;
    }
    for (int64_t d0 = 0; d0 < dim; d0 += kChunk) {
      const int len = static_cast<int>(min64(kChunk, dim - d0));
      // A whole chunk, or half of one (a head dim of 64 in a chunk of 128):
      // straight-line code, the accumulators in registers (the general form
      // below keeps them on the stack).
      if (len == kChunk) {
        accumulate_pv_chunk<kSrc, P, R, kVectors>(p, v + d0, ldv, n_keys, acc, d0, ahead,
                                                  prefetch_end);
        continue;
      }
      if constexpr (kVectors % 2 == 0) {
        if (len == kChunk / 2) {
          accumulate_pv_chunk<kSrc, P, R, kVectors / 2>(p, v + d0, ldv, n_keys, acc, d0, ahead,
                                                        prefetch_end);
          continue;
        }
      }
      const int full = len / W, tail = len % W;
      V a[R][kVectors];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < kVectors; ++u)
          a[r][u] = u < full ? Vec::load(acc[r] + d0 + u * W)
                             : (u == full && tail ? Vec::load_partial(acc[r] + d0 + u * W, tail)
                                                  : Vec::zero());
      for (int64_t j = 0; j < n_keys; ++j) {
        const P* vj = v + j * ldv + d0;
        if (ahead && j + ahead < prefetch_end) prefetch_rows(vj + ahead * ldv, ldv, 1, len);
        V vv[kVectors];
#pragma GCC unroll 8
        for (int u = 0; u < kVectors; ++u)
          vv[u] = u < full ? load_stored<kSrc>(vj + u * W)
                           : (u == full && tail ? load_stored_partial<kSrc>(vj + u * W, tail)
                                                : Vec::zero());
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const V pj = Vec::set1(p[r][j]);
#pragma GCC unroll 8
          for (int u = 0; u < kVectors; ++u)
            if (u < full || (u == full && tail)) a[r][u] = Vec::fmadd(pj, vv[u], a[r][u]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int u = 0; u < kVectors; ++u)
          if (u < full) Vec::store(acc[r] + d0 + u * W, a[r][u]);
        if (tail) Vec::store_partial(acc[r] + d0 + full * W, a[r][full], tail);
      }
    }
  }

  // acc[r][:dim] += sum_j p[r][j] * v_j over j < n_keys for r < rows,
  // as many rows at a time (up to kRowGroup) as hold a whole value row in
  // registers, so that each group reads every value row in one pass; only
  // the first group streams the values (the others find them in cache, in
  // sub-blocks that stay in L1 where there is more than one group).
  template <Stored kSrc, typename P>
  static void accumulate_pv_of(const T* const* p, int rows, const P* v, int64_t ldv,
                               int64_t n_keys, int64_t dim, T* const* acc, bool stream) {
    const int64_t ahead = prefetch_distance<P>(stream, dim);
    const int64_t vectors = (dim + W - 1) / W;
    // As many rows as hold their whole accumulators in registers together,
    // or, for rows longer than that, kRowGroup rows with theirs in L1.
    const int fit = static_cast<int>(min64(kPvAccumulators, kPvAccumulators / vectors));
    const int group = dim > kLongestRowInRegisters && dim % W == 0
                          ? Vec::kRowGroup
                          : imax(1, imin(Vec::kRowGroup, fit));
    const int64_t sub = rows > group ? row_sub_block<P>(dim) : n_keys;
    for (int64_t j0 = 0; j0 < n_keys; j0 += sub) {
      const int64_t n = min64(sub, n_keys - j0);
      const P* v0 = v + j0 * ldv;
      for (int r0 = 0; r0 < rows; r0 += group) {
        const int count = imin(rows - r0, group);
        const T* pg[Vec::kRowGroup];
        for (int i = 0; i < count; ++i) pg[i] = p[r0 + i] + j0;
        T* const* ag = acc + r0;
        const int64_t a = r0 == 0 ? ahead : 0, end = n_keys - j0;
        switch (count) {
          case 1: accumulate_pv_group<kSrc, P, 1>(pg, v0, ldv, n, dim, ag, a, end); break;
          case 2: accumulate_pv_group<kSrc, P, 2>(pg, v0, ldv, n, dim, ag, a, end); break;
          case 3:
            if constexpr (Vec::kRowGroup >= 3)
              accumulate_pv_group<kSrc, P, 3>(pg, v0, ldv, n, dim, ag, a, end);
            break;
          default:
            if constexpr (Vec::kRowGroup >= 4)
              accumulate_pv_group<kSrc, P, 4>(pg, v0, ldv, n, dim, ag, a, end);
            break;
        }
      }
    }
  }

  static void accumulate_pv(const T* const* p, int rows, const T* v, int64_t ldv,
                            int64_t n_keys, int64_t dim, T* const* acc, bool stream) {
    accumulate_pv_of<Stored::kNative>(p, rows, v, ldv, n_keys, dim, acc, stream);
  }

  static T row_max(const T* x, int64_t n) {
    // A lane never holds NaN (max_ignoring_nan keeps the running value), so
    // the lanes' maximum is the row's; it is the same in any order.
    V m = Vec::set1(kNegInf);
    int64_t j = 0;
    for (; j + W <= n; j += W) m = Vec::max_ignoring_nan(m, Vec::load(x + j));
    T best = Vec::reduce_max(m);
    for (; j < n; ++j) best = x[j] > best ? x[j] : best;
    return best;
  }

  static T exp_shift_sum(T* x, int64_t n, T shift) {
    const V s = Vec::set1(shift);
    V sum = Vec::zero();
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const V p = Vec::exp(Vec::sub(Vec::load(x + j), s));
      Vec::store(x + j, p);
      sum = Vec::add(sum, p);
    }
    if (j < n) {
      // The tail is padded with -inf, whose exp adds exactly 0 to the sum.
      T tail[W];
      const int len = static_cast<int>(n - j);
      for (int t = 0; t < W; ++t) tail[t] = t < len ? x[j + t] : kNegInf;
      const V p = Vec::exp(Vec::sub(Vec::load(tail), s));
      Vec::store_partial(x + j, p, len);
      sum = Vec::add(sum, p);
    }
    return Vec::reduce_add(sum);
  }

  static void scale(const T* x, int64_t n, T alpha, T* y) {
    const V a = Vec::set1(alpha);
    int64_t j = 0;
    for (; j + W <= n; j += W) Vec::store(y + j, Vec::mul(Vec::load(x + j), a));
    if (j < n) {
      const int len = static_cast<int>(n - j);
      Vec::store_partial(y + j, Vec::mul(Vec::load_partial(x + j, len), a), len);
    }
  }

  static void scale_columns(T* x, int64_t rows, int64_t ld, int64_t cols, const T* factors) {
    for (int64_t j = 0; j < cols; j += W) {
      const V f = Vec::load(factors + j);
      for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * ld + j;
        Vec::store(xr, Vec::mul(Vec::load(xr), f));
      }
    }
  }

  // dst[c * lanes + r] = scale * src[r * ld + c] for r < rows, c < cols, and
  // 0 for rows <= r < lanes (a multiple of W): W x W blocks transposed in
  // registers.
  static void pack_transposed(const T* src, int64_t ld, int64_t rows, int64_t cols, T scale,
                              T* dst, int64_t lanes) {
    const V s = Vec::set1(scale);
    for (int64_t r0 = 0; r0 < lanes; r0 += W) {
      if (r0 >= rows) {  // padding lanes only
        for (int64_t c = 0; c < cols; ++c) Vec::store(dst + c * lanes + r0, Vec::zero());
        continue;
      }
      const T* src_rows = src + r0 * ld;
      int64_t c0 = 0;
      if (r0 + W <= rows) {
        // Whole blocks: straight-line loads, transpose and stores.
        for (; c0 + W <= cols; c0 += W) {
          V block[W];
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) block[i] = Vec::mul(Vec::load(src_rows + i * ld + c0), s);
          Vec::transpose(block);
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) Vec::store(dst + (c0 + i) * lanes + r0, block[i]);
        }
      }
      for (; c0 < cols; c0 += W) {
        const int width = static_cast<int>(min64(W, cols - c0));
        V block[W];
        for (int i = 0; i < W; ++i)
          block[i] = r0 + i < rows
                         ? Vec::mul(width == W ? Vec::load(src + (r0 + i) * ld + c0)
                                               : Vec::load_partial(src + (r0 + i) * ld + c0, width),
                                    s)
                         : Vec::zero();
        Vec::transpose(block);
        for (int i = 0; i < width; ++i) Vec::store(dst + (c0 + i) * lanes + r0, block[i]);
      }
    }
  }

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

  static bool all_finite(const T* x, int64_t n) {
    // x * 0 is 0 for a finite x and NaN for NaN and +-inf.
    V probe = Vec::zero();
    const V zero = Vec::zero();
    int64_t j = 0;
    for (; j + W <= n; j += W) probe = Vec::fmadd(Vec::load(x + j), zero, probe);
    if (j < n) probe = Vec::fmadd(Vec::load_partial(x + j, static_cast<int>(n - j)), zero, probe);
    return Vec::reduce_add(probe) == T(0);
  }

  static int block_state(const T* x, int64_t ld, int64_t rows, int64_t cols) {
    constexpr uint32_t kAllLanes = (uint32_t(1) << W) - 1;
    const V zero = Vec::zero(), closed = Vec::set1(kNegInf);
    // Lanes past a row's end count as both; a row is checked whole, so that
    // the loop holds no branch but the row's.
    const int tail = static_cast<int>(cols % W);
    const uint32_t past_end = tail ? kAllLanes & ~((uint32_t(1) << tail) - 1) : 0;
    uint32_t all_zero = kAllLanes, all_closed = kAllLanes;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * ld;
      int64_t c = 0;
      for (; c + W <= cols; c += W) {
        const V v = Vec::load(row + c);
        all_zero &= Vec::equal_lanes(v, zero);
        all_closed &= Vec::equal_lanes(v, closed);
      }
      if (tail) {
        const V v = Vec::load_partial(row + c, tail);
        all_zero &= Vec::equal_lanes(v, zero) | past_end;
        all_closed &= Vec::equal_lanes(v, closed) | past_end;
      }
      if (all_zero != kAllLanes && all_closed != kAllLanes) return 0;
    }
    return (all_zero == kAllLanes ? kBlockAllZero : 0) |
           (all_closed == kAllLanes ? kBlockAllClosed : 0);
  }

  // ---- widening of 16-bit storage (float vectors only) -------------------
  // dst[i] = src[i] widened to float, W at a time; the tail by a partial load
  // and store, so nothing past src[n-1] is read or past dst[n-1] written.
  template <bool kBfloat16>
  static void widen(const uint16_t* src, int64_t n, T* dst) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      if constexpr (kBfloat16)
        Vec::store(dst + i, Vec::load_widen_bf16(src + i));
      else
        Vec::store(dst + i, Vec::load_widen_f16(src + i));
    }
    if (i < n) {
      const int len = static_cast<int>(n - i);
      if constexpr (kBfloat16)
        Vec::store_partial(dst + i, Vec::load_widen_bf16_partial(src + i, len), len);
      else
        Vec::store_partial(dst + i, Vec::load_widen_f16_partial(src + i, len), len);
    }
  }
  static void widen_float16(const uint16_t* src, int64_t n, float* dst) {
    widen<false>(src, n, dst);
  }
  static void widen_bfloat16(const uint16_t* src, int64_t n, float* dst) {
    widen<true>(src, n, dst);
  }

  static KernelTable<T> table(const char* name, Isa isa) {
    KernelTable<T> t{name,   isa,  W,      QT,     NR, kWideWidth,
                     gemm,   softmax_tile, add_mask_sums, scores, accumulate_pv,
                     exp_shift_sum, row_max,      scale,         scale_columns, block_state,
                     all_finite,
                     dot_rows,
                     pack_transposed, gemm_wide, fma_probe, nullptr, nullptr,
                     {nullptr, nullptr}, {nullptr, nullptr}};
    if constexpr (Vec::kWidens16) {
      t.widen_float16 = widen_float16;
      t.widen_bfloat16 = widen_bfloat16;
      t.scores_16bit[0] = scores_of<Stored::kFloat16, uint16_t>;
      t.scores_16bit[1] = scores_of<Stored::kBfloat16, uint16_t>;
      t.accumulate_pv_16bit[0] = accumulate_pv_of<Stored::kFloat16, uint16_t>;
      t.accumulate_pv_16bit[1] = accumulate_pv_of<Stored::kBfloat16, uint16_t>;
    }
    return t;
  }
};

}  // namespace
}  // namespace attnx::simd
