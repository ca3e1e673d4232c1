#include "attention/masking/mask_blocks.h"

#include <algorithm>

#include "dispatch/parallel.h"

namespace attnx {
namespace {

// The merged state of one block from each mask's block_state bits. Merging
// sums the masks (see merged_masks): the block adds 0 where every mask does,
// and closes every key where one mask does and the others add 0 or close
// too (a +inf or NaN of another mask would make a NaN: mixed).
MaskBlock merge_states(const int* states, int count) {
  bool zero = true, closed_by_one = false, zero_or_closed = true;
  for (int m = 0; m < count; ++m) {
    zero = zero && (states[m] & kBlockAllZero);
    closed_by_one = closed_by_one || (states[m] & kBlockAllClosed);
    zero_or_closed = zero_or_closed && states[m] != 0;
  }
  if (zero) return MaskBlock::kZero;
  if (closed_by_one && zero_or_closed) return MaskBlock::kClosed;
  return MaskBlock::kMixed;
}

}  // namespace

template <typename T>
void MaskBlockMap<T>::build(const SdpaArgs<T>& a, const KernelTable<T>& kt, int query_tile,
                            int threads) {
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  bool any = false, varies_over_queries = false, batch_varies = false, head_varies = false;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    if (mask.stride[3] != 1 && a.mask_cols > 1) return;
    any = true;
    varies_over_queries = varies_over_queries || (mask.stride[2] != 0 && L > 1);
    batch_varies = batch_varies || ((mask.batch_offsets || mask.stride[0] != 0) && B > 1);
    head_varies = head_varies || (mask.stride[1] != 0 && Hq > 1);
  }
  if (!any || !varies_over_queries || a.mask_cols == 0) return;
  batches_ = batch_varies ? B : 1;
  heads_ = head_varies ? Hq : 1;
  query_tile_ = query_tile;
  mask_cols_ = a.mask_cols;
  query_tiles_ = (L + query_tile - 1) / query_tile;
  key_blocks_ = (a.mask_cols + kKeys - 1) / kKeys;
  blocks_.resize(size_t(batches_ * heads_ * query_tiles_ * key_blocks_));
  parallel_for(batches_ * heads_ * query_tiles_, threads, [&](int64_t t) {
    const int64_t slice = t / query_tiles_, i0 = (t % query_tiles_) * query_tile;
    const int64_t b = slice / heads_, h = slice % heads_;
    const int64_t rows = std::min<int64_t>(query_tile, L - i0);
    MaskBlock* out = blocks_.data() + t * key_blocks_;
    for (int64_t k = 0; k < key_blocks_; ++k) {
      const int64_t j0 = k * kKeys, n = std::min(kKeys, a.mask_cols - j0);
      int states[kMaxMasks];
      int count = 0;
      for (const auto& mask : a.masks) {
        if (!mask.present()) continue;
        // A mask broadcast over queries has one row here.
        const int64_t mask_rows = mask.stride[2] == 0 ? 1 : rows;
        states[count++] = kt.block_state(mask.at(b, h, i0) + j0, mask.stride[2], mask_rows, n);
      }
      out[k] = merge_states(states, count);
    }
  });
}

template <typename T>
const MaskBlock* MaskBlockMap<T>::tile(int64_t b, int64_t h, int64_t i0) const {
  if (blocks_.empty()) return nullptr;
  const int64_t slice = (batches_ > 1 ? b : 0) * heads_ + (heads_ > 1 ? h : 0);
  return blocks_.data() + (slice * query_tiles_ + i0 / query_tile_) * key_blocks_;
}

template <typename T>
MaskBlock MaskBlockMap<T>::state(const MaskBlock* blocks, int64_t start, int64_t stop) const {
  const int64_t first = start / kKeys, last = (stop + kKeys - 1) / kKeys;
  const MaskBlock s = blocks[first];
  if (s == MaskBlock::kMixed) return s;
  for (int64_t k = first + 1; k < last; ++k)
    if (blocks[k] != s) return MaskBlock::kMixed;
  return s;
}

template <typename T>
typename MaskBlockMap<T>::Open MaskBlockMap<T>::open_keys(const MaskBlock* blocks) const {
  int64_t first = 0, last = key_blocks_;
  while (first < last && blocks[first] == MaskBlock::kClosed) ++first;
  while (last > first && blocks[last - 1] == MaskBlock::kClosed) --last;
  if (first == last) return {0, 0};
  return {first * kKeys, std::min(last * kKeys, mask_cols_)};
}

template class MaskBlockMap<float>;
template class MaskBlockMap<double>;

}  // namespace attnx
