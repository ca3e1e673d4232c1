// Helpers shared by the kernels of one instruction set: cache-line requests,
// an elementwise pass over rows, and local min / max.
// Included only by the kernels' parts (see attention_kernels.h), so that it
// is compiled only with the flags of the instruction set that runs it.
#pragma once

#include <cstdint>

#include "kernels/kernel_table.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// Streaming row kernels (decoding reads every key and value once, from
// memory) ask for the rows kPrefetchBytes ahead of their reads (at least one
// row), rows of at least kPrefetchMinRowBytes. The hardware prefetchers
// alone fall well short of the bandwidth a plain sum reaches. The requests
// go to L2 (prefetcht1), not L1: each request to L1 holds one of the core's
// few L1 miss buffers until its line arrives, which capped a decoding step
// from DRAM well below the read bandwidth; requests to L2 do not (see
// docs/tuning.md).
// Counted in bytes, not rows, so that 16-bit and int8 rows (256 and 128
// bytes at a head dim of 128) are asked for as far ahead as float32 ones.
// The scores, which read four rows at a time a vector of each, ask for the
// line of each row ahead as they load that vector, not for all the lines of
// four rows at once: a burst of requests fills the core's line fill buffers
// and stalls it. (The projections of a few rows, dot_rows, ask for nothing
// ahead: see there.) Measurements: docs/tuning.md.
constexpr int64_t kPrefetchMinRowBytes = 128;
constexpr int64_t kPrefetchBytes = 4096;

// How many rows of `dim` elements of P ahead a streaming kernel prefetches;
// 0: none.
template <typename P>
inline int64_t prefetch_distance(bool stream, int64_t dim) {
  const int64_t row = dim * int64_t(sizeof(P));
  return stream && row >= kPrefetchMinRowBytes ? (kPrefetchBytes + row - 1) / row : 0;
}

// Asks for the cache lines of `rows` rows of `n` elements, `ld` apart, to
// be brought into L2 (see kPrefetchBytes).
template <typename P>
inline void prefetch_rows(const P* first, int64_t ld, int rows, int64_t n) {
#if defined(__GNUC__)
  const char* row = reinterpret_cast<const char*>(first);
  const int64_t bytes = n * int64_t(sizeof(P)), ld_bytes = ld * int64_t(sizeof(P));
  for (int r = 0; r < rows; ++r, row += ld_bytes)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
#else
  (void)first, (void)ld, (void)rows, (void)n;
#endif
}

// Asks for line k of `lines` (see LineRange).
inline void request_line(const LineRange& lines, int64_t k) {
#if defined(__GNUC__)
  const int64_t row = k / lines.row_lines, line = k - row * lines.row_lines;
  __builtin_prefetch(reinterpret_cast<const void*>(
      lines.first + uintptr_t(row * lines.ld_bytes) + uintptr_t(line * 64)));
#else
  (void)lines, (void)k;
#endif
}

// dst[j] = f(src[j]) for j < n (any count: the tail by a partial load and
// store, so nothing past src[n - 1] is read or past dst[n - 1] written), f
// taking and giving a vector of Vec; dst may be src.
template <class Vec, class F>
void map_row(const typename Vec::T* src, int64_t n, typename Vec::T* dst, F f) {
  constexpr int W = Vec::W;
  int64_t j = 0;
  for (; j + W <= n; j += W) Vec::store(dst + j, f(Vec::load(src + j)));
  if (j < n) {
    const int tail = static_cast<int>(n - j);
    Vec::store_partial(dst + j, f(Vec::load_partial(src + j, tail)), tail);
  }
}

// x[r * ld + j] = f(x[r * ld + j]) for r < rows, j < cols (map_row in place).
template <class Vec, class F>
void map_rows(typename Vec::T* x, int64_t rows, int64_t ld, int64_t cols, F f) {
  for (int64_t r = 0; r < rows; ++r) map_row<Vec>(x + r * ld, cols, x + r * ld, f);
}

// group(r0, count, ahead) for the rows four at a time, then one by one:
// only the first group streams the rows read (asks for them `ahead`), the
// others find them in cache.
template <typename Group>
inline void in_row_groups_of_four(int rows, int64_t ahead, Group group) {
  int r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) group(r0, 4, r0 == 0 ? ahead : 0);
  for (; r0 < rows; ++r0) group(r0, 1, r0 == 0 ? ahead : 0);
}

// Local min/max: a std:: template instantiated here could be merged by the
// linker with a copy compiled for another instruction set.
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }

}  // namespace
}  // namespace attnx::simd
