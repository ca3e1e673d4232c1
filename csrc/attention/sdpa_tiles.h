// The flash-attention path of scaled dot-product attention, a tile of
// queries at a time. See sdpa_tiles.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/sdpa_common.h"
#include "attention/sdpa_context.h"

namespace attnx::sdpa {

// Keys per block of the tile path: at least 128, more for small head dims
// (keys = 48 KiB / ((E + Ev + qt) * sizeof(T)), a multiple of 16, at most
// 256: E = Ev = 16, float32: 192). A block's keys, values and score tile
// come from L2 once per query tile whatever its length, and longer blocks
// amortise the per-block work (the online softmax's rescaling, the P.V
// tile's loads and stores of the accumulator). Sized to fit L1 instead,
// large heads get short blocks and lose to that work (see docs/tuning.md).
// Calls that may skip blocks (`skips_blocks`: a causal band or window, key
// or query lengths, or masks, whose closed blocks are skipped) take at least
// 64 keys instead: blocks of 128 skip too coarsely (block-sparse masks,
// short documents), and for D64 64 keys are as fast. One rule for all of
// them keeps the bits the same whichever way a mask is given: written out
// or broadcast, or as is_causal.
template <typename T>
int64_t tile_key_block(int qt, int64_t E, int64_t Ev, bool skips_blocks) {
  const int64_t keys = (48 * 1024) / ((E + Ev + qt) * int64_t(sizeof(T)));
  return std::clamp<int64_t>(keys / 16 * 16, skips_blocks ? 64 : 128, 256);
}

// Keys per accumulation chunk of the tile path. Blocks add into a chunk's
// accumulator, and chunks into the total: float32 sums then take
// S / kTileChunk + kTileChunk / key_block steps rather than S / key_block,
// which keeps the rounding error of very long key sequences near that of
// short ones (see docs/tuning.md).
constexpr int64_t kTileChunk = 1024;

// Query tiles per task of the flash path where a tile's keys span several
// chunks (see flash_tiles): as many as keep their buffers (queries and
// accumulators) within kTileGroupBytes, next to a chunk's keys and values
// in L2, and at most kMaxTileGroup.
constexpr int64_t kMaxTileGroup = 16;
constexpr int64_t kTileGroupBytes = 512 * 1024;
// Tiles are grouped only where a head's keys and values outgrow this:
// those of 2048 keys of D64 (1 MiB) stay in L2 from one tile to the next,
// where grouping only costs (see docs/tuning.md).
constexpr double kTileGroupMinKeyBytes = 1 << 20;

// A tile whose keys and values come from memory waits on their misses, a
// block at a time: the gemms' broadcasts reach a dozen rows at once, too
// few to keep the memory busy. The first tile of a task that reads them
// from beyond L2 (a head's keys and values read by one task, or too large
// to stay in L2 from one task to the next) then asks for the lines of each
// block's values while it computes the block's scores, and for the next
// block's keys while it accumulates the values, a share before each piece
// of the gemm (asked all at once, they stalled the core). Only in calls
// that read more than kAheadMinCallBytes of keys and values, which do not
// stay in cache from one call to the next: where they did, the requests
// cost more than they saved (see docs/tuning.md).
constexpr double kAheadMinCallBytes = 64 << 20;

// Elements of a FlashTile's buffers, and of the scratch its visits share.
template <typename T>
size_t flash_tile_buffers_size(int qt, int64_t E, int64_t Ev) {
  return size_t(E * qt + 2 * qt * Ev + 3 * qt);
}

template <typename T>
size_t flash_visit_scratch_size(int qt, int64_t E, int64_t Ev, int64_t key_block) {
  return size_t(qt + key_block * qt + 2 * qt + key_block + key_block * (E + Ev) +
                2 * key_block * qt);
}

// The values of one (b, key head), copied by a thread into rows that start
// on cache lines, for the query tiles it runs of that head. P.V loads each
// value row in vectors of the gemm panel's width, a cache line on AVX2 (16
// floats): from a row that does not start on a line, as NumPy's large
// arrays do not (malloc gives 16-byte alignment), each such load reaches into
// two lines, and the lines of a block's values outgrow L1 next to its score
// tile: P.V slows down markedly (see docs/tuning.md). A thread copies a head
// once for all its tiles: where a head has tiles enough (min_tiles_to_align),
// its values are not streamed from memory (ask_ahead), and the copies fit
// kAlignedValuesMaxBytes each and kAlignedValuesMaxCallBytes for all threads.
template <typename T>
struct AlignedValues {
  T* data = nullptr;            // rows of ld elements, the first on a line
  int64_t ld = 0;               // the row length rounded up to whole lines
  int64_t b = -1, kv_head = -1; // whose values data holds
};
// The fewest query tiles per head for which the copy pays: 4 with 32-byte
// vectors, 5 with 64-byte ones, whose aligned loads save less against the
// copy's cost (see docs/tuning.md).
template <typename T>
int64_t min_tiles_to_align(int vector_width) {
  return vector_width * int64_t(sizeof(T)) >= 64 ? 5 : 4;
}
constexpr double kAlignedValuesMaxBytes = 2 << 20;
constexpr double kAlignedValuesMaxCallBytes = 16 << 20;

// The row stride of an AlignedValues copy of rows of Ev elements.
template <typename T>
int64_t aligned_values_ld(int64_t Ev) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(T));
  return (Ev + kLine - 1) / kLine * kLine;
}

// Whether the value rows of (b, key head) all start on cache lines.
template <typename T>
bool value_rows_on_lines(const SdpaArgs<T>& a, int64_t b, int64_t kv_head) {
  return reinterpret_cast<uintptr_t>(a.value.native.at(b, kv_head)) % 64 == 0 &&
         (a.value.native.stride[2] * int64_t(sizeof(T))) % 64 == 0;
}

// `count` consecutive query tiles of (b, h) from query i0, visited a chunk
// of keys at a time: each chunk's keys and values are read from memory into
// L2 once for all the tiles, where one tile at a time through all its keys
// read every chunk again for each tile (once the keys and values of a head
// outgrow L2: S = 4096, D64 is 2 MiB). Each tile sums the same blocks in the
// same order either way: the same bits. `aligned_values`: this thread's copy
// of a head's values where the plan aligns them, else null.
template <typename T>
void flash_tiles(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, int64_t count,
                 T* scratch, AlignedValues<T>* aligned_values);

}  // namespace attnx::sdpa
