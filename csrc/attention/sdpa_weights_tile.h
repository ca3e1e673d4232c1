// The weights path (need_weights) of scaled dot-product attention, a tile of
// queries at a time. See sdpa_weights_tile.cpp.
#pragma once

#include <cstdint>

#include "attention/sdpa_common.h"
#include "attention/sdpa_context.h"

namespace attnx::sdpa {

// The weights path (need_weights) a tile of queries at a time, against all
// its keys at once: the scores come from the kernel's gemm block by block
// (keys x qt, as in the flash tiles) and are masked as there, then transposed
// into the rows of the weights, where each row's softmax is taken as in
// rows_with_weights; the weights then multiply the values block by block,
// read in place by the gemm. Each weight is written once, the keys and
// values are read once per tile. Used where a tile's scores fit
// kWeightsTileBytes; longer key sequences take the row path.
constexpr int64_t kWeightsTileBytes = 2 << 20;

template <typename T>
bool weights_tile_fits(int qt, int64_t S) {
  return S * qt * int64_t(sizeof(T)) <= kWeightsTileBytes;
}

template <typename T>
size_t weights_tile_scratch_size(int qt, int vector_width, int64_t S, int64_t E, int64_t Ev,
                                 int64_t key_block) {
  const int64_t S_lanes = (S + vector_width - 1) / vector_width * vector_width;
  return size_t(E * qt + (S + key_block) * qt + qt * Ev + key_block * (E + Ev) +
                2 * key_block * qt + qt * S_lanes);
}

// One tile of queries from i0 of (b, h) with its weights (see above).
template <typename T>
void weights_tile(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, T* scratch);

}  // namespace attnx::sdpa
