// Bands and masks on a tile of keys x query lanes, as the tile paths (flash
// tiles and the weights tile) close its entries: TileMasks classifies each
// block of keys of a query tile and applies the bands and masks to its
// scores.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/masking/key_range.h"
#include "attention/masking/mask_blocks.h"
#include "attention/masking/merged_masks.h"
#include "attention/masking/non_finite.h"
#include "attention/masking/shared_masks.h"
#include "attnx/attention.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

constexpr int kMaxTile = 64;  // the widest query tile of any kernel

// The lanes of a tile whose band holds key j: both band ends move right with
// the lane, so they are one run [first, last).
struct LaneRun {
  int64_t first, last;
};
inline LaneRun lanes_holding(int64_t j, int64_t rows, const int64_t* lo, const int64_t* hi) {
  int64_t first = 0, last = rows;
  while (first < rows && hi[first] <= j) ++first;
  while (last > first && lo[last - 1] > j) --last;
  return {first, last};
}

// Whether the masks can be read a tile at a time: keys contiguous in every
// mask row (as in a C-contiguous mask, or one broadcast over queries).
template <typename T>
bool masks_contiguous_in_keys(const SdpaArgs<T>& a) {
  for (const auto& mask : a.masks)
    if (mask.present() && mask.stride[3] != 1) return false;
  return true;
}

// close_tile for masks whose keys are contiguous: each mask's block is
// transposed into the tile's layout (keys x lanes) by the kernel, the masks
// are summed there, and the band closes its entries by setting the sum to
// -inf; the scores then take the sums in one pass over the tile. The same
// sums and the same selections as merged_masks, a lane at a time, give the
// same bits, in a fraction of the time masking a lane and a key at a time
// takes (see docs/tuning.md).
template <typename T>
bool close_tile_contiguous(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                           int64_t i0, int64_t rows, int64_t j0, int64_t keys, int qt,
                           const int64_t* lo, const int64_t* hi, T* st, bool* open,
                           T* mask_sums, T* mask_block) {
  bool first_mask = true;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    T* dst = first_mask ? mask_sums : mask_block;
    kt.pack_transposed(mask.at(b, h, i0) + j0, mask.stride[2], rows, keys, T(1), dst, qt);
    // merged_masks starts its sum from 0, which turns a mask of -0 into +0;
    // the sums here may keep -0, which changes only the sign of a zero score,
    // and no exp can see that.
    if (!first_mask) {
      const int64_t count = keys * qt;
      for (int64_t x = 0; x < count; ++x) mask_sums[x] += mask_block[x];
    }
    first_mask = false;
  }
  for (int64_t j = 0; j < keys; ++j) {
    T* sums = mask_sums + j * qt;
    const LaneRun run = lanes_holding(j0 + j, rows, lo, hi);
    std::fill(sums, sums + run.first, kNegInf<T>);
    std::fill(sums + run.last, sums + rows, kNegInf<T>);
  }
  const int lanes = static_cast<int>((rows + kt.vector_width - 1) / kt.vector_width) *
                    kt.vector_width;
  T closed_keys[kMaxTile];  // per lane, counted exactly (keys <= 256)
  kt.add_mask_sums(st, mask_sums, keys, qt, lanes, closed_keys);
  bool any_closed = false;
  for (int64_t r = 0; r < rows; ++r) {
    open[r] = open[r] || closed_keys[r] < T(keys);
    any_closed = any_closed || closed_keys[r] > 0;
  }
  return any_closed;
}

// Step (2) of the tile path on a tile of n keys x QT lanes: lanes r < rows
// are queries i0 + r, whose bands are [lo[r], hi[r]). Returns whether any
// entry was closed. mask_scratch: 2 x n x QT.
template <typename T>
bool close_tile(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h, int64_t i0,
                int64_t rows, int64_t j0, int64_t n, int qt, const int64_t* lo, const int64_t* hi,
                T* st, bool* open, T* mask_scratch) {
  const int64_t masked_end = std::clamp(a.mask_cols, j0, j0 + n);
  if (masked_end < j0 + n) std::fill(open, open + rows, true);  // appended keys are open
  const bool has_masks = a.masks[0].present() || a.masks[1].present();
  if (has_masks && masked_end > j0 && masks_contiguous_in_keys(a))
    return close_tile_contiguous(a, kt, b, h, i0, rows, j0, masked_end - j0, qt, lo, hi, st, open,
                                 mask_scratch, mask_scratch + n * qt);
  const T* mask_rows[kMaxTile][kMaxMasks];  // each lane's row of each mask
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    for (int64_t r = 0; r < rows; ++r) mask_rows[r][count] = mask.at(b, h, i0 + r);
    steps[count++] = mask.stride[3];
  }
  bool any_closed = false;
  for (int64_t j = j0; j < masked_end; ++j) {
    T* srow = st + (j - j0) * qt;
    const auto [first, last] = lanes_holding(j, rows, lo, hi);
    for (int64_t r = 0; r < first; ++r) srow[r] = kNegInf<T>;
    for (int64_t r = last; r < rows; ++r) srow[r] = kNegInf<T>;
    any_closed = any_closed || first > 0 || last < rows;
    if (count == 0) continue;
    for (int64_t r = first; r < last; ++r) {
      const T added = merged_masks(mask_rows[r], steps, count, j);
      const bool is_open = added != kNegInf<T>;
      srow[r] = is_open ? srow[r] + added : kNegInf<T>;
      open[r] = open[r] || is_open;
      any_closed = any_closed || !is_open;
    }
  }
  return any_closed;
}

// The bands of a tile's rows (queries i0 .. i0 + rows - 1 of batch b) into
// lo and hi, and whether each row is open before its masks are read: without
// masks a row has an open key when its band holds one or keys are appended;
// with masks, openness is found while closing. Returns whether there are masks.
template <typename T>
bool tile_bands(const SdpaArgs<T>& a, int64_t b, int64_t qlen, int64_t i0, int64_t rows,
                int64_t* lo, int64_t* hi, bool* open) {
  const bool has_masks = a.masks[0].present() || a.masks[1].present();
  const int64_t klen = key_length(a, b), S = a.key.shape(2);
  for (int64_t r = 0; r < rows; ++r) {
    const Band band = band_of(a.range, qlen, klen, i0 + r);
    lo[r] = band.lo, hi[r] = band.hi;
    open[r] = !has_masks && (!band.empty() || S > a.mask_cols);
  }
  return has_masks;
}

// The masking of one query tile, rows i0 .. i0 + rows - 1 of (b, h), as the
// tile paths (flash tiles, weights tile) apply it: each row's band, the
// masks the rows share, and the tile's blocks in the map of mask blocks.
// For a block of keys, classify() says what the bands and masks make of it,
// and apply() closes the entries of its scores that they close.
template <typename T>
struct TileMasks {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
  // Each row's band, and whether the row has an open key so far.
  int64_t lo[kMaxTile], hi[kMaxTile];
  bool open[kMaxTile];
  bool has_masks = false;
  SharedMaskRow<T> shared_masks;  // the rows' masks as one row, where they share it
  Band mask_open;                 // keys_open_in_masks of shared_masks
  const MaskBlockMap<T>* map = nullptr;
  const MaskBlock* blocks = nullptr;  // the tile's blocks in the map; null where it is empty
  Band map_open;                      // the map's open_keys for the tile, where it has blocks

  // The tile of `rows` rows from query i0 of (b, h), of a batch of qlen queries.
  void begin(const SdpaArgs<T>& a, const MaskBlockMap<T>& mask_blocks, int64_t b_, int64_t h_,
             int64_t qlen, int64_t i0_, int64_t rows_) {
    b = b_, h = h_, i0 = i0_, rows = rows_;
    has_masks = tile_bands(a, b, qlen, i0, rows, lo, hi, open);
    shared_masks = shared_mask_row(a, b, h, i0, rows);
    mask_open = keys_open_in_masks(a, shared_masks);
    map = &mask_blocks;
    blocks = mask_blocks.tile(b, h, i0);
    if (blocks) {
      const auto open_keys = mask_blocks.open_keys(blocks);
      map_open = Band{open_keys.lo, open_keys.hi};
    } else {
      map_open = Band{0, a.mask_cols};
    }
  }

  // The keys the flash tile computes, [lo, hi) (blocks of keys past
  // mask_cols aside, which are always computed). Keys that the masks close
  // for every row are skipped as those outside the band: blocks past the
  // last open key are skipped and the block holding it cut, which keeps the
  // bits (only terms of 0 go). Before the first, only whole blocks of
  // `key_block` keys: the P.V of a block cut at its start would sum its
  // values in other runs (kSumRun) and round differently. So are the blocks
  // that the map of mask blocks finds closed to every row of the tile (a
  // causal or block mask): those at either end here, those between as
  // classify() meets them.
  Band flash_keys(int64_t key_block) const {
    return {std::max({lo[0], mask_open.lo / key_block * key_block,
                      map_open.lo / key_block * key_block}),
            std::min({hi[rows - 1], mask_open.hi, map_open.hi})};
  }

  // The end of the keys the weights tile computes: keys past the last band
  // end, or past the last key the masks leave open to any row (a batch's
  // padding), or past the map's last open block, and not appended, are
  // closed to every row: not read, weight 0. (Only terms of 0 go from the
  // sums: the same bits.)
  int64_t weights_end(const SdpaArgs<T>& a) const {
    const int64_t S = a.key.shape(2);
    const int64_t map_end = blocks ? map_open.hi : S;
    return S > a.mask_cols
               ? S
               : std::min({S, hi[rows - 1], mask_open.empty() ? 0 : mask_open.hi, map_end});
  }

  // Whether the map finds keys [start, start + n) closed to every row.
  bool closed(const SdpaArgs<T>& a, int64_t start, int64_t n) const {
    return blocks && start + n <= a.mask_cols &&
           map->state(blocks, start, start + n) == MaskBlock::kClosed;
  }

  // What the bands and masks make of keys [start, start + n) for the tile:
  //   kClosed: every key closed to every row (by the map): the block adds
  //            no term to any sum and is skipped;
  //   kZero:   every key open to every row, the masks (if any) adding 0
  //            (a padding mask's open keys, a causal mask's blocks below the
  //            diagonal): the scores stand as they are;
  //   kMixed:  a band end crosses the block, or the masks must be added.
  MaskBlock classify(const SdpaArgs<T>& a, int64_t start, int64_t n) const {
    MaskBlock state = MaskBlock::kMixed;
    if (blocks && start + n <= a.mask_cols) {
      state = map->state(blocks, start, start + n);
      if (state == MaskBlock::kClosed) return state;
    }
    // The band rules only where a band end crosses the block.
    const int64_t source_end = std::min(start + n, a.mask_cols);
    const bool crosses_band =
        start < source_end && (start < lo[rows - 1] || source_end > hi[0]);
    if (crosses_band) return MaskBlock::kMixed;
    if (!has_masks) return MaskBlock::kZero;
    if (start + n <= a.mask_cols &&
        (state == MaskBlock::kZero || shared_masks_zero(shared_masks, start, n)))
      return MaskBlock::kZero;
    return MaskBlock::kMixed;
  }

  // Whether the values of the keys in [start, start + n) that some row has
  // closed are all finite (check(j0, count) says so of keys [j0, j0 + count)),
  // as step (4) asks before it adds a block's values to every row at once.
  // Without masks, the keys open to every row are those of the rows' common
  // band, [lo of the last row, hi of the first): only the keys outside it
  // are checked (a causal tile's diagonal: at most a tile's width of keys).
  template <typename Check>
  bool closed_values_finite(const SdpaArgs<T>& a, int64_t start, int64_t n,
                            const Check& check) const {
    if (has_masks) return check(start, n);
    const int64_t end = std::min(start + n, a.mask_cols);  // appended keys are open
    const int64_t before = std::clamp<int64_t>(lo[rows - 1], start, end);
    const int64_t after = std::clamp<int64_t>(hi[0], before, end);
    return (before == start || check(start, before - start)) &&
           (after == end || check(after, end - after));
  }

  // Step (2) of the tile paths on the scores st (n keys x the tile's lanes)
  // of a block that classify() found `state`: closes the entries the bands
  // and masks close, adds the masks to the others, and marks the rows that
  // have an open key. Returns whether any entry was closed. mask_scratch:
  // 2 x n x query_tile.
  bool apply(const SdpaArgs<T>& a, const KernelTable<T>& kt, MaskBlock state, int64_t start,
             int64_t n, T* st, T* mask_scratch) {
    if (state == MaskBlock::kZero) {
      if (has_masks) std::fill(open, open + rows, true);
      return false;
    }
    return close_tile(a, kt, b, h, i0, rows, start, n, kt.query_tile, lo, hi, st, open,
                      mask_scratch);
  }
};

}  // namespace attnx::sdpa
