// The key range: the band of source keys each query row may attend, masks
// aside (causal, sliding window, per-batch key and query lengths; see
// KeyRange in attnx/attention.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attnx/attention.h"

namespace attnx::sdpa {

template <typename T>
int64_t key_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.key_lengths ? a.range.key_lengths[b] : a.mask_cols;
}

template <typename T>
int64_t query_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.query_lengths ? a.range.query_lengths[b] : a.query.shape[2];
}

// The query rows batch b has: all L, or, packed, its query length (the
// rows past it are another sequence's).
template <typename T>
int64_t query_rows(const SdpaArgs<T>& a, int64_t b) {
  return a.range.packed ? query_length(a, b) : a.query.shape[2];
}

// The key rows batch b has: all S, or, packed, its key length.
template <typename T>
int64_t key_rows(const SdpaArgs<T>& a, int64_t b) {
  return a.range.packed ? key_length(a, b) : a.key.shape(2);
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

// The keys of the block [j0, j0 + n) that rows reading `keys` compute: the
// block cut to them where it holds source keys only (keys past mask_cols,
// appended, are always attended); an empty band: the block is skipped.
inline Band keys_of_block(Band keys, int64_t mask_cols, int64_t j0, int64_t n) {
  if (j0 + n > mask_cols) return {j0, j0 + n};
  return {std::max(j0, keys.lo), std::min(j0 + n, keys.hi)};
}

}  // namespace attnx::sdpa
