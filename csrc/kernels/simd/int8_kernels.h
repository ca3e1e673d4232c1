// The int8 products (kernels/int8_table.h) without vpdpbusd: on the float32
// row kernels where that is exact, else as plain loops. int8_vnni.h gives
// the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/int8_table.h"
#include "kernels/kernel_table.h"
#include "kernels/simd/kernel_helpers.h"

namespace attnx::simd {
// Internal linkage: compiled once per instruction set (see row_kernels.h).
namespace {

// The quantization of one block's probabilities (Int8KernelTable::
// accumulate_pv), shared by every table: the same float32 steps.
struct Int8Probabilities {
  float top = 0;       // the largest w_j = p_j * scale_j, NaN ignored
  bool nan = false;    // whether any w_j is NaN
  float inv = 0;       // 127 / top
  bool inv_finite = true;

  static Int8Probabilities of(const float* p, const float* scales, int64_t n) {
    // kLanes partial maxima, so that the compiler vectorizes the loop (the
    // largest value does not depend on the order).
    constexpr int kLanes = 16;
    float top[kLanes] = {};
    int32_t nan[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float w = p[j + l] * scales[j + l];
        nan[l] |= w != w;
        top[l] = w > top[l] ? w : top[l];
      }
    for (int l = 0; j < n; ++j, ++l) {
      const float w = p[j] * scales[j];
      nan[l] |= w != w;
      top[l] = w > top[l] ? w : top[l];
    }
    Int8Probabilities q;
    for (int l = 0; l < kLanes; ++l) {
      q.nan = q.nan || nan[l] != 0;
      q.top = top[l] > q.top ? top[l] : q.top;
    }
    q.set_inverse();
    return q;
  }
  void set_inverse() {
    inv = 127.0f / top;
    inv_finite = std::isfinite(inv);
  }
  // Whether the block adds anything to the row.
  bool adds() const { return nan || top > 0; }
  // The factor of the block's integer sums: NaN where a w_j is.
  float factor() const { return nan ? std::nanf("") : top / 127.0f; }
  // y clamped to [0, 127] (NaN: 0) and rounded to nearest even, by adding
  // and taking away 1.5 * 2^23 (exact there): in loops the compiler vectorizes.
  static float clamped_level(float y) {
    constexpr float kRound = 12582912.0f;
    y = y > 0.0f ? y : 0.0f;
    y = y < 127.0f ? y : 127.0f;
    return (y + kRound) - kRound;
  }
  // p8 of w.
  float level(float w) const { return clamped_level(inv_finite ? w * inv : w / top * 127.0f); }
  // levels[j] = level(p[j] * scales[j]), j < n.
  void levels_of(const float* p, const float* scales, int64_t n, float* levels) const {
    if (inv_finite) {
      for (int64_t j = 0; j < n; ++j) levels[j] = clamped_level(p[j] * scales[j] * inv);
    } else {
      for (int64_t j = 0; j < n; ++j) levels[j] = clamped_level(p[j] * scales[j] / top * 127.0f);
    }
  }
};

// Keys and values whose rows are asked for ahead of their reads (see
// kPrefetchBytes).
inline int64_t int8_rows_ahead(int64_t dim) { return prefetch_distance<int8_t>(true, dim); }

// The row loops of the int8 tables on vectors (int8_vnni.h, int8_avx2.h).
// Scores: four query rows at a time (Kernels::scores_rows<4>), the rest one
// by one (as fast a row: the products and each row's sums are the same;
// fewer kernels in the library); only the first group asks for keys ahead.
template <class Kernels>
void int8_scores_in_row_groups(const int8_t* const* q, const float* q_scales, int rows,
                               const int8_t* const* k, const float* k_scales, int64_t n_keys,
                               int64_t listed, int64_t dim, float* const* dst) {
  in_row_groups_of_four(rows, int8_rows_ahead(dim), [&](int r0, int count, int64_t a) {
    if (count == 4)
      Kernels::template scores_rows<4>(q + r0, q_scales + r0, k, k_scales, n_keys, listed, dim,
                                       dst + r0, a);
    else
      Kernels::template scores_rows<1>(q + r0, q_scales + r0, k, k_scales, n_keys, listed, dim,
                                       dst + r0, a);
  });
}

// add(j, r0, r1, r2, r3) with the value rows of keys j..j + 3, four keys a
// step (the P.V kernels interleave four rows' bytes), those `ahead` keys on
// (up to `listed`) asked for first. Past the block's last key its row stands
// in: the levels there are 0 (Kernels::quantize pads them).
template <typename Add>
[[gnu::always_inline]] inline void int8_in_key_quads(const int8_t* const* v, int64_t n_keys,
                                                     int64_t dim, int64_t ahead, int64_t listed,
                                                     Add&& add) {
  int64_t j = 0;
  for (; j + 4 <= n_keys; j += 4) {
    if (ahead && j + ahead + 4 <= listed)
      for (int u = 0; u < 4; ++u) prefetch_rows(v[j + ahead + u], 0, 1, dim);
    add(j, v[j], v[j + 1], v[j + 2], v[j + 3]);
  }
  if (j < n_keys) {
    const int64_t last = n_keys - 1;
    add(j, v[j], v[j + 1 < last ? j + 1 : last], v[j + 2 < last ? j + 2 : last], v[last]);
  }
}

// P.V: kGroup rows at a time, each row's probabilities quantized
// (Kernels::quantize: levels zero up to a multiple of 4 past the block), the
// rows that take nothing from the block left out, then Kernels::pv_rows over
// the columns kChunk at a time. Only the first group streams the values;
// the others find them in cache.
template <class Kernels, int kGroup, int64_t kChunk>
void int8_accumulate_pv_in_row_groups(const float* const* p, int rows, const int8_t* const* v,
                                      const float* v_scales, int64_t n_keys, int64_t listed,
                                      int64_t dim, float* const* acc) {
  if (n_keys <= 0) return;
  const int64_t ahead = int8_rows_ahead(dim);
  alignas(64) uint8_t levels[kGroup][kInt8MaxBlock + 16];
  bool first = true;
  for (int r0 = 0; r0 < rows; r0 += kGroup) {
    const uint8_t* lv[kGroup];
    float factors[kGroup];
    float* out[kGroup];
    int count = 0;
    for (int r = r0; r < rows && r < r0 + kGroup; ++r) {
      const Int8Probabilities q = Kernels::quantize(p[r], v_scales, n_keys, levels[count]);
      if (!q.adds()) continue;
      lv[count] = levels[count], factors[count] = q.factor(), out[count++] = acc[r];
    }
    if (count == 0) continue;
    const int64_t a = first ? ahead : 0;
    first = false;
    for (int64_t d0 = 0; d0 < dim; d0 += kChunk)
      Kernels::pv_rows(count, lv, factors, v, n_keys, d0, dim, out, d0 == 0 ? a : 0, listed);
  }
}

struct PortableInt8Kernels {
  static void scores(const int8_t* const* q, const float* q_scales, int rows,
                     const int8_t* const* k, const float* k_scales, int64_t n_keys,
                     int64_t listed, int64_t dim, float* const* dst) {
    const int64_t ahead = int8_rows_ahead(dim);
    for (int64_t j = 0; j < n_keys; ++j) {
      if (ahead && j + ahead < listed) prefetch_rows(k[j + ahead], 0, 1, dim);
      const int8_t* kj = k[j];
      for (int r = 0; r < rows; ++r) {
        const int8_t* qr = q[r];
        int32_t sum = 0;
        for (int64_t i = 0; i < dim; ++i) sum += int32_t(qr[i]) * int32_t(kj[i]);
        dst[r][j] = (q_scales[r] * k_scales[j]) * static_cast<float>(sum);
      }
    }
  }

  // Columns of the value rows per pass: their int32 sums on the stack.
  static constexpr int64_t kColumns = 256;

  static void accumulate_pv(const float* const* p, int rows, const int8_t* const* v,
                            const float* v_scales, int64_t n_keys, int64_t listed, int64_t dim,
                            float* const* acc) {
    const int64_t ahead = int8_rows_ahead(dim);
    for (int64_t j = n_keys; j < listed && j < n_keys + ahead; ++j)
      prefetch_rows(v[j], 0, 1, dim);
    int32_t sums[kColumns];
    for (int r = 0; r < rows; ++r) {
      const Int8Probabilities q = Int8Probabilities::of(p[r], v_scales, n_keys);
      if (!q.adds()) continue;
      const float factor = q.factor();
      for (int64_t d0 = 0; d0 < dim; d0 += kColumns) {
        const int64_t n = dim - d0 < kColumns ? dim - d0 : kColumns;
        for (int64_t d = 0; d < n; ++d) sums[d] = 0;
        for (int64_t j = 0; j < n_keys; ++j) {
          const auto level = static_cast<int32_t>(q.level(p[r][j] * v_scales[j]));
          if (level == 0) continue;
          const int8_t* vj = v[j] + d0;
          for (int64_t d = 0; d < n; ++d) sums[d] += level * int32_t(vj[d]);
        }
        float* out = acc[r] + d0;
        for (int64_t d = 0; d < n; ++d)
          out[d] = std::fma(static_cast<float>(sums[d]), factor, out[d]);
      }
    }
  }

  static Int8KernelTable table(const char* name, Isa isa) {
    return Int8KernelTable{name, isa, &scores, &accumulate_pv, nullptr};
  }
};

// The int8 products on a float32 table's row kernels, where their sums are
// exact: int8 values are integers that float32 holds exactly, and so are
// their products and every partial sum while it stays below 2^24 (dim <=
// kExactDim keys' scores, kInt8MaxBlock keys' P.V at levels <= 127). The
// float kernels then give the same sums as the integer ones, in any order:
// the same bits as every other table, at the speed of the float kernels
// that read an int8 cache (the plain loops take longer rows).
template <const KernelTable<float>& (*Floats)()>
struct FloatExactInt8Kernels {
  static constexpr int64_t kExactDim = (int64_t(1) << 24) / (127 * 127);
  static_assert(kInt8MaxBlock * 127 * 127 < (int64_t(1) << 24));
  static constexpr int kGroup = 4;  // rows per call of the float kernels

  // n ones: the float kernels' row scales, so that they add bare products.
  static const float* ones() {
    static const struct Ones {
      float x[kInt8MaxBlock];
      Ones() { for (float& v : x) v = 1.0f; }
    } table;
    return table.x;
  }

  static void scores(const int8_t* const* q, const float* q_scales, int rows,
                     const int8_t* const* k, const float* k_scales, int64_t n_keys,
                     int64_t listed, int64_t dim, float* const* dst) {
    if (dim > kExactDim || n_keys > kInt8MaxBlock)
      return portable_int8_kernels().scores(q, q_scales, rows, k, k_scales, n_keys, listed, dim,
                                            dst);
    const KernelTable<float>& kt = Floats();
    float values[kGroup][kExactDim];
    for (int r0 = 0; r0 < rows; r0 += kGroup) {
      const int count = rows - r0 < kGroup ? rows - r0 : kGroup;
      const float* qf[kGroup];
      for (int r = 0; r < count; ++r) {
        for (int64_t i = 0; i < dim; ++i) values[r][i] = q[r0 + r][i];
        qf[r] = values[r];
      }
      kt.scores_listed(qf, count, reinterpret_cast<const void* const*>(k), ones(), 3, n_keys,
                       listed, dim, 1.0f, dst + r0);
      for (int r = 0; r < count; ++r)
        for (int64_t j = 0; j < n_keys; ++j)
          dst[r0 + r][j] = (q_scales[r0 + r] * k_scales[j]) * dst[r0 + r][j];
    }
  }

  static void accumulate_pv(const float* const* p, int rows, const int8_t* const* v,
                            const float* v_scales, int64_t n_keys, int64_t listed, int64_t dim,
                            float* const* acc) {
    if (dim > kExactDim || n_keys > kInt8MaxBlock)
      return portable_int8_kernels().accumulate_pv(p, rows, v, v_scales, n_keys, listed, dim, acc);
    const KernelTable<float>& kt = Floats();
    float levels[kGroup][kInt8MaxBlock];
    float sums[kGroup][kExactDim];
    for (int r0 = 0; r0 < rows; r0 += kGroup) {
      const float* lv[kGroup];
      float* out[kGroup];
      float* acc_rows[kGroup];
      float factors[kGroup];
      int count = 0;
      for (int r = r0; r < rows && r < r0 + kGroup; ++r) {
        const Int8Probabilities q = Int8Probabilities::of(p[r], v_scales, n_keys);
        if (!q.adds()) continue;
        q.levels_of(p[r], v_scales, n_keys, levels[count]);
        for (int64_t d = 0; d < dim; ++d) sums[count][d] = 0.0f;
        lv[count] = levels[count], out[count] = sums[count], acc_rows[count] = acc[r];
        factors[count++] = q.factor();
      }
      if (count == 0) continue;
      kt.accumulate_pv_listed(lv, count, reinterpret_cast<const void* const*>(v), ones(), 3,
                              n_keys, listed, dim, out);
      for (int r = 0; r < count; ++r)
        for (int64_t d = 0; d < dim; ++d)
          acc_rows[r][d] = std::fma(out[r][d], factors[r], acc_rows[r][d]);
    }
  }

  static Int8KernelTable table(const char* name, Isa isa) {
    return Int8KernelTable{name, isa, &scores, &accumulate_pv, nullptr};
  }
};

}  // namespace
}  // namespace attnx::simd
