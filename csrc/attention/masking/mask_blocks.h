// Which blocks of a call's masks close every key, add exactly 0, or neither.
//
// The tile paths (flash_tiles, weights_tile) work on a grid of query tiles x
// key blocks. Where the masks vary over the queries (an (L, S) causal or
// block mask, a (B, 1, L, S) mask that folds padding into it, as model code
// passes to scaled_dot_product_attention), many of its blocks are all -inf
// or all 0. A closed block is skipped as a block outside a causal band is (a
// closed key adds no term to any sum: the same bits); a zero block is not
// masked at all (s + 0 is s). Only the other blocks are transposed into the
// tile and added. The map reads each mask block once a call, where the
// tiles would read it once per head.
#pragma once

#include <cstdint>
#include <vector>

#include "attnx/attention.h"
#include "kernels/kernel_table.h"

namespace attnx {

enum class MaskBlock : uint8_t {
  kMixed,   // anything else: masked entry by entry
  kZero,    // every mask adds 0 to every entry
  kClosed,  // every entry is -inf after merging (and none NaN)
};

template <typename T>
class MaskBlockMap {
 public:
  // Keys per block of the map. Finer than the tiles' key blocks (128 and
  // more), so that a tile's open keys end within 16 of its last open key: a
  // causal mask's diagonal block is cut there as is_causal cuts it, where a
  // map of whole key blocks left up to 96 keys of it computed (see
  // docs/tuning.md).
  static constexpr int64_t kKeys = 16;

  // Classifies the blocks of query tiles of `query_tile` rows (from row 0 of
  // each (b, h)) x kKeys keys (from key 0, up to a.mask_cols). Left empty
  // where no mask varies over the queries (the shared-row rules of the tile
  // paths cover those) or a mask's keys are not contiguous.
  void build(const SdpaArgs<T>& a, const KernelTable<T>& kt, int query_tile, int threads);

  // The blocks of the query tile starting at row i0 of (b, h), one per kKeys
  // keys; null when the map is empty.
  const MaskBlock* tile(int64_t b, int64_t h, int64_t i0) const;

  // The state of keys [start, stop) (within mask_cols) for the tile of
  // `blocks`: closed or zero where every block they touch is, else mixed.
  MaskBlock state(const MaskBlock* blocks, int64_t start, int64_t stop) const;

  // The keys [lo, hi) from the first block of `blocks` that is not closed to
  // the end of the last; {0, 0} when every block is closed.
  struct Open {
    int64_t lo, hi;
  };
  Open open_keys(const MaskBlock* blocks) const;

 private:
  std::vector<MaskBlock> blocks_;
  int64_t batches_ = 0, heads_ = 0;  // 1 where the masks are broadcast over that dim
  int64_t query_tiles_ = 0, key_blocks_ = 0;
  int64_t query_tile_ = 0, mask_cols_ = 0;
};

}  // namespace attnx
