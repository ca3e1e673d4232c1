// The rounded operands of attention with bfloat16 products (see sdpa_bf16.h).
#include "attention/sdpa_bf16.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/sdpa_common.h"
#include "dispatch/parallel.h"

namespace attnx::sdpa {
namespace {

// Rows converted per task (even: whole pairs of keys).
constexpr int64_t kConvertRows = 64;
// An element converted costs about as much time as this many multiply-adds.
constexpr double kConvertWork = 8;

// The extent of axis d that holds distinct rows: 1 where broadcast.
int64_t distinct_extent(const StoredView<float>& v, int d) {
  const bool offsets = v.storage == Storage::kNative ? v.native.batch_offsets != nullptr
                                                     : v.bits.batch_offsets != nullptr;
  return v.stride(d) == 0 && !(d == 0 && offsets) ? 1 : v.shape(d);
}

// Runs body(b, h, j0, n, have, rows, ld) over blocks of the distinct (b, h)
// of v, rows [j0, j0 + n), of which the first `have` are the batch's and
// given as float32 (widened where v is 16-bit, into a buffer per thread
// allocated beforehand, so that a failure raises in the calling thread); the
// rest (a packed batch's rows past its keys, another sequence's) are not
// read. In parallel.
template <typename Body>
void for_float_blocks(const SdpaArgs<float>& a, const StoredView<float>& v,
                      const KernelTable<float>& kt, const Body& body) {
  const int64_t Bx = distinct_extent(v, 0), Hx = distinct_extent(v, 1);
  const int64_t S = v.shape(2), D = v.shape(3);
  const int64_t blocks = (S + kConvertRows - 1) / kConvertRows;
  const int nthreads = threads_for(kConvertWork * double(Bx * Hx * S * D));
  // Native rows are read in place, unless a block of them spans blocks of a pool.
  const bool in_place = v.storage == Storage::kNative && !v.paged.present();
  std::vector<float> widened(in_place ? 0 : size_t(nthreads * kConvertRows * D));
  parallel_for(Bx * Hx * blocks, nthreads, [&](int64_t t) {
    const int64_t bh = t / blocks, j0 = (t % blocks) * kConvertRows;
    const int64_t n = std::min(kConvertRows, S - j0);
    const int64_t have = std::clamp<int64_t>(key_rows(a, bh / Hx) - j0, 0, n);
    float* buf = widened.empty() ? nullptr : widened.data() + current_thread() * kConvertRows * D;
    const RowReader<float> reader = row_reader(v, kt, bh / Hx, bh % Hx);
    int64_t ld = D;
    const float* rows = have > 0 ? reader.rows(j0, have, buf, ld) : nullptr;
    body(bh, j0, n, have, rows, ld);
  });
}

// v's rows rounded to bfloat16, in rows of ld >= D elements (zero past D),
// as a (B', H', S, ld) copy (B', H': 1 where v is broadcast) of bfloat16
// bits (E = uint16_t) or of float32 values (E = float: the operands of
// float32 products on the tile path, which then reads them as it reads
// float32 keys and values, no block widened again for each tile); `view`
// is set to read it as v's shape.
template <typename E>
CacheLineArray<E> rounded_rows(const SdpaArgs<float>& a, const StoredView<float>& v,
                               const KernelTable<float>& kt, const Bf16KernelTable& kt16,
                               int64_t ld, StridedView<const E, 4>& view) {
  const int64_t Bx = distinct_extent(v, 0), Hx = distinct_extent(v, 1);
  const int64_t S = v.shape(2), D = v.shape(3);
  CacheLineArray<E> copy = cache_line_array<E>(size_t(std::max<int64_t>(1, Bx * Hx * S * ld)));
  E* data = copy.get();
  for_float_blocks(a, v, kt, [&](int64_t bh, int64_t j0, int64_t n, int64_t have,
                                 const float* rows, int64_t ldr) {
    for (int64_t j = 0; j < have; ++j) {
      E* dst = data + (bh * S + j0 + j) * ld;
      if constexpr (std::is_same_v<E, float>) {
        std::copy_n(rows + j * ldr, D, dst);
        kt16.round_in_place(dst, D);
      } else {
        kt16.round(rows + j * ldr, D, dst);
      }
      std::fill(dst + D, dst + ld, E(0));
    }
    std::fill(data + (bh * S + j0 + have) * ld, data + (bh * S + j0 + n) * ld, E(0));
  });
  view = StridedView<const E, 4>{};
  view.data = data;
  for (int d = 0; d < 4; ++d) view.shape[d] = v.shape(d);
  view.stride[0] = Bx == 1 ? 0 : Hx * S * ld;
  view.stride[1] = Hx == 1 ? 0 : S * ld;
  view.stride[2] = ld;
  view.stride[3] = 1;
  return copy;
}

// Whether bfloat16 keys can be read in place as pairs: rows of an even
// length, each starting on 4 bytes.
bool pairs_in_place(const StoredView<float>& k) {
  if (k.storage != Storage::kBFloat16 || k.bits.batch_offsets || k.paged.present()) return false;
  const bool even = k.shape(3) % 2 == 0 && k.stride(0) % 2 == 0 && k.stride(1) % 2 == 0 &&
                    k.stride(2) % 2 == 0;
  return even && reinterpret_cast<uintptr_t>(k.bits.data) % 4 == 0;
}

StoredView<float> bits_view(const StridedView<const uint16_t, 4>& bits) {
  StoredView<float> s;
  s.bits = bits;
  s.storage = Storage::kBFloat16;
  return s;
}

// a16's queries: a copy of round(scale * q), contiguous, with a scale of 1
// (the soft cap's division is left to the float32 scores, as the reference
// rounds its operands: scale * q, not scale * q / softcap, which a large cap
// would push into bfloat16's flushed subnormals).
void round_queries(const SdpaArgs<float>& a, const KernelTable<float>& kt,
                   const Bf16KernelTable& kt16, SdpaPath path, Bf16Operands& ops,
                   SdpaArgs<float>& a16) {
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  const int64_t E = a.query.shape[3];
  ops.queries = cache_line_array<float>(size_t(std::max<int64_t>(1, B * Hq * L * E)));
  // The row path's pairs over a bfloat16 cache take them as bfloat16 bits.
  const bool bits = path == SdpaPath::kRows && kt16.scores_bf16_rows &&
                    a.key.storage == Storage::kBFloat16 &&
                    bf16_products() == Bf16Products::kPairs;
  if (bits) ops.query_bits = cache_line_array<uint16_t>(size_t(std::max<int64_t>(1, B * Hq * L * E)));
  const bool split = path == SdpaPath::kRows && kt16.scores_bf16_split &&
                     a.key.storage == Storage::kBFloat16 &&
                     bf16_products() == Bf16Products::kFloat;
  if (split) ops.query_split = cache_line_array<float>(size_t(std::max<int64_t>(1, B * Hq * L * E)));
  const float query_scale = a.scale;
  parallel_for(B * Hq, threads_for(kConvertWork * double(B * Hq * L * E)),
               [&](int64_t bh) {
                 // Packed, the rows past the batch's are another's: left unread.
                 for (int64_t i = 0; i < query_rows(a, bh / Hq); ++i) {
                   float* dst = ops.queries.get() + (bh * L + i) * E;
                   kt.scale(a.query.at(bh / Hq, bh % Hq, i), E, query_scale, dst);
                   kt16.round_in_place(dst, E);
                   if (bits) kt16.round(dst, E, ops.query_bits.get() + (bh * L + i) * E);  // exact
                   if (split) split_bf16_pairs(dst, E, ops.query_split.get() + (bh * L + i) * E);
                 }
               });
  StridedView<const float, 4>& q = a16.query;
  q.data = ops.queries.get();
  q.batch_offsets = nullptr;
  q.stride[0] = Hq * L * E, q.stride[1] = L * E, q.stride[2] = E, q.stride[3] = 1;
  a16.scale = 1.0f;  // query_scale() = 1 / softcap, or 1
}

}  // namespace

void prepare_bf16(const SdpaArgs<float>& a, const KernelTable<float>& kt, SdpaPath path,
                  Bf16Operands& ops, SdpaArgs<float>& a16) {
  const Bf16KernelTable& kt16 = active_bf16_kernels();
  ops.kt16 = &kt16;
  a16 = a;
  const int64_t E = a.query.shape[3];
  // The tile path multiplies pairs (Bf16Products::kPairs), or float32 rows
  // of rounded operands as the other paths do.
  const bool tiles = path == SdpaPath::kTiles;
  ops.as_pairs = tiles && bf16_products() == Bf16Products::kPairs;
  // Queries: the pairs' tile path rounds round(scale * q) as it packs a
  // tile; the others read a copy of them, whose scale is then 1.
  if (!ops.as_pairs) round_queries(a, kt, kt16, path, ops, a16);
  // The row path reads the keys and values where they are (flash_rows).
  if (path == SdpaPath::kRows) return;
  if (tiles && !ops.as_pairs) {
    // float32 products on the tile path: float32 rows of rounded operands,
    // or a pool's blocks rounded as the path reads them.
    if (a.key.paged.present() || a.value.paged.present()) {
      ops.round_blocks = true;
      return;
    }
    StridedView<const float, 4> view;
    ops.float_keys = rounded_rows(a, a.key, kt, kt16, E, view);
    a16.key = StoredView<float>::of(view);
    ops.float_values = rounded_rows(a, a.value, kt, kt16, a.value.shape(3), view);
    a16.value = StoredView<float>::of(view);
    return;
  }

  // Keys: bfloat16 rows of an even length.
  if (!pairs_in_place(a.key)) {
    StridedView<const uint16_t, 4> bits;
    ops.keys = rounded_rows(a, a.key, kt, kt16, (E + 1) / 2 * 2, bits);
    a16.key = bits_view(bits);
  }
  ops.ldk = a16.key.bits.stride[2] / 2;

  // Values: pairs for the tile path (which reads the caller's values only
  // where it falls back to rows), bfloat16 rows for the others.
  if (!ops.as_pairs) {
    // bfloat16 values are read in place, unless they lie in a pool's blocks.
    if (a.value.storage != Storage::kBFloat16 || a.value.paged.present()) {
      StridedView<const uint16_t, 4> bits;
      ops.values = rounded_rows(a, a.value, kt, kt16, a.value.shape(3), bits);
      a16.value = bits_view(bits);
    }
    return;
  }
  const StoredView<float>& v = a.value;
  const int64_t Bx = distinct_extent(v, 0), Hx = distinct_extent(v, 1);
  const int64_t S = v.shape(2), Ev = v.shape(3), S2 = (S + 1) / 2;
  ops.pairs = cache_line_array<uint32_t>(size_t(std::max<int64_t>(1, Bx * Hx * S2 * Ev)));
  ops.pairs_stride[0] = Bx == 1 ? 0 : Hx * S2 * Ev;
  ops.pairs_stride[1] = Hx == 1 ? 0 : S2 * Ev;
  uint32_t* pairs = ops.pairs.get();
  for_float_blocks(a, v, kt, [&](int64_t bh, int64_t j0, int64_t n, int64_t have,
                                 const float* rows, int64_t ld) {
    // j0 is even: the block's pairs are its own. Pairs past the batch's keys
    // are zero (an odd last key's pair is zero in its high half).
    uint32_t* dst = pairs + (bh * S2 + j0 / 2) * Ev;
    if (have > 0) kt16.pack_pairs(rows, ld, 1, have, Ev, 1.0f, dst, Ev);
    std::fill(dst + (have + 1) / 2 * Ev, dst + (n + 1) / 2 * Ev, uint32_t(0));
  });
}

}  // namespace attnx::sdpa
