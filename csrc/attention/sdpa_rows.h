// The row path of scaled dot-product attention: each query row against
// blocks of keys with the row kernels (decoding, few queries per head, and
// the weights of long key sequences). See sdpa_rows.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/sdpa_common.h"
#include "attention/sdpa_context.h"

namespace attnx::sdpa {

constexpr int64_t kQueryBlock = 32;   // rows per task on the row path
constexpr int64_t kKeyBlock = 128;    // keys per block on the row path
constexpr int64_t kKeyChunk = 512;    // keys per task on the row path (a multiple of kKeyBlock)
// Rows that read a 16-bit cache in place, widening it in registers, as
// groups of the row kernels' rows (KernelTable::row_group: 16 rows on
// AVX-512, 8 on AVX2): decoding with up to 16 query heads a key head. Past
// that the rows are widened into the buffer (kWidenRows), which every group
// then reads (measurements: docs/tuning.md). The same bits either way.
constexpr int64_t kDirectRowGroups = 4;
// Rows that read an int8 cache in place: the int8 kernels apply a row's
// scale where the buffer does not, so this rule decides the bits, and it
// stays as it was.
constexpr int64_t kDirectInt8Rows = 4;
// Stored rows widened into the buffer (past the rules above) are widened
// this many at a time, and every row takes a part's scores or values before
// the next part is widened: the part stays in L1 (8 KiB at a head dim of
// 128). A multiple of 4, as the kernels group keys by four from a call's
// first: the same bits as one call.
constexpr int64_t kWidenRows = 16;
// Keys per task on the row path for a sequence of `keys` keys: kKeyChunk,
// or with int8 products a quarter of the keys, in whole blocks, from
// kKeyChunk to 4 kKeyChunk. An int8 row is a quarter of a float32 one, so
// that what every task pays (its setup, its state, its share of the merge)
// weighs four times as much on kKeyChunk int8 keys; 4 kKeyChunk of them
// are the bytes of kKeyChunk float32 rows. At most a quarter keeps four
// tasks a sequence for the threads. The sequence's own length sets it, not
// the call's or the thread count, so that a row's bits depend on neither;
// the other precisions keep kKeyChunk, which their bits depend on
// (measurements: docs/tuning.md).
inline int64_t row_key_chunk(bool int8_products, int64_t keys) {
  if (!int8_products) return kKeyChunk;
  const int64_t quarter = (keys + 3) / 4;
  return std::clamp((quarter + kKeyBlock - 1) / kKeyBlock * kKeyBlock, kKeyChunk, 4 * kKeyChunk);
}
// Rows of the next stream the row path asks for before a kernel starts on
// the current one: the row kernels request rows a few ahead of their reads,
// but only within their block, so each switch between the key and the value
// stream (twice a block) would start with misses. The first rows of the
// values are asked for before the scores, those of the next block's keys
// before the values (measurements: docs/tuning.md).
constexpr int64_t kBlockLeadRows = 8;
// Rows past a block that the row path lists for a paged cache's kernels to
// ask for ahead: the distance they ask ahead at most (kPrefetchBytes of
// int8 rows of 128 elements; see docs/tuning.md).
constexpr int64_t kListAhead = 32;

// Scratch of one row-path task.
template <typename T>
size_t rows_scratch_size(int64_t E, int64_t Ev) {
  return size_t(kQueryBlock * (kKeyBlock + Ev + 2) + kKeyBlock * (E + Ev));
}

// Row path over key chunk `chunk` of the plan's chunks (keys [chunk *
// kKeyChunk, + kKeyChunk), or all the keys read where there is one chunk)
// for rows [r0, r1) of one (b, key head): row r is query row r % L of query
// head kv_head * group + r / L, so the query heads that share a key head
// (grouped-query attention) read each block of keys and values once. With
// one chunk it writes the output rows; otherwise each row's softmax state
// (m, l, open, acc[Ev]) goes to its slot for the chunk in the context's
// states, to be merged afterwards.
template <typename T>
void flash_rows(const SdpaContext<T>& c, int64_t b, int64_t kv_head, int64_t r0, int64_t r1,
                int64_t chunk, T* scratch);

// Merges the per-chunk states of one query row, in chunk order:
// M = max_c m_c; l = sum_c l_c e^(m_c - M); acc = sum_c acc_c e^(m_c - M).
template <typename T>
void merge_chunks(const T* states, int64_t chunks, int64_t stride, int64_t Ev, T* out);

// Rows [i0, i1) of one (b, h) with their probabilities written to the
// weights. Keys past the batch's key length are not read; their weights are a closed
// key's: 0, or NaN in a NaN row.
template <typename T>
void rows_with_weights(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, int64_t i1,
                       T* scratch);

}  // namespace attnx::sdpa
