// The masking of the rows of a row-path task (flash_rows: the query rows of
// the heads that share a key head, over one chunk of keys): the keys any of
// them may attend, in whole blocks, and whether they all read one row of the
// masks. RowMasks classifies each block of keys and applies the bands and
// masks to each row's scores.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/masking/key_range.h"
#include "attention/masking/mask_blocks.h"
#include "attention/masking/merged_masks.h"
#include "attention/masking/shared_masks.h"
#include "attnx/attention.h"

namespace attnx::sdpa {

template <typename T>
struct RowMasks {
  Band keys;                     // the keys the rows read: blocks outside are skipped
  SharedMaskRow<T> first_masks;  // the masks' row of the first row
  bool one_mask_row = false;     // every row reads that same row of the masks

  // Rows r < rows are query row_of[r] of head head_of[r] of batch b; their
  // keys are read from j_begin in blocks of `block` keys. Inlined into the
  // task: a decoding step runs one short task per key head, and a call per
  // task adds to each.
#if defined(__GNUC__)
  __attribute__((always_inline))
#endif
  void begin(const SdpaArgs<T>& a, int64_t b, const int64_t* head_of, const int64_t* row_of,
             int64_t rows, int64_t j_begin, int64_t block) {
    // The keys any of the rows may attend: blocks outside are skipped.
    int64_t lo = a.mask_cols, hi = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const Band band = row_band(a, b, row_of[r]);
      if (!band.empty()) lo = std::min(lo, band.lo), hi = std::max(hi, band.hi);
    }
    // And that the masks leave open to any of them, in whole blocks: the
    // kernels' sums over a block's keys (exp_shift_sum, the P.V) group them by
    // their place in the block, and a block cut at either end would round
    // differently.
    Band mask_open{a.mask_cols, 0};
    for (int64_t r = 0; r < rows; ++r) {
      const Band open_keys =
          keys_open_in_masks(a, shared_mask_row(a, b, head_of[r], row_of[r], 1));
      if (!open_keys.empty())
        mask_open.lo = std::min(mask_open.lo, open_keys.lo),
        mask_open.hi = std::max(mask_open.hi, open_keys.hi);
    }
    // Where every row reads the same row of the masks (a padding mask,
    // broadcast over heads and queries), a block where it adds 0 is not
    // masked (the flash tile does the same).
    first_masks = shared_mask_row(a, b, head_of[0], row_of[0], 1);
    one_mask_row = first_masks.count > 0;
    for (int64_t r = 1; r < rows && one_mask_row; ++r) {
      const SharedMaskRow<T> masks = shared_mask_row(a, b, head_of[r], row_of[r], 1);
      for (int m = 0; m < masks.count; ++m)
        one_mask_row = one_mask_row && masks.rows[m] == first_masks.rows[m];
    }
    if (mask_open.lo > j_begin)
      lo = std::max(lo, j_begin + (mask_open.lo - j_begin) / block * block);
    if (mask_open.hi <= mask_open.lo)
      hi = 0;  // every source key closed
    else if (mask_open.hi > j_begin)
      hi = std::min(hi, j_begin + (mask_open.hi - j_begin + block - 1) / block * block);
    else
      hi = std::min(hi, j_begin);
    keys = Band{lo, hi};
  }

  // What the masks make of keys [start, start + n), a block cut to `keys`
  // (see keys_of_block):
  //   kZero:  the one row of masks the rows read adds 0 to every key: it is
  //           not read (s + 0 is s); the bands still apply;
  //   kMixed: the masks, if any, are added.
  MaskBlock classify(const SdpaArgs<T>& a, int64_t start, int64_t n) const {
    const bool masks_zero =
        one_mask_row && start < a.mask_cols &&
        shared_masks_zero(first_masks, start, std::min(n, a.mask_cols - start));
    return masks_zero ? MaskBlock::kZero : MaskBlock::kMixed;
  }

  // The bands and masks on the scores s of query row i of head h, keys
  // [start, start + n) (see apply_masks).
  KeyStates apply(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t start,
                  int64_t n, T* s, MaskBlock state) const {
    return apply_masks(a, b, h, i, start, n, s, state == MaskBlock::kZero);
  }
};

}  // namespace attnx::sdpa
