// What the paths of scaled dot-product attention share: keys and values read
// as T, the band of keys each query row may attend, and the masks applied a
// row at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/softmax_rules.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

constexpr int kMaxTile = 64;  // the widest query tile of any kernel

// Rows of one (b, head) of the keys or the values, as T: read in place, or
// widened from 16-bit storage into a buffer one block at a time.
template <typename T>
struct RowReader {
  const T* native = nullptr;
  const uint16_t* bits = nullptr;
  int bits_kind = 0;  // 0 float16, 1 bfloat16: the index of the 16-bit row kernels
  int64_t ld = 0, dim = 0;
  void (*widen)(const uint16_t*, int64_t, float*) = nullptr;

  // Rows [j0, j0 + n); sets row_stride. buf holds n * dim values.
  const T* rows(int64_t j0, int64_t n, T* buf, int64_t& row_stride) const {
    if (!bits) {
      row_stride = ld;
      return native + j0 * ld;
    }
    if constexpr (std::is_same_v<T, float>) {
      const uint16_t* src = bits + j0 * ld;
      if (ld == dim) {
        widen(src, n * dim, buf);
      } else {
        for (int64_t j = 0; j < n; ++j) widen(src + j * ld, dim, buf + j * dim);
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
    r.bits = v.bits.at(b, h);
    r.bits_kind = v.storage == Storage::kFloat16 ? 0 : 1;
    r.widen = v.storage == Storage::kFloat16 ? kt.widen_float16 : kt.widen_bfloat16;
  }
  return r;
}

template <typename T>
int64_t key_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.key_lengths ? a.range.key_lengths[b] : a.mask_cols;
}

template <typename T>
int64_t query_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.query_lengths ? a.range.query_lengths[b] : a.query.shape[2];
}

// The source keys [lo, hi) a row may attend, masks aside (see KeyRange).
// hi <= the key length always; an empty band has lo == hi. Over the rows of
// one batch both ends only move right, padding rows aside.
struct Band {
  int64_t lo = 0, hi = 0;
  bool empty() const { return hi <= lo; }
};

// The band of row i of a batch whose query and key lengths are qlen and klen.
inline Band band_of(const KeyRange& r, int64_t qlen, int64_t klen, int64_t i) {
  if (i >= qlen) return {0, 0};
  Band band{0, klen};
  if (r.banded()) {
    const int64_t diagonal = i + (r.bottom_right ? klen - qlen : 0);
    if (r.causal) band.hi = std::min(band.hi, diagonal + 1);
    if (r.window_right >= 0) band.hi = std::min(band.hi, diagonal + r.window_right + 1);
    if (r.window_left >= 0) band.lo = std::min(klen, std::max(band.lo, diagonal - r.window_left));
  }
  band.hi = std::max(band.hi, band.lo);
  return band;
}

template <typename T>
Band row_band(const SdpaArgs<T>& a, int64_t b, int64_t i) {
  return band_of(a.range, query_length(a, b), key_length(a, b), i);
}

// What masking found in a range of keys.
struct KeyStates {
  bool any_open = false;
  bool any_closed = false;
};

// The masks' values for key j, summed as torch merges them. The key is closed
// where the sum is -inf; a +inf or NaN of one mask where another is -inf sums
// to NaN, so the key stays open and the NaN reaches the row, as in torch.
template <typename T>
T merged_masks(const T* const* rows, const int64_t* steps, int count, int64_t j) {
  T sum = 0;
  for (int m = 0; m < count; ++m) sum += rows[m][j * steps[m]];
  return sum;
}

// Applies the key range and the masks to the scores of query row i against
// keys [j0, j0 + n). A closed key (outside the row's band, or masks summing
// to -inf) gets the score -inf by selection, not addition, so that a NaN in
// its key cannot reach this row. `masks_zero`: the caller knows the masks
// add exactly 0 to these keys (s + 0 is s), and they are not read.
template <typename T>
KeyStates apply_masks(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j0,
                      int64_t n, T* s, bool masks_zero = false) {
  const int64_t end = j0 + n;
  const int64_t masked_end = std::clamp(a.mask_cols, j0, end);  // keys past it are always open
  const Band band = row_band(a, b, i);
  int64_t open_begin = std::max(j0, band.lo), open_end = std::min(masked_end, band.hi);
  if (open_end < open_begin) open_begin = open_end = j0;
  for (int64_t j = j0; j < open_begin; ++j) s[j - j0] = kNegInf<T>;
  for (int64_t j = open_end; j < masked_end; ++j) s[j - j0] = kNegInf<T>;
  KeyStates states;
  states.any_open = masked_end < end;
  states.any_closed = open_begin > j0 || open_end < masked_end;
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks)
    if (mask.present()) rows[count] = mask.at(b, h, i), steps[count++] = mask.stride[3];
  if (count == 0 || masks_zero) {
    states.any_open = states.any_open || open_end > open_begin;
    return states;
  }
  for (int64_t j = open_begin; j < open_end; ++j) {
    const T added = merged_masks(rows, steps, count, j);
    const bool open = added != kNegInf<T>;
    s[j - j0] = open ? s[j - j0] + added : kNegInf<T>;
    states.any_open = states.any_open || open;
    states.any_closed = states.any_closed || !open;
  }
  return states;
}

// Whether query i may not attend key j (outside its band, or masked).
template <typename T>
bool key_closed(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (j >= a.mask_cols) return false;
  const Band band = row_band(a, b, i);
  if (j < band.lo || j >= band.hi) return true;
  T added = 0;  // as merged_masks
  for (const auto& mask : a.masks)
    if (mask.present()) added += mask.at(b, h, i)[j * mask.stride[3]];
  return added == kNegInf<T>;
}

template <typename T>
bool rows_finite(const KernelTable<T>& kt, const T* v, int64_t ldv, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j)
    if (!kt.all_finite(v + j * ldv, dim)) return false;
  return true;
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
// blocks of values again and again (a masked call: B2 H12 L512, 6.6% of
// its time went to those checks).
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
      for (int64_t j = 0; j < S_read; ++j) f[j] = kt.all_finite(rows + j * ld, Ev) ? 1 : 0;
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

// The masks of rows [i0, i0 + rows) of (b, h) as one row of keys, where
// they are the same for each of those rows: broadcast over queries (as a
// key padding mask is), or a single row. `shared` is false otherwise.
template <typename T>
struct SharedMaskRow {
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  bool shared = true;
  T at(int64_t j) const { return merged_masks(rows, steps, count, j); }
};

template <typename T>
SharedMaskRow<T> shared_mask_row(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i0,
                                 int64_t rows) {
  SharedMaskRow<T> row;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    if (rows > 1 && mask.stride[2] != 0) row.shared = false;
    row.rows[row.count] = mask.at(b, h, i0);
    row.steps[row.count++] = mask.stride[3];
  }
  return row;
}

// The source keys [lo, hi) outside of which the shared masks close every
// key (a batch's padding), so that those keys need not be computed; all of
// [0, mask_cols) where the masks are not shared. A closed key adds nothing
// to a row (probability 0, its value never read).
template <typename T>
Band keys_open_in_masks(const SdpaArgs<T>& a, const SharedMaskRow<T>& masks) {
  Band open{0, a.mask_cols};
  if (!masks.shared || masks.count == 0) return open;
  while (open.lo < open.hi && masks.at(open.lo) == kNegInf<T>) ++open.lo;
  while (open.hi > open.lo && masks.at(open.hi - 1) == kNegInf<T>) --open.hi;
  return open;
}

// Whether the shared masks add exactly 0 to keys [j0, j0 + n): the open
// keys of a padding mask, which then need no masking (s + 0 is s).
template <typename T>
bool shared_masks_zero(const SharedMaskRow<T>& masks, int64_t j0, int64_t n) {
  if (!masks.shared) return false;
  for (int64_t j = j0; j < j0 + n; ++j)
    if (masks.at(j) != T(0)) return false;
  return true;
}

}  // namespace attnx::sdpa
