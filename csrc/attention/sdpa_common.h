// What the paths of scaled dot-product attention share: keys and values read
// as T, and the values accumulated so that a closed key's value never reaches
// a row. The bands and masks are in attention/masking/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/masking/masking.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

// Rows of one (b, head) of the keys or the values, as T: read in place, or
// widened from 16-bit or int8 storage into a buffer one block at a time. In
// a paged cache the rows lie in runs of consecutive rows, one per block of
// the pool (run()); elsewhere all the rows are one run.
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
  // Paged: the batch's block table, rows per block, and the distance from
  // one block to the next (storage elements; scales).
  const int32_t* blocks = nullptr;
  int64_t block_size = 0, block_stride = 0, scales_block_stride = 0;

  // Whether the rows are read in place by the kernels that take the storage
  // itself (16-bit or int8), rather than as T.
  bool stored() const { return bits || q8; }

  // Where row j starts, in storage elements from row 0 of block 0.
  int64_t offset(int64_t j) const {
    return blocks ? blocks[j / block_size] * block_stride + (j % block_size) * ld : j * ld;
  }
  // The rows from j on that lie one after another (ld apart).
  int64_t run(int64_t j) const {
    return blocks ? block_size - j % block_size : std::numeric_limits<int64_t>::max();
  }
  // The kind of rows the listed kernels take (KernelTable::scores_listed).
  int stored_kind() const { return q8 ? 3 : bits ? 1 + bits_kind : 0; }
  // Rows [j0, j0 + n + extra) listed one pointer each into `rows` (the
  // extra rows only to be asked for ahead), and, for int8 rows, the scales
  // of [j0, j0 + n) into `row_scales`. An int8 run's scales are copied in
  // the loop that lists its rows: a library copy a run of 16 rows took 5% of
  // an int8 step over blocks of 16 (docs/tuning.md).
  void list(int64_t j0, int64_t n, int64_t extra, const void** rows, float* row_scales) const {
    const int64_t element = q8 ? 1 : bits ? 2 : int64_t(sizeof(T)), bytes = ld * element;
    const char* base = q8     ? reinterpret_cast<const char*>(q8)
                       : bits ? reinterpret_cast<const char*>(bits)
                              : reinterpret_cast<const char*>(native);
    for_each_run(j0, n + extra, [&](int64_t j, int64_t count, int64_t first, const float* s) {
      const char* row = base + first * element;
      const int64_t i = j - j0;
      const int64_t scaled = s ? std::clamp<int64_t>(n - i, 0, count) : 0;
      int64_t k = 0;
      for (; k < scaled; ++k, row += bytes) rows[i + k] = row, row_scales[i + k] = s[k];
      for (; k < count; ++k, row += bytes) rows[i + k] = row;
    });
  }
  // Asks for the int8 scales of rows [j0, j0 + n) of a paged cache, a line
  // a block of the pool, to be brought into L2: one block's scales lie
  // apart from the next one's, where no prefetcher finds them, and list()
  // waited on each (a contiguous cache's are one stream).
  void request_scales_to_l2(int64_t j0, int64_t n) const {
#if defined(__GNUC__)
    if (!q8 || !blocks || n <= 0) return;
    for (int64_t block = j0 / block_size, last = (j0 + n - 1) / block_size; block <= last; ++block)
      __builtin_prefetch(scales + blocks[block] * scales_block_stride, 0, 2);
#else
    (void)j0, (void)n;
#endif
  }
  // Calls f(j, n, first, s) for the runs of rows [j0, j0 + count), in
  // order: n rows from row j, which starts `first` storage elements from row
  // 0 of block 0 (offset(j)), with their int8 scales from s (null for other
  // rows). A paged cache's blocks are walked from j0's: one division a call,
  // not two a run.
  template <typename F>
  void for_each_run(int64_t j0, int64_t count, F&& f) const {
    int64_t block = blocks ? j0 / block_size : 0, in = blocks ? j0 % block_size : j0;
    for (int64_t j = j0, end = j0 + count; j < end; ++block, in = 0) {
      const int64_t n = blocks ? std::min(end - j, block_size - in) : end - j;
      const int64_t first = blocks ? blocks[block] * block_stride + in * ld : in * ld;
      const float* s =
          q8 ? scales + (blocks ? blocks[block] * scales_block_stride + in : in) : nullptr;
      f(j, n, first, s);
      j += n;
    }
  }

  // Rows [j0, j0 + n); sets row_stride. buf holds n * dim values: native
  // rows of one run are read in place, others are copied or widened there.
  const T* rows(int64_t j0, int64_t n, T* buf, int64_t& row_stride) const {
    if (!stored() && run(j0) >= n) {
      row_stride = ld;
      return native + offset(j0);
    }
    for_each_run(j0, n, [&](int64_t j, int64_t count, int64_t first, const float* s) {
      T* dst = buf + (j - j0) * dim;
      if (!stored()) {
        for (int64_t i = 0; i < count; ++i)
          std::copy_n(native + first + i * ld, dim, dst + i * dim);
      } else if constexpr (std::is_same_v<T, float>) {
        if (q8) {
          const int8_t* src = q8 + first;
          for (int64_t i = 0; i < count; ++i) widen_int8(src + i * ld, dim, s[i], dst + i * dim);
        } else if (const uint16_t* src = bits + first; ld == dim) {
          widen(src, count * dim, dst);
        } else {
          for (int64_t i = 0; i < count; ++i) widen(src + i * ld, dim, dst + i * dim);
        }
      }
    });
    row_stride = dim;
    return buf;
  }
};

template <typename T>
[[gnu::always_inline]] inline RowReader<T> row_reader(const StoredView<T>& v, const KernelTable<T>& kt,
                                                    int64_t b, int64_t h) {
  RowReader<T> r;
  r.ld = v.stride(2);
  r.dim = v.shape(3);
  // Paged: from row 0 of block 0 of head h, where the block table leads.
  if (__builtin_expect(v.paged.present(), 0)) {
    r.blocks = v.paged.blocks + b * v.paged.stride;
    r.block_size = v.paged.block_size;
    r.block_stride = v.stride(0);
    r.scales_block_stride = v.scales.stride[0];
    b = 0;
  }
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
// array, as it is stored; paged, of those in j0's block.
template <typename T>
LineRange stored_row_lines(const StoredView<T>& v, int64_t b, int64_t h, int64_t j0,
                           int64_t rows) {
  if (v.paged.present()) {
    const int64_t bs = v.paged.block_size;
    rows = std::min(rows, bs - j0 % bs);
    const int64_t offset = v.paged.blocks[b * v.paged.stride + j0 / bs] * v.stride(0) +
                           h * v.stride(1) + (j0 % bs) * v.stride(2);
    if (v.storage == Storage::kNative)
      return row_lines(v.native.data + offset, v.native.stride[2], rows, v.native.shape[3]);
    if (v.storage == Storage::kInt8)
      return row_lines(v.q8.data + offset, v.q8.stride[2], rows, v.q8.shape[3]);
    return row_lines(v.bits.data + offset, v.bits.stride[2], rows, v.bits.shape[3]);
  }
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

// The cache lines of rows listed one pointer each, as the listed kernels
// take them (a paged cache's rows lie in runs, one per block of the pool):
// line k is line k % row_lines of row k / row_lines.
struct ListedLines {
  const void* const* rows = nullptr;
  int64_t row_lines = 1;
  int64_t begin = 0, end = 0;  // the lines to request

  int64_t size() const { return end - begin; }
};

// Asks for the even lines among the next 2 `count` of `lines` to be
// brought into L2: the core's spatial prefetcher brings the other line of
// an aligned pair, and each request holds a line fill buffer until its
// line arrives.
inline void request_line_pairs_to_l2(ListedLines& lines, int64_t count) {
  const int64_t stop = std::min(lines.end, lines.begin + 2 * count);
  if (stop <= lines.begin) return;
  int64_t row = lines.begin / lines.row_lines, line = lines.begin - row * lines.row_lines;
  for (int64_t k = lines.begin; k < stop; ++k) {
#if defined(__GNUC__)
    if ((k & 1) == 0)
      __builtin_prefetch(static_cast<const char*>(lines.rows[row]) + line * 64, 0, 2);
#endif
    if (++line == lines.row_lines) line = 0, ++row;
  }
  lines.begin = stop;
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
    if (a.value.paged.present()) return;  // paged: checked block by block instead
    heads = Hk, keys = S_read;
    flags.resize(size_t(B * Hk * S_read));
    const int64_t ld = a.value.stride(2), Ev = a.value.shape(3);
    parallel_for(B * Hk, nthreads, [&](int64_t bh) {
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
