// The masks of one query row, merged as torch merges them, and applied with
// the row's band to its scores.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/masking/key_range.h"
#include "attention/masking/non_finite.h"
#include "attnx/attention.h"

namespace attnx::sdpa {

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

}  // namespace attnx::sdpa
