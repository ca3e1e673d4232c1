// What the paths of scaled dot-product attention share: keys and values read
// as T, and the values accumulated so that a closed key's value never reaches
// a row. The bands and masks are in attention/masking/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/masking/masking.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

// Rows of one (b, head) of the keys or the values, as T: read in place, or
// widened from 16-bit or int8 storage into a buffer one block at a time.
template <typename T>
struct RowReader {
  const T* native = nullptr;
  const uint16_t* bits = nullptr;
  int bits_kind = 0;  // 0 float16, 1 bfloat16: the index of the 16-bit row kernels
  const int8_t* q8 = nullptr;      // int8 rows, row j scaled by scales[j]
  const float* scales = nullptr;
  int64_t ld = 0, dim = 0;
  void (*widen)(const uint16_t*, int64_t, float*) = nullptr;
  void (*widen_int8)(const int8_t*, int64_t, T, T*) = nullptr;

  // Whether the rows are read in place by the kernels that take the storage
  // itself (16-bit or int8), rather than as T.
  bool stored() const { return bits || q8; }

  // Rows [j0, j0 + n); sets row_stride. buf holds n * dim values.
  const T* rows(int64_t j0, int64_t n, T* buf, int64_t& row_stride) const {
    if (!stored()) {
      row_stride = ld;
      return native + j0 * ld;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (q8) {
        for (int64_t j = 0; j < n; ++j)
          widen_int8(q8 + (j0 + j) * ld, dim, scales[j0 + j], buf + j * dim);
      } else {
        const uint16_t* src = bits + j0 * ld;
        if (ld == dim) {
          widen(src, n * dim, buf);
        } else {
          for (int64_t j = 0; j < n; ++j) widen(src + j * ld, dim, buf + j * dim);
        }
      }
    }
    row_stride = dim;
    return buf;
  }
};

template <typename T>
RowReader<T> row_reader(const StoredView<T>& v, const KernelTable<T>& kt, int64_t b, int64_t h) {
  RowReader<T> r;
  r.ld = v.stride(2);
  r.dim = v.shape(3);
  if (v.storage == Storage::kNative) {
    r.native = v.native.at(b, h);
  } else if constexpr (std::is_same_v<T, float>) {
    if (v.storage == Storage::kInt8) {
      r.q8 = v.q8.at(b, h);
      r.scales = v.scales.at(b, h);
      r.widen_int8 = kt.widen_int8;
    } else {
      r.bits = v.bits.at(b, h);
      r.bits_kind = v.storage == Storage::kFloat16 ? 0 : 1;
      r.widen = v.storage == Storage::kFloat16 ? kt.widen_float16 : kt.widen_bfloat16;
    }
  }
  return r;
}

// The soft cap on rows x cols scores x[r * ld + c]: c * tanh(s / c). The
// scores are divided by the cap first unless `divided` (the queries carried
// the division: SdpaArgs::softcap_folded()). Nothing without a cap.
template <typename T>
void soft_cap(const SdpaArgs<T>& a, const KernelTable<T>& kt, T* x, int64_t rows, int64_t ld,
              int64_t cols, bool divided) {
  if (!(a.softcap > 0)) return;
  if (!divided) {
    const T inverse = static_cast<T>(1.0 / double(a.softcap));
    for (int64_t r = 0; r < rows; ++r) kt.scale(x + r * ld, cols, inverse, x + r * ld);
  }
  kt.softcap(x, rows, ld, cols, a.softcap);
}

// The cache lines of `rows` rows of `cols` elements of T, `ld` apart.
template <typename T>
LineRange row_lines(const T* first_row, int64_t ld, int64_t rows, int64_t cols) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(first_row);
  const int64_t offset = int64_t(start % 64);
  LineRange lines;
  lines.first = start - uintptr_t(offset);
  lines.ld_bytes = ld * int64_t(sizeof(T));
  lines.row_lines = (offset + cols * int64_t(sizeof(T)) + 63) / 64;
  lines.end = rows * lines.row_lines;
  return lines;
}

// The cache lines of rows j0 .. j0 + rows - 1 of (b, h) of a key or value
// array, as it is stored.
template <typename T>
LineRange stored_row_lines(const StoredView<T>& v, int64_t b, int64_t h, int64_t j0,
                           int64_t rows) {
  if (v.storage == Storage::kNative)
    return row_lines(v.native.at(b, h, j0), v.native.stride[2], rows, v.native.shape[3]);
  if (v.storage == Storage::kInt8)
    return row_lines(v.q8.at(b, h, j0), v.q8.stride[2], rows, v.q8.shape[3]);
  return row_lines(v.bits.at(b, h, j0), v.bits.stride[2], rows, v.bits.shape[3]);
}

// Asks for the next `count` lines of `lines` (from lines.begin) to be
// brought into L2 (not L1, where the block being computed is).
inline void request_lines_to_l2(LineRange& lines, int64_t count) {
  count = std::min(count, lines.size());
  if (count <= 0) return;
  int64_t row = lines.begin / lines.row_lines, line = lines.begin - row * lines.row_lines;
  uintptr_t row_start = lines.first + uintptr_t(row * lines.ld_bytes);
  for (int64_t k = 0; k < count; ++k) {
#if defined(__GNUC__)
    __builtin_prefetch(reinterpret_cast<const void*>(row_start + uintptr_t(line * 64)), 0, 2);
#endif
    if (++line == lines.row_lines) line = 0, row_start += uintptr_t(lines.ld_bytes);
  }
  lines.begin += count;
}

// A whole row's scores p[0..n), masked (closed keys -inf), made its
// probabilities: zeros for a row with no open key; else max-subtracted
// exponentials over their sum, so that a row with open keys whose scores
// are all -inf (an Inf in the inputs) gives 0/0 = NaN. Whether the row is
// open is returned.
template <typename T>
bool row_probabilities(const KernelTable<T>& kt, T* p, int64_t n, bool any_open) {
  if (!any_open) {
    std::fill(p, p + n, T(0));
    return false;
  }
  const T sum = kt.exp_shift_sum(p, n, exp_shift(kt.row_max(p, n)));
  kt.scale(p, n, T(1) / sum, p);
  return true;
}

template <typename T>
bool rows_finite(const KernelTable<T>& kt, const T* v, int64_t ldv, int64_t n, int64_t dim) {
  return kt.all_finite(v, ldv, n, dim);
}

// acc += p . V over keys [j0, j0 + n) for query i, with each key's value
// either reaching the row or not exactly as the reference has it: a closed
// key's value never does, an open key's always does, even when its
// probability underflowed to 0 (so that 0 * NaN is NaN there). Plain
// accumulation differs only where a closed key's value is not finite, so
// only then is the slower, key-by-key form used.
template <typename T>
void accumulate_values(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                       int64_t i, int64_t j0, int64_t n, bool any_closed, const T* p,
                       const T* v, int64_t ldv, int64_t Ev, T* acc, bool stream) {
  if (!any_closed || rows_finite(kt, v, ldv, n, Ev)) {
    kt.accumulate_pv(&p, 1, v, ldv, n, Ev, &acc, stream);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* p_j = p + j;
    if (!key_closed(a, b, h, i, j0 + j))
      kt.accumulate_pv(&p_j, 1, v + j * ldv, ldv, 1, Ev, &acc, false);
  }
}

// Whether each value row of each (b, key head) is all finite, for keys
// [0, S_read): taken once a call where query tiles would check the same
// blocks of values again and again, as in a masked call (see
// docs/tuning.md).
struct FiniteRows {
  std::vector<uint8_t> flags;  // empty: not taken
  int64_t heads = 0, keys = 0;

  template <typename T>
  void take(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t B, int64_t Hk,
            int64_t S_read, int nthreads) {
    heads = Hk, keys = S_read;
    flags.resize(size_t(B * Hk * S_read));
    const int64_t ld = a.value.stride(2), Ev = a.value.shape(3);
    parallel_for(B * Hk, nthreads, Schedule::kStatic, [&](int64_t bh) {
      const T* rows = a.value.native.at(bh / Hk, bh % Hk);
      uint8_t* f = flags.data() + bh * S_read;
      // Packed, keys past the batch's are another's: never read, flagged finite.
      const int64_t n = std::min(S_read, key_rows(a, bh / Hk));
      for (int64_t j = 0; j < n; ++j) f[j] = kt.all_finite(rows + j * ld, 0, 1, Ev) ? 1 : 0;
      std::fill(f + n, f + S_read, uint8_t(1));
    });
  }
  // Whether rows [start, start + n) of (b, h) are all finite: from the
  // flags where taken, else check().
  template <typename Check>
  bool all(int64_t b, int64_t h, int64_t start, int64_t n, const Check& check) const {
    if (flags.empty() || start + n > keys) return check();
    const uint8_t* f = flags.data() + (b * heads + h) * keys + start;
    return std::find(f, f + n, uint8_t(0)) == f + n;
  }
};


}  // namespace attnx::sdpa
