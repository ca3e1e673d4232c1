// The masks of several query rows as one row of keys, where they are the
// same for each (a key padding mask): which keys they close to all, and
// where they add exactly 0.
#pragma once

#include <cstdint>

#include "attention/masking/key_range.h"
#include "attention/masking/merged_masks.h"
#include "attention/masking/non_finite.h"
#include "attnx/attention.h"

namespace attnx::sdpa {

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
