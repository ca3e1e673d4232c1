// Row kernels of one instruction set, over a vector type `Vec`: a few query
// rows against many keys (decoding), each key or value row read once for
// several queries, and the projections of a few rows (dot_rows).
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

// Whether Vec reduces four rows' four sums at once (reduce_add4x4).
template <class Vec, class = void>
struct HasReduce4x4 : std::false_type {};
template <class Vec>
struct HasReduce4x4<Vec, std::void_t<decltype(&Vec::reduce_add4x4)>> : std::true_type {};

// Loads: what loads the stored keys and values (Vec, or a type that rounds
// them as it loads them: bf16_kernels.h).
template <class Vec, class Loads = Vec>
struct RowKernels {
  using T = typename Vec::T;
  using V = typename Vec::V;
  static constexpr int W = Vec::W;
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

  // Loads of stored elements as vectors of T: T itself, 16-bit floats
  // (float16, bfloat16) or int8 widened on the way in. An int8 row's scale
  // is applied to what the row is multiplied with (see scaled).
  enum class Stored { kNative, kFloat16, kBfloat16, kInt8 };
  template <Stored kSrc, typename P>
  static V load_stored(const P* p) {
    if constexpr (kSrc == Stored::kInt8)
      return Loads::load_widen_i8(p);
    else if constexpr (kSrc == Stored::kFloat16)
      return Loads::load_widen_f16(p);
    else if constexpr (kSrc == Stored::kBfloat16)
      return Loads::load_bf16_operand(p);
    else
      return Loads::load(p);
  }
  template <Stored kSrc, typename P>
  static V load_stored_partial(const P* p, int n) {
    if constexpr (kSrc == Stored::kInt8)
      return Loads::load_widen_i8_partial(p, n);
    else if constexpr (kSrc == Stored::kFloat16)
      return Loads::load_widen_f16_partial(p, n);
    else if constexpr (kSrc == Stored::kBfloat16)
      return Loads::load_bf16_operand_partial(p, n);
    else
      return Loads::load_partial(p, n);
  }

  // x times row j's scale for int8 storage (row_scales[j]); x otherwise.
  template <Stored kSrc>
  static T scaled(const float* row_scales, int64_t j, T x) {
    if constexpr (kSrc == Stored::kInt8)
      return row_scales[j] * x;
    else
      return (void)row_scales, (void)j, x;
  }

  // The key or value rows, listed one pointer each: the kernels read rows
  // wherever they lie, one after another (an array, a contiguous cache:
  // listed a chunk at a time, see list_strided) or in blocks (a paged cache).
  template <typename P>
  struct ListedRows {
    const P* const* rows;
    const P* operator[](int64_t j) const { return rows[j]; }
    ListedRows from(int64_t j) const { return {rows + j}; }
  };

  // scores for R query rows against the keys: each key vector is loaded
  // once for the R rows, and R x 4 sums run side by side (one row's four
  // chains alone wait on the multiply-add latency). Each (row, key) sum is
  // taken in the same order whatever R is, so a row's scores do not depend
  // on the rows it is grouped with.
  template <Stored kSrc, typename P, int R, typename Rows>
  static void scores_group(const T* const* q, Rows k, const float* ks, int64_t n_keys,
                           int64_t dim, T scale, T* const* dst, int64_t ahead,
                           int64_t prefetch_end) {
    int64_t j = 0;
    for (; j + 4 <= n_keys; j += 4) {
      const P* kr[4] = {k[j], k[j + 1], k[j + 2], k[j + 3]};
      const bool ask = ahead && j + ahead + 4 <= prefetch_end;
      const P* ka[4] = {};
      if (ask)
        for (int u = 0; u < 4; ++u) ka[u] = k[j + ahead + u];
      V acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = Vec::zero();
      int64_t i = 0;
      for (; i + W <= dim; i += W) {
        V kv[4];
#if defined(__GNUC__)
        if (ask)
          for (int u = 0; u < 4; ++u) __builtin_prefetch(ka[u] + i, 0, 2);
#endif
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          kv[u] = load_stored<kSrc>(kr[u] + i);
          // Held in a register for the R rows, where GCC would load it
          // again as an operand of each row's multiply-add: less time for a
          // few rows over keys in cache, a little more for grouped heads
          // decoding from memory (measurements: docs/tuning.md).
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
      if constexpr (R == 4 && HasReduce4x4<Vec>::value) {
        T* out[4] = {dst[0] + j, dst[1] + j, dst[2] + j, dst[3] + j};
        Vec::reduce_add4x4(acc, kSrc == Stored::kInt8 ? ks + j : nullptr, scale, out);
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          T sums[4];
          Vec::reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) dst[r][j + u] = scale * scaled<kSrc>(ks, j + u, sums[u]);
        }
      }
    }
    for (; j < n_keys; ++j) {
      const P* kj = k[j];
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
      for (int r = 0; r < R; ++r) dst[r][j] = scale * scaled<kSrc>(ks, j, Vec::reduce_add(acc[r]));
    }
  }

  // dst[r][j] = scale * <q[r], k_j> for r < rows, j < n_keys, kRowGroup rows
  // at a time; only the first group streams the keys (the others find them
  // in cache). With more rows than one group, the keys go in sub-blocks that
  // stay in L1 for every group (see row_sub_block).
  template <Stored kSrc, typename P>
  static void scores_of(const T* const* q, int rows, const P* k, int64_t ldk, int64_t n_keys,
                        int64_t dim, T scale, T* const* dst, bool stream) {
    scores_scaled<kSrc, P>(q, rows, k, ldk, nullptr, n_keys, dim, scale, dst, stream);
  }
  static void scores_int8(const T* const* q, int rows, const int8_t* k, int64_t ldk,
                          const float* ks, int64_t n_keys, int64_t dim, T scale, T* const* dst,
                          bool stream) {
    scores_scaled<Stored::kInt8, int8_t>(q, rows, k, ldk, ks, n_keys, dim, scale, dst, stream);
  }
  // scores_of with int8 rows' scales ks (null for other storage).
  template <Stored kSrc, typename P>
  static void scores_scaled(const T* const* q, int rows, const P* k, int64_t ldk,
                            const float* ks, int64_t n_keys, int64_t dim, T scale,
                            T* const* dst, bool stream) {
    for_strided_chunks(rows, k, ldk, n_keys, [&](const P* const* list, int64_t j0, int64_t n,
                                                 int64_t listed, int r0, int count) {
      T* d[kListRows];
      for (int r = 0; r < count; ++r) d[r] = dst[r0 + r] + j0;
      scores_at<kSrc, P>(q + r0, count, ListedRows<P>{list}, ks ? ks + j0 : nullptr, n, listed,
                         dim, scale, d, stream);
    });
  }

  // Rows one after another, ld apart, listed kListChunk at a time (a
  // multiple of 4: the score kernels group keys by four from a call's
  // first, so every key meets the same arithmetic as in one call), with
  // the rows after each chunk that the kernels ask for ahead (kPrefetchBytes
  // of rows of at least kPrefetchMinRowBytes), and the rows kListRows at a
  // time: f(list, j0, n, listed, r0, count) for each.
  static constexpr int64_t kListChunk = 128;
  static constexpr int64_t kListAhead = kPrefetchBytes / kPrefetchMinRowBytes;
  static constexpr int kListRows = 32;
  template <typename P, typename F>
  static void for_strided_chunks(int rows, const P* base, int64_t ld, int64_t n_keys, F&& f) {
    const P* list[kListChunk + kListAhead];
    for (int64_t j0 = 0; j0 < n_keys; j0 += kListChunk) {
      const int64_t n = min64(kListChunk, n_keys - j0);
      const int64_t listed = n + min64(kListAhead, n_keys - j0 - n);
      const P* row = base + j0 * ld;
      for (int64_t i = 0; i < listed; ++i, row += ld) list[i] = row;
      for (int r0 = 0; r0 < rows; r0 += kListRows) f(list, j0, n, listed, r0, imin(rows - r0, kListRows));
    }
  }
  // ... where rows [n_keys, listed) may be asked for ahead too (they follow).
  template <Stored kSrc, typename P, typename Rows>
  static void scores_at(const T* const* q, int rows, Rows k, const float* ks, int64_t n_keys,
                        int64_t listed, int64_t dim, T scale, T* const* dst, bool stream) {
    const int64_t ahead = prefetch_distance<P>(stream, dim);
    const int64_t sub = rows > Vec::kRowGroup ? row_sub_block<P>(dim) : n_keys;
    for (int64_t j0 = 0; j0 < n_keys; j0 += sub) {
      const int64_t n = min64(sub, n_keys - j0);
      const Rows k0 = k.from(j0);
      const float* ks0 = ks ? ks + j0 : nullptr;
      for (int r0 = 0; r0 < rows; r0 += Vec::kRowGroup) {
        const int count = imin(rows - r0, Vec::kRowGroup);
        T* d[Vec::kRowGroup];
        for (int i = 0; i < count; ++i) d[i] = dst[r0 + i] + j0;
        const T* const* qg = q + r0;
        const int64_t a = r0 == 0 ? ahead : 0, end = listed - j0;
        switch (count) {
          case 1: scores_group<kSrc, P, 1>(qg, k0, ks0, n, dim, scale, d, a, end); break;
          case 2: scores_group<kSrc, P, 2>(qg, k0, ks0, n, dim, scale, d, a, end); break;
          case 3:
            if constexpr (Vec::kRowGroup >= 3)
              scores_group<kSrc, P, 3>(qg, k0, ks0, n, dim, scale, d, a, end);
            break;
          default:
            if constexpr (Vec::kRowGroup >= 4)
              scores_group<kSrc, P, 4>(qg, k0, ks0, n, dim, scale, d, a, end);
            break;
        }
      }
    }
  }

  // dot_rows for R rows of x, 4 rows of w at a time: each vector of a w row
  // is loaded once for the R rows, each of x once for the 4 rows of w.
  // w's rows are read in order, one after the other, and the hardware
  // prefetchers alone keep up with that: asking for each line 8 rows ahead
  // as well (as the decode kernels do for keys and values) cost time, with
  // the weights in L3 and from DRAM alike (measurements: docs/tuning.md).
  template <int R>
  static void dot_rows_of(const T* const* x, const T* w, int64_t ldw, int64_t n, int64_t dim,
                          T* const* y) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* wj = w + j * ldw;
      V acc[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = Vec::zero();
      for (int64_t i = 0; i < dim; i += W) {
        const int len = static_cast<int>(min64(W, dim - i));
        V wv[4], xv[R];
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
  template <Stored kSrc, typename P, int R, int NV, typename Rows>
  static void accumulate_pv_chunk(const T* const* p, Rows v, const float* vs, int64_t n_keys,
                                  T* const* acc, int64_t d0, int64_t ahead,
                                  int64_t prefetch_end) {
    V a[R][NV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) a[r][u] = Vec::load(acc[r] + d0 + u * W);
    for (int64_t j = 0; j < n_keys; ++j) {
      const P* vj = v[j] + d0;
      if (ahead && j + ahead < prefetch_end) prefetch_rows(v[j + ahead] + d0, 0, 1, NV * W);
      V vv[NV];
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) {
        vv[u] = load_stored<kSrc>(vj + u * W);
        // Loaded once for the R rows (see scores_group).
        if constexpr (R > 1) Vec::hold(vv[u]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const V pj = Vec::set1(scaled<kSrc>(vs, j, p[r][j]));
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
  // them.) A row alone, decoding from memory, keeps to two keys at a time:
  // with four, each burst of requests ahead doubles, which costs it more
  // time than the fewer loads save. Three or four rows (grouped heads
  // decoding) take this form at any row length that is whole vectors:
  // each value row is then read, and widened, once for all of them, where
  // two groups of two in registers read and widened it twice (measurements:
  // docs/tuning.md).
  template <Stored kSrc, typename P, int R, typename Rows>
  static void accumulate_pv_in_l1(const T* const* p, Rows v, const float* vs, int64_t n_keys,
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
        for (int u = 0; u < kKeys; ++u) pk[r][u] = Vec::set1(scaled<kSrc>(vs, j + u, p[r][j + u]));
      const P* vr[kKeys];
#pragma GCC unroll 4
      for (int u = 0; u < kKeys; ++u) vr[u] = v[j + u];
      if (ahead && j + ahead + kKeys <= prefetch_end)
        for (int u = 0; u < kKeys; ++u) prefetch_rows(v[j + ahead + u], 0, 1, dim);
      for (int64_t d = 0; d < dim; d += W) {
        V vv[kKeys];
#pragma GCC unroll 4
        for (int u = 0; u < kKeys; ++u) vv[u] = load_stored<kSrc>(vr[u] + d);
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
      const P* vj = v[j];
      V pj[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) pj[r] = Vec::set1(scaled<kSrc>(vs, j, p[r][j]));
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
  template <Stored kSrc, typename P, int R, typename Rows>
  static void accumulate_pv_group(const T* const* p, Rows v, const float* vs, int64_t n_keys,
                                  int64_t dim, T* const* acc, int64_t ahead,
                                  int64_t prefetch_end) {
    // Up to 8 vectors of one row's accumulator stay in registers across the
    // keys, so a value row of up to 8W elements is streamed once; R rows
    // keep kPvAccumulators / R vectors each (the value vectors take most of
    // the other registers), a pass over the keys per chunk of that many.
    constexpr int kVectors = R == 1 ? 8 : kPvAccumulators / R;
    constexpr int kChunk = kVectors * W;
    if (dim % W == 0 && (dim > kLongestRowInRegisters || R > 2)) {
      accumulate_pv_in_l1<kSrc, P, R>(p, v, vs, n_keys, dim, acc, ahead, prefetch_end);
      return;
    }
    for (int64_t d0 = 0; d0 < dim; d0 += kChunk) {
      const int len = static_cast<int>(min64(kChunk, dim - d0));
      // A whole chunk, or half of one (a head dim of 64 in a chunk of 128):
      // straight-line code, the accumulators in registers (the general form
      // below keeps them on the stack).
      if (len == kChunk) {
        accumulate_pv_chunk<kSrc, P, R, kVectors>(p, v, vs, n_keys, acc, d0, ahead,
                                                  prefetch_end);
        continue;
      }
      if constexpr (kVectors % 2 == 0) {
        if (len == kChunk / 2) {
          accumulate_pv_chunk<kSrc, P, R, kVectors / 2>(p, v, vs, n_keys, acc, d0, ahead,
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
        const P* vj = v[j] + d0;
        if (ahead && j + ahead < prefetch_end) prefetch_rows(v[j + ahead] + d0, 0, 1, len);
        V vv[kVectors];
#pragma GCC unroll 8
        for (int u = 0; u < kVectors; ++u)
          vv[u] = u < full ? load_stored<kSrc>(vj + u * W)
                           : (u == full && tail ? load_stored_partial<kSrc>(vj + u * W, tail)
                                                : Vec::zero());
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const V pj = Vec::set1(scaled<kSrc>(vs, j, p[r][j]));
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
    accumulate_pv_scaled<kSrc, P>(p, rows, v, ldv, nullptr, n_keys, dim, acc, stream);
  }
  static void accumulate_pv_int8(const T* const* p, int rows, const int8_t* v, int64_t ldv,
                                 const float* vs, int64_t n_keys, int64_t dim, T* const* acc,
                                 bool stream) {
    accumulate_pv_scaled<Stored::kInt8, int8_t>(p, rows, v, ldv, vs, n_keys, dim, acc, stream);
  }
  // accumulate_pv_of with int8 rows' scales vs (null for other storage).
  template <Stored kSrc, typename P>
  static void accumulate_pv_scaled(const T* const* p, int rows, const P* v, int64_t ldv,
                                   const float* vs, int64_t n_keys, int64_t dim, T* const* acc,
                                   bool stream) {
    // Each accumulator takes its keys' terms in key order, chunk after chunk.
    for_strided_chunks(rows, v, ldv, n_keys, [&](const P* const* list, int64_t j0, int64_t n,
                                                 int64_t listed, int r0, int count) {
      const T* pr[kListRows];
      for (int r = 0; r < count; ++r) pr[r] = p[r0 + r] + j0;
      accumulate_pv_at<kSrc, P>(pr, count, ListedRows<P>{list}, vs ? vs + j0 : nullptr, n, listed,
                                dim, acc + r0, stream);
    });
  }
  // ... where rows [n_keys, listed) may be asked for ahead too (they follow).
  template <Stored kSrc, typename P, typename Rows>
  static void accumulate_pv_at(const T* const* p, int rows, Rows v, const float* vs,
                               int64_t n_keys, int64_t listed, int64_t dim, T* const* acc,
                               bool stream) {
    const int64_t ahead = prefetch_distance<P>(stream, dim);
    const int64_t vectors = (dim + W - 1) / W;
    // As many rows as hold their whole accumulators in registers together,
    // or, for rows longer than that or more than two rows, kRowGroup rows
    // with theirs in L1 (see accumulate_pv_in_l1).
    const int fit = static_cast<int>(min64(kPvAccumulators, kPvAccumulators / vectors));
    const int group = dim % W == 0 && (dim > kLongestRowInRegisters || rows > 2)
                          ? Vec::kRowGroup
                          : imax(1, imin(Vec::kRowGroup, fit));
    const int64_t sub = rows > group ? row_sub_block<P>(dim) : n_keys;
    for (int64_t j0 = 0; j0 < n_keys; j0 += sub) {
      const int64_t n = min64(sub, n_keys - j0);
      const Rows v0 = v.from(j0);
      const float* vs0 = vs ? vs + j0 : nullptr;
      for (int r0 = 0; r0 < rows; r0 += group) {
        const int count = imin(rows - r0, group);
        const T* pg[Vec::kRowGroup];
        for (int i = 0; i < count; ++i) pg[i] = p[r0 + i] + j0;
        T* const* ag = acc + r0;
        const int64_t a = r0 == 0 ? ahead : 0, end = listed - j0;
        switch (count) {
          case 1: accumulate_pv_group<kSrc, P, 1>(pg, v0, vs0, n, dim, ag, a, end); break;
          case 2: accumulate_pv_group<kSrc, P, 2>(pg, v0, vs0, n, dim, ag, a, end); break;
          case 3:
            if constexpr (Vec::kRowGroup >= 3)
              accumulate_pv_group<kSrc, P, 3>(pg, v0, vs0, n, dim, ag, a, end);
            break;
          default:
            if constexpr (Vec::kRowGroup >= 4)
              accumulate_pv_group<kSrc, P, 4>(pg, v0, vs0, n, dim, ag, a, end);
            break;
        }
      }
    }
  }

  static void accumulate_pv(const T* const* p, int rows, const T* v, int64_t ldv,
                            int64_t n_keys, int64_t dim, T* const* acc, bool stream) {
    accumulate_pv_of<Stored::kNative>(p, rows, v, ldv, n_keys, dim, acc, stream);
  }

  // scores and accumulate_pv over listed rows (see KernelTable::scores_listed).
  static void scores_listed(const T* const* q, int rows, const void* const* k, const float* ks,
                            int stored, int64_t n_keys, int64_t listed, int64_t dim, T scale,
                            T* const* dst) {
    if constexpr (Vec::kWidens16) {
      const auto* bits = reinterpret_cast<const uint16_t* const*>(k);
      switch (stored) {
        case 1:
          return scores_at<Stored::kFloat16, uint16_t>(q, rows, ListedRows<uint16_t>{bits}, nullptr,
                                                       n_keys, listed, dim, scale, dst, true);
        case 2:
          return scores_at<Stored::kBfloat16, uint16_t>(q, rows, ListedRows<uint16_t>{bits},
                                                        nullptr, n_keys, listed, dim, scale, dst,
                                                        true);
        case 3:
          return scores_at<Stored::kInt8, int8_t>(
              q, rows, ListedRows<int8_t>{reinterpret_cast<const int8_t* const*>(k)}, ks, n_keys,
              listed, dim, scale, dst, true);
        default: break;
      }
    }
    scores_listed_native(q, rows, reinterpret_cast<const T* const*>(k), n_keys, listed, dim, scale,
                         dst);
  }
  // scores_listed and accumulate_pv_listed over rows stored as T.
  static void scores_listed_native(const T* const* q, int rows, const T* const* k, int64_t n_keys,
                                   int64_t listed, int64_t dim, T scale, T* const* dst) {
    scores_at<Stored::kNative, T>(q, rows, ListedRows<T>{k}, nullptr, n_keys, listed, dim, scale,
                                  dst, true);
  }
  static void accumulate_pv_listed_native(const T* const* p, int rows, const T* const* v,
                                          int64_t n_keys, int64_t listed, int64_t dim,
                                          T* const* acc) {
    accumulate_pv_at<Stored::kNative, T>(p, rows, ListedRows<T>{v}, nullptr, n_keys, listed, dim,
                                         acc, true);
  }
  static void accumulate_pv_listed(const T* const* p, int rows, const void* const* v,
                                   const float* vs, int stored, int64_t n_keys, int64_t listed,
                                   int64_t dim, T* const* acc) {
    if constexpr (Vec::kWidens16) {
      const auto* bits = reinterpret_cast<const uint16_t* const*>(v);
      switch (stored) {
        case 1:
          return accumulate_pv_at<Stored::kFloat16, uint16_t>(p, rows, ListedRows<uint16_t>{bits},
                                                              nullptr, n_keys, listed, dim, acc,
                                                              true);
        case 2:
          return accumulate_pv_at<Stored::kBfloat16, uint16_t>(
              p, rows, ListedRows<uint16_t>{bits}, nullptr, n_keys, listed, dim, acc, true);
        case 3:
          return accumulate_pv_at<Stored::kInt8, int8_t>(
              p, rows, ListedRows<int8_t>{reinterpret_cast<const int8_t* const*>(v)}, vs, n_keys,
              listed, dim, acc, true);
        default: break;
      }
    }
    accumulate_pv_listed_native(p, rows, reinterpret_cast<const T* const*>(v), n_keys, listed,
                                dim, acc);
  }
};

}  // namespace
}  // namespace attnx::simd
