// Scaled dot-product attention, forward: which path a call takes, and how its
// work is cut into tasks for the threads.
//
//   tile path (sdpa_tiles.cpp): flash attention over tiles of queries, for
//     calls with a quarter of a tile of queries per head or more;
//   row path (sdpa_rows.cpp): each query row on its own, for fewer queries
//     (decoding, with long key sequences split into chunks over the
//     threads) and for the weights of long key sequences;
//   weights tile (sdpa_weights_tile.cpp): the weights a tile at a time.
//
// Key range: each row may attend a band of keys (causal, sliding window,
// per-batch key lengths; see KeyRange). Blocks outside every band of a task
// are skipped and never read; only blocks a band end crosses are masked.
// Keys and values stored as 16-bit floats are widened block by block.
//
// Each output row is computed by one thread in a fixed order, so results do
// not depend on the thread count.
#include <algorithm>
#include <utility>
#include <vector>

#include "attention/cache_line_array.h"
#include "attention/mask_blocks.h"
#include "attention/sdpa_common.h"
#include "attention/sdpa_rows.h"
#include "attention/sdpa_tiles.h"
#include "attention/sdpa_weights_tile.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {

using namespace sdpa;

// Scratch memory of the calling thread, uninitialised, kept between calls
// (it only grows): a small call pays neither an allocation nor a fill.
template <typename T>
T* calling_thread_scratch(size_t size) {
  thread_local CacheLineArray<T> buffer;
  thread_local size_t capacity = 0;
  if (size > capacity) {
    buffer = cache_line_array<T>(size);
    capacity = size;
  }
  return buffer.get();
}

template <typename T>
void sdpa_forward(const SdpaArgs<T>& a) {
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  const int64_t Hk = a.key.shape(1), S = a.key.shape(2), E = a.query.shape[3];
  const int64_t Ev = a.value.shape(3);
  if (B == 0 || Hq == 0 || L == 0 || Ev == 0) return;
  const KernelTable<T>& kt = active_kernels(T());
  // Keys past every batch's key length are never read.
  int64_t S_read = S;
  if (a.range.key_lengths) S_read = *std::max_element(a.range.key_lengths, a.range.key_lengths + B);
  // The work that sets the thread count: the multiply-adds, plus the keys
  // and values read (see kStreamedElementWork).
  const double streamed = double(B * Hk) * double(S_read) * double(E + Ev);
  const int nthreads = threads_for(double(B * Hq) * double(L) * double(S_read) * double(E + Ev) +
                                   kStreamedElementWork * streamed);

  // The tile path wants most of a tile's lanes busy; fewer queries per head
  // (decoding) and the weights take the row path. The row path without
  // weights takes the query rows of all heads that share a key head
  // together, and splits long key sequences into chunks merged afterwards,
  // so that one (b, key head) of a decoding step can use every core. The
  // split depends on the shape only, never on the thread count.
  // (With a quarter of a tile of queries, the row path was faster: L8
  // against 32-query tiles, AVX-512, in-process interleaved runs: B8 H12
  // S128 -9%, B4 H12 S1024 -4%, B1 H32 S4096 D128 -23%; L4 against AVX2's
  // 16-query tiles: level to -29%. At L10 the tiles were 21% faster on B4 H12
  // S1024 D64, the rows 13% faster on B1 H32 S4096 D128.)
  const bool tiled = !a.weights && L * 4 > kt.query_tile;
  const bool weights_tiled =
      a.weights && L * 4 >= kt.query_tile && weights_tile_fits<T>(kt.query_tile, S);
  const bool grouped = !tiled && !a.weights;
  const int64_t heads = grouped ? Hk : Hq;
  const int64_t rows_per_head = grouped ? (Hq / Hk) * L : L;
  const int64_t rows_per_task = tiled || weights_tiled ? kt.query_tile : kQueryBlock;
  const int64_t q_blocks = (rows_per_head + rows_per_task - 1) / rows_per_task;
  const int64_t chunks = grouped ? std::max<int64_t>(1, (S_read + kKeyChunk - 1) / kKeyChunk) : 1;
  const bool skips_blocks = a.masks[0].present() || a.masks[1].present() || a.range.causal ||
                            a.range.window_left >= 0 || a.range.window_right >= 0 ||
                            a.range.key_lengths || a.range.query_lengths;
  const int64_t key_block = tile_key_block<T>(kt.query_tile, E, Ev, skips_blocks);
  // Query tiles per task (flash_tiles): several where each tile's keys span
  // several chunks, with tasks enough left to share out; the bits do not
  // depend on it.
  int64_t group = 1;
  if (tiled && S_read > kTileChunk &&
      double(S_read) * double(E + Ev) * sizeof(T) > kTileGroupMinKeyBytes) {
    const size_t buffer_bytes = flash_tile_buffers_size<T>(kt.query_tile, E, Ev) * sizeof(T);
    group = std::clamp<int64_t>(int64_t(kTileGroupBytes / buffer_bytes), 1, kMaxTileGroup);
    group = std::min({group, q_blocks,
                      std::max<int64_t>(1, B * heads * q_blocks / (4 * int64_t(nthreads)))});
  }
  const int64_t q_groups = (q_blocks + group - 1) / group;
  // Whether the first tile of each task asks for its keys and values ahead
  // (see kAheadMinCallBytes): where they come from memory, and each task
  // reads a head's from beyond L2.
  // (The bytes in memory: a batch or head axis of stride 0, broadcast,
  // reads the same rows again.)
  const auto head_bytes_and_count = [&](const StoredView<T>& v, int64_t cols) {
    const double element = double(v.storage == Storage::kNative ? sizeof(T) : sizeof(uint16_t));
    const double heads = double(v.stride(0) != 0 ? B : 1) * double(v.stride(1) != 0 ? Hk : 1);
    return std::make_pair(double(S_read) * double(cols) * element, heads);
  };
  const auto [key_head_bytes, key_heads] = head_bytes_and_count(a.key, E);
  const auto [value_head_bytes, value_heads] = head_bytes_and_count(a.value, Ev);
  const double head_bytes = key_head_bytes + value_head_bytes;
  const bool ask_ahead =
      tiled && key_heads * key_head_bytes + value_heads * value_head_bytes > kAheadMinCallBytes &&
      (q_groups == 1 || head_bytes > kTileGroupMinKeyBytes);
  const int64_t tasks = B * heads * q_groups * chunks;
  // Each thread's copy of a head's values, where their rows miss the cache
  // lines (see AlignedValues): at the end of its scratch.
  const int64_t values_ld = aligned_values_ld<T>(Ev);
  const double values_copy_bytes = double(S) * double(values_ld) * sizeof(T);
  const bool align_values =
      tiled && a.value.storage == Storage::kNative && !ask_ahead &&
      q_blocks >= min_tiles_to_align<T>(kt.vector_width) &&
      values_copy_bytes <= kAlignedValuesMaxBytes &&
      values_copy_bytes * nthreads <= kAlignedValuesMaxCallBytes && !value_rows_on_lines(a, 0, 0);
  const size_t values_copy_size = align_values ? size_t(S * values_ld) + 64 / sizeof(T) : 0;
  const size_t scratch_per_thread = values_copy_size +
      (tiled           ? size_t(group) * flash_tile_buffers_size<T>(kt.query_tile, E, Ev) +
                            flash_visit_scratch_size<T>(kt.query_tile, E, Ev, key_block)
      : weights_tiled ? weights_tile_scratch_size<T>(kt.query_tile, kt.vector_width, S, E, Ev,
                                                     key_block)
      : a.weights     ? size_t(kKeyBlock * (E + Ev))
                      : rows_scratch_size<T>(E, Ev));
  // Allocated before the parallel region: an allocation failure raises here
  // (MemoryError in Python) rather than inside a worker thread.
  T* scratch = calling_thread_scratch<T>(size_t(nthreads) * scratch_per_thread);
  std::vector<AlignedValues<T>> aligned_values(align_values ? nthreads : 0);
  for (int i = 0; i < int(aligned_values.size()); ++i) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(scratch + (i + 1) * scratch_per_thread);
    const uintptr_t start = end - values_copy_size * sizeof(T);
    aligned_values[i].data = reinterpret_cast<T*>((start + 63) / 64 * 64);
    aligned_values[i].ld = values_ld;
  }
  const int64_t state_size = Ev + 3;
  std::vector<T> states(chunks > 1 ? size_t(B * Hq * L * chunks * state_size) : 0);

  // With masks, most query tiles close a key in most blocks, and each then
  // checks that block's values (see visit_flash_chunk): the checks are made once.
  FiniteRows finite_values;
  const bool has_masks = a.masks[0].present() || a.masks[1].present();
  if (tiled && has_masks && a.value.storage == Storage::kNative)
    finite_values.take(a, kt, B, Hk, S_read, nthreads);
  MaskBlockMap<T> mask_blocks;
  if (has_masks && (tiled || weights_tiled))
    mask_blocks.build(a, kt, kt.query_tile, nthreads);

  // Each thread runs a contiguous share of the tasks, in which a head's tasks
  // follow each other, so its keys and values are read into that core's
  // cache alone; a thread done with its share takes the end of another's
  // (kBalanced). Before, heads went whole to whichever thread was free, and
  // a core slowed for a moment left the other idle for up to a head's time
  // at the end. Two threads on a 2-core VM, in-process paired runs: D128
  // L2048 H8 3-7% less time; with another process busy 5 ms in every 10,
  // L1024 3-5% and the causal L2048 3-6%; elsewhere level within 2%.
  parallel_for(tasks, nthreads, Schedule::kBalanced, [&](int64_t t) {
    T* my_scratch = scratch + current_thread() * scratch_per_thread;
    const int64_t c = t % chunks, qg = (t / chunks) % q_groups, bh = t / (chunks * q_groups);
    const int64_t b = bh / heads, h = bh % heads;
    const int64_t qb = qg * group;
    const int64_t r0 = qb * rows_per_task, r1 = std::min(rows_per_head, r0 + rows_per_task);
    if (tiled) {
      flash_tiles(a, kt, b, h, r0, std::min(group, q_blocks - qb), key_block, ask_ahead,
                  my_scratch, finite_values, mask_blocks,
                  align_values ? &aligned_values[current_thread()] : nullptr);
    } else if (weights_tiled) {
      weights_tile(a, kt, b, h, r0, key_block, my_scratch, mask_blocks);
    } else if (a.weights) {
      rows_with_weights(a, kt, b, h, r0, r1, my_scratch);
    } else if (chunks == 1) {
      flash_rows(a, kt, b, h, r0, r1, 0, S_read, my_scratch, static_cast<T*>(nullptr), 1, 0);
    } else {
      const int64_t j_begin = c * kKeyChunk, j_end = std::min(S_read, j_begin + kKeyChunk);
      flash_rows(a, kt, b, h, r0, r1, j_begin, j_end, my_scratch, states.data(), chunks, c);
    }
  });
  if (chunks > 1) {
    parallel_for(B * Hq * L, nthreads, Schedule::kStatic, [&](int64_t row) {
      const int64_t bh = row / L, i = row % L;
      merge_chunks(states.data() + row * chunks * state_size, chunks, state_size, Ev,
                   a.out.at(bh / Hq, bh % Hq, i));
    });
  }
}

template void sdpa_forward<float>(const SdpaArgs<float>&);
template void sdpa_forward<double>(const SdpaArgs<double>&);

}  // namespace attnx
