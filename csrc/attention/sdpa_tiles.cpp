// The flash-attention path of scaled dot-product attention (no L x S
// matrix is stored), per task one or more tiles of QT queries of one
// (b, h), with QT the kernel's lane count:
//   Qt = scale * Q_tile^T                                   (E x QT, packed once)
//   m = -inf, l = 0, O = 0                                  per query lane
//   for each key block Kb, Vb the tile may attend:
//     St = Kb . Qt              (keys x queries: lanes are queries)      (1)
//     St = c tanh(St / c), with a soft cap c
//     close masked / out-of-band entries: St = -inf by selection         (2)
//     online softmax down each column: m, l, alpha; St = exp(St - m)     (3)
//     O = diag(alpha) O + St^T . Vb                                      (4)
//   out = O / l, or 0 for a query with no open key                       (5)
// Computing St rather than S keeps the softmax vertical (no horizontal
// reductions), and both products read K and V rows in place, unpacked.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <type_traits>
#include <utility>

#include "attention/sdpa_tiles.h"

namespace attnx::sdpa {
namespace {

// Asks for every cache line of `rows` rows of `bytes` bytes, `ld` elements
// apart, at once: the transposing pack then reads them from cache instead of
// waiting on a few misses at a time.
template <typename T>
void prefetch_rows(const T* first, int64_t ld, int64_t rows, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(first + r * ld);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
  }
#else
  (void)first, (void)ld, (void)rows, (void)bytes;
#endif
}

// Pieces of the gemms between requests: keys of the scores (a multiple of
// the register tiles' 12 rows), columns of the values. The pieces sum
// every output as the whole gemm does: the same bits.
constexpr int64_t kAheadKeysPerPiece = 48;
constexpr int64_t kAheadColumnsPerPiece = 32;

// The query rows of the tile after (b, h, i0) in the order of the tasks,
// which another thread may take; none after the last.
template <typename T>
LineRange next_tile_queries(const SdpaArgs<T>& a, int64_t qt, int64_t b, int64_t h, int64_t i0) {
  const int64_t B = a.query.shape[0], H = a.query.shape[1], L = a.query.shape[2];
  i0 += qt;
  if (i0 >= L) i0 = 0, ++h;
  if (h >= H) h = 0, ++b;
  if (b >= B) return LineRange{};
  return row_lines(a.query.at(b, h, i0), a.query.stride[2], std::min(qt, L - i0),
                   a.query.shape[3]);
}

// One query tile of the flash path, whose keys may be visited a chunk at a
// time with other tiles' visits between (see flash_tiles): what a tile
// keeps from one chunk to the next. Its buffers are in the scratch of the
// thread that runs it.
template <typename T>
struct FlashTile {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
  int lanes = 0;  // the tile's queries rounded up to whole vectors
  TileMasks<T> masks;  // each lane's band, the masks, the tile's mask blocks
  Band keys;           // the keys the tile computes (see TileMasks::flash_keys)
  LineRequests pending;
  int64_t request_from = 0;
  bool have_total = false;  // whether o_total and l_total hold a merged chunk
  T* q_t = nullptr;      // E x qt: the scaled queries, transposed
  T* o = nullptr;        // qt x Ev: the chunk's accumulator
  T* o_total = nullptr;  // qt x Ev: the chunks merged so far
  T* l = nullptr;        // qt: the chunk's sums
  T* l_total = nullptr;  // qt
  T* m = nullptr;        // qt: the running max
};

// Sets up the tile starting at query i0 of (b, h): zeroes its padding rows,
// finds its bands and keys, packs its queries. False when no row is left.
template <typename T>
bool begin_flash_tile(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, T* buffers,
                      FlashTile<T>& t) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const int64_t key_block = c.plan.key_block;
  const int qt = kt.query_tile;
  const int64_t L = a.query.shape[2], S = a.key.shape(2);
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  // Padding rows (past the batch's query length) are zero; packed, they are
  // another sequence's.
  const int64_t tile_rows = std::min<int64_t>(qt, L - i0);
  const int64_t qlen = query_length(a, b);
  const int64_t rows = std::clamp<int64_t>(qlen - i0, 0, tile_rows);
  for (int64_t r = rows; r < tile_rows && !a.range.packed; ++r) {
    T* out = a.out.at(b, h, i0 + r);
    std::fill(out, out + Ev, T(0));
  }
  if (rows == 0) return false;
  t.b = b, t.h = h, t.i0 = i0, t.rows = rows;
  t.q_t = buffers;
  t.o = t.q_t + E * qt;
  t.o_total = t.o + qt * Ev;
  t.l = t.o_total + qt * Ev;
  t.l_total = t.l + qt;
  t.m = t.l_total + qt;

  t.masks.begin(a, c.mask_blocks, b, h, qlen, i0, rows);
  t.keys = t.masks.flash_keys(key_block);

  // The query lanes computed: the tile's queries rounded up to whole vectors
  // (the tile of a short sequence, or the last of a longer one, leaves the
  // rest of the query_tile lanes idle).
  t.lanes = static_cast<int>((rows + kt.vector_width - 1) / kt.vector_width) * kt.vector_width;
  // Pack the scaled query tile, transposed; lanes past the last query are 0.
  // With bfloat16 products, as pairs along the head dim, in the same buffer.
  prefetch_rows(a.query.at(b, h, i0), a.query.stride[2], rows, E * int64_t(sizeof(T)));
  const bool pairs = c.bf16 && c.bf16->as_pairs;
  if constexpr (std::is_same_v<T, float>) {
    if (pairs) {
      uint32_t* q_pairs = reinterpret_cast<uint32_t*>(t.q_t);
      std::fill_n(q_pairs, (E + 1) / 2 * qt, uint32_t(0));
      c.bf16->kt16->pack_pairs(a.query.at(b, h, i0), 1, a.query.stride[2], E, rows, a.scale,
                               q_pairs, qt);
    }
  }
  // The rounded queries of float32 products carry their scale (1): the
  // soft cap divides the scores, as with pairs.
  if (!pairs)
    kt.pack_transposed(a.query.at(b, h, i0), a.query.stride[2], rows, E,
                       c.bf16 ? a.scale : a.query_scale(), t.q_t, qt);
  std::fill(t.m, t.m + qt, kNegInf<T>);
  t.have_total = false;

  // The lines of this tile's output rows and of the next tile's query rows
  // are requested during the softmax of the last blocks, a line of each per
  // key, so that the stores of finish_flash_tile and the next tile's pack
  // find them in cache: each would otherwise cost a burst of misses per
  // tile that stalls the core (see docs/tuning.md).
  t.pending = LineRequests{};
  t.pending.ranges[0] = row_lines(a.out.at(b, h, i0), a.out.stride[2], rows, Ev);
  t.pending.ranges[1] = next_tile_queries(a, qt, b, h, i0);
  const int64_t most_lines = std::max(t.pending.ranges[0].size(), t.pending.ranges[1].size());
  const int64_t last_key = S > a.mask_cols ? S : std::min(S, t.keys.hi);
  t.request_from = last_key - (most_lines + key_block - 1) / key_block * key_block;
  return true;
}

// The scores of keys [start, start + n) with bfloat16 products: the keys'
// pairs times the tile's query pairs (packed by begin_flash_tile, with the
// scale alone: the soft cap divides the float32 scores).
template <typename T>
void bf16_scores(const SdpaContext<T>& c, const FlashTile<T>& t, int64_t kv_head, int64_t start,
                 int64_t n, T* st) {
  if constexpr (std::is_same_v<T, float>) {
    const int qt = c.kt.query_tile;
    const int64_t E = c.args.query.shape[3];
    c.bf16->kt16->gemm(n, t.lanes, (E + 1) / 2, c.bf16->key_pairs(c.args, t.b, kv_head, start),
                       c.bf16->ldk, 1, reinterpret_cast<const uint32_t*>(t.q_t), qt, st, qt,
                       GemmInit::kZero, nullptr);
  }
}

// P.V of keys [start, start + n) with bfloat16 products: the probabilities
// (st, keys x lanes) packed as pairs of keys into `scratch` and multiplied
// with the call's value pairs into the chunk's accumulator (written by the
// first block, else rescaled by alpha). A pair reaches one key past each end
// of the block where it starts or ends between two keys; that key's
// probability is 0, which adds nothing unless its value is not finite
// (0 * NaN). False where that, or a closed key's value that is not finite,
// asks for the row by row form: nothing is then done.
template <typename T>
bool bf16_values(const SdpaContext<T>& c, const FlashTile<T>& t, int64_t kv_head, int64_t start,
                 int64_t n, bool any_closed, bool first_block, const T* alpha, T* st, T* scratch,
                 T* v_buf) {
  if constexpr (std::is_same_v<T, float>) {
    const SdpaArgs<float>& a = c.args;
    const KernelTable<float>& kt = c.kt;
    const int qt = kt.query_tile;
    const int64_t Ev = a.value.shape(3), S = a.value.shape(2);
    const RowReader<float> values = row_reader(a.value, kt, t.b, kv_head);
    const auto finite = [&](int64_t j0, int64_t count) {
      return c.finite_values.all(t.b, kv_head, j0, count, [&] {
        int64_t ld;
        const float* rows = values.rows(j0, count, v_buf, ld);
        return rows_finite(kt, rows, ld, count, Ev);
      });
    };
    const int64_t lead = start % 2, keys = lead + n;
    // Packed, the pair past the batch's last key is zero in the pairs' copy.
    const bool tail = keys % 2 == 1 && start + n < std::min(S, key_rows(a, t.b));
    if (any_closed && !finite(start, n)) return false;
    if ((lead && !finite(start - 1, 1)) || (tail && !finite(start + n, 1))) return false;
    if (lead) std::fill_n(st - qt, qt, 0.0f);  // the key before: probability 0
    uint32_t* p_pairs = reinterpret_cast<uint32_t*>(scratch);
    const Bf16KernelTable& kt16 = *c.bf16->kt16;
    kt16.pack_pairs(st - lead * qt, qt, 1, keys, t.rows, 1.0f, p_pairs, qt);
    kt16.gemm(t.rows, Ev, (keys + 1) / 2, p_pairs, 1, qt,
              c.bf16->value_pairs(t.b, kv_head, (start - lead) / 2, Ev), Ev, t.o, Ev,
              first_block ? GemmInit::kZero : GemmInit::kScaleRows, alpha);
    return true;
  } else {
    return false;
  }
}

// The tile's keys in the chunk [c0, c1): its blocks added into the chunk's
// accumulator, which is then merged into the total.
// A paged cache's native keys' scores, read in place block by block (the
// scores of a key do not depend on the keys beside it). Out of line: the
// flash chunk's loop stays as small as without paging.
template <typename T>
[[gnu::noinline]] void paged_scores(const KernelTable<T>& kt, const RowReader<T>& keys,
                                    const FlashTile<T>& t, int64_t start, int64_t n, int64_t E,
                                    T* st) {
  const int qt = kt.query_tile;
  keys.for_each_run(start, n, [&](int64_t j, int64_t count, int64_t first, const float*) {
    kt.gemm(count, t.lanes, E, keys.native + first, keys.ld, 1, t.q_t, qt,
            st + (j - start) * qt, qt, GemmInit::kZero, nullptr);
  });
}

// A paged cache's native values times the probabilities, in place block by
// block: the first block starts the sum as one call would, the others add
// to it.
template <typename T>
[[gnu::noinline]] void paged_values(const KernelTable<T>& kt, const RowReader<T>& values,
                                    int64_t rows, int64_t start, int64_t n, int64_t Ev, int qt,
                                    const T* st, bool first_block, const T* alpha, T* o) {
  values.for_each_run(start, n, [&](int64_t j, int64_t count, int64_t first, const float*) {
    const GemmInit init = j > start      ? GemmInit::kAccumulate
                          : first_block ? GemmInit::kZero
                                        : GemmInit::kScaleRows;
    kt.gemm(rows, Ev, count, st + (j - start) * qt, 1, qt, values.native + first,
            values.ld, o, Ev, init, alpha);
  });
}

template <typename T>
void visit_flash_chunk(const SdpaContext<T>& c, FlashTile<T>& t, int64_t c0, int64_t c1,
                       T* scratch, bool ask_ahead, const AlignedValues<T>* aligned_values) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const FiniteRows& finite_values = c.finite_values;
  const int64_t key_block = c.plan.key_block;
  if (c1 <= a.mask_cols && (c1 <= t.keys.lo || c0 >= t.keys.hi)) return;  // outside every band
  const int qt = kt.query_tile;
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  const int64_t b = t.b, h = t.h, i0 = t.i0, rows = t.rows;
  const int64_t S = a.key.shape(2);
  const int64_t kv_head = h / (a.query.shape[1] / a.key.shape(1));
  T* st = scratch + qt;             // key_block x qt, after a row for bf16_values
  T* alpha = st + key_block * qt;   // qt
  T* m_start = alpha + qt;          // qt: the running max when the chunk began
  T* p_row = m_start + qt;          // key_block
  T* k_buf = p_row + key_block;     // key_block x E: widened keys
  T* v_buf = k_buf + key_block * E; // key_block x Ev: widened values
  T* mask_scratch = v_buf + key_block * Ev;  // 2 x key_block x qt: masks in the tile's layout
  T* o = t.o;
  T* l = t.l;
  T* m = t.m;
  const bool pairs = c.bf16 && c.bf16->as_pairs;
  const bool round_blocks = c.bf16 && c.bf16->round_blocks;
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  RowReader<T> values = row_reader(a.value, kt, b, kv_head);
  if (aligned_values) values.native = aligned_values->data, values.ld = aligned_values->ld;

  std::fill(l, l + qt, T(0));
  std::copy_n(m, qt, m_start);
  // The chunk's first computed block writes o rather than rescaling it
  // (o is not cleared beforehand).
  bool first_block = true;
  for (int64_t j0 = c0; j0 < c1; j0 += key_block) {
    // A block outside the tile's keys is skipped, one across their ends is
    // cut (causal: the diagonal block), and one the map closes is skipped.
    const Band part = keys_of_block(t.keys, a.mask_cols, j0, std::min(key_block, c1 - j0));
    if (part.empty()) continue;
    const int64_t start = part.lo, n = part.hi - part.lo;
    const MaskBlock mask_block = t.masks.classify(a, start, n);
    if (mask_block == MaskBlock::kClosed) continue;
    // (1) scores
    int64_t ldk, ldv;
    if (pairs) {
      bf16_scores(c, t, kv_head, start, n, st);
    } else if (__builtin_expect(!round_blocks && keys.blocks && !keys.stored(), 0)) {
      paged_scores(kt, keys, t, start, n, E, st);
    } else {
      const T* kb = keys.rows(start, n, k_buf, ldk);
      // float32 products over a pool: the block rounded in the buffer.
      if (round_blocks) kb = bf16_rounded_rows(c, kb, ldk, n, E, k_buf), ldk = E;
      if (ask_ahead) {
        LineRange value_lines = stored_row_lines(a.value, b, kv_head, start, n);
        const int64_t pieces = (n + kAheadKeysPerPiece - 1) / kAheadKeysPerPiece;
        for (int64_t j = 0; j < n; j += kAheadKeysPerPiece) {
          request_lines_to_l2(value_lines, (value_lines.end + pieces - 1) / pieces);
          kt.gemm(std::min(kAheadKeysPerPiece, n - j), t.lanes, E, kb + j * ldk, ldk, 1, t.q_t,
                  qt, st + j * qt, qt, GemmInit::kZero, nullptr);
        }
      } else {
        kt.gemm(n, t.lanes, E, kb, ldk, 1, t.q_t, qt, st, qt, GemmInit::kZero, nullptr);
      }
    }
    soft_cap(a, kt, st, n, qt, t.lanes, !c.bf16 && a.softcap_folded());
    // (2) bands and masks
    const bool any_closed = t.masks.apply(a, kt, mask_block, start, n, st, mask_scratch);
    // (3) online softmax
    if (start >= t.request_from) {
      kt.softmax_tile(st, n, t.lanes, m, l, alpha, t.pending);
      for (LineRange& range : t.pending.ranges) range.begin = std::min(range.end, range.begin + n);
    } else {
      kt.softmax_tile(st, n, t.lanes, m, l, alpha, LineRequests{});
    }
    // (4) accumulate. A closed key has probability 0, and 0 * NaN would
    // carry a NaN in its value into this row: where keys were closed and
    // the values are not all finite, accumulate row by row, key by key
    // (see accumulate_values).
    if (pairs && bf16_values(c, t, kv_head, start, n, any_closed, first_block, alpha, st,
                             mask_scratch, v_buf)) {
      first_block = false;
      continue;
    }
    // float32 products of rounded operands: the probabilities rounded here
    // (the values are bfloat16 rows).
    if (c.bf16 && !pairs) round_operands(c, st, n * qt);
    if (__builtin_expect(!c.bf16 && !any_closed && values.blocks && !values.stored(), 0)) {
      paged_values(kt, values, rows, start, n, Ev, qt, st, first_block, alpha, o);
      first_block = false;
      continue;
    }
    const T* vb = values.rows(start, n, v_buf, ldv);
    if (pairs || round_blocks) vb = bf16_rounded_rows(c, vb, ldv, n, Ev, v_buf), ldv = Ev;
    const auto values_finite = [&](int64_t j0, int64_t count) {
      return finite_values.all(b, kv_head, j0, count, [&] {
        return rows_finite(kt, vb + (j0 - start) * ldv, ldv, count, Ev);
      });
    };
    if (!pairs && (!any_closed || t.masks.closed_values_finite(a, start, n, values_finite))) {
      const GemmInit init = first_block ? GemmInit::kZero : GemmInit::kScaleRows;
      if (ask_ahead && start + n < S) {
        LineRange key_lines =
            stored_row_lines(a.key, b, kv_head, start + n, std::min(key_block, S - start - n));
        const int64_t pieces = (Ev + kAheadColumnsPerPiece - 1) / kAheadColumnsPerPiece;
        for (int64_t col = 0; col < Ev; col += kAheadColumnsPerPiece) {
          request_lines_to_l2(key_lines, (key_lines.end + pieces - 1) / pieces);
          kt.gemm(rows, std::min(kAheadColumnsPerPiece, Ev - col), n, st, 1, qt, vb + col, ldv,
                  o + col, Ev, init, alpha);
        }
      } else {
        kt.gemm(rows, Ev, n, st, 1, qt, vb, ldv, o, Ev, init, alpha);
      }
    } else {
      if (first_block) std::fill(o, o + qt * Ev, T(0));
      for (int64_t r = 0; r < rows; ++r) {
        kt.scale(o + r * Ev, Ev, alpha[r], o + r * Ev);
        for (int64_t j = 0; j < n; ++j) p_row[j] = st[j * qt + r];
        round_operands(c, p_row, n);
        accumulate_values(a, kt, b, h, i0 + r, start, n, true, p_row, vb, ldv, Ev, o + r * Ev,
                          false);
      }
    }
    first_block = false;
  }
  if (first_block) return;  // no key of the chunk was in a band: nothing to merge
  // Merge the chunk: the total was accumulated against the max m_start, the
  // chunk against the max m, so the total is rescaled by e^(m_start - m).
  // The first chunk is the total (with an empty total, the merge would give
  // the same numbers), so its buffers are swapped in rather than copied.
  if (!t.have_total) {
    std::swap(t.o, t.o_total);
    std::swap(t.l, t.l_total);
    t.have_total = true;
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T rescale = std::exp(m_start[r] - exp_shift(m[r]));
    T* total = t.o_total + r * Ev;
    const T* part = o + r * Ev;
    for (int64_t d = 0; d < Ev; ++d) total[d] = total[d] * rescale + part[d];
    t.l_total[r] = t.l_total[r] * rescale + l[r];
  }
}

// (5) normalise. A query with open keys whose scores were all -inf (an Inf
// in the inputs) has l = 0 and gives 0/0 = NaN.
template <typename T>
void finish_flash_tile(const SdpaContext<T>& c, FlashTile<T>& t) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const int qt = kt.query_tile;
  const int64_t Ev = a.value.shape(3);
  if (!t.have_total) {
    std::fill(t.o_total, t.o_total + qt * Ev, T(0));
    std::fill(t.l_total, t.l_total + qt, T(0));
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    T* out = a.out.at(t.b, t.h, t.i0 + r);
    if (!t.masks.open[r]) {
      std::fill(out, out + Ev, T(0));
    } else {
      kt.scale(t.o_total + r * Ev, Ev, T(1) / t.l_total[r], out);
    }
  }
}

}  // namespace

template <typename T>
void flash_tiles(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, int64_t count,
                 T* scratch, AlignedValues<T>* aligned_values) {
  const SdpaArgs<T>& a = c.args;
  const int64_t key_block = c.plan.key_block;
  const int qt = c.kt.query_tile;
  const int64_t S = a.key.shape(2), E = a.query.shape[3], Ev = a.value.shape(3);
  // The head's values, on cache lines: copied once by this thread for all
  // the tiles it runs of the head (see AlignedValues).
  const AlignedValues<T>* values_copy = nullptr;
  if (aligned_values) {
    const int64_t kv_head = h / (a.query.shape[1] / a.key.shape(1));
    if (!value_rows_on_lines(a, b, kv_head)) {
      AlignedValues<T>& copy = *aligned_values;
      if (copy.b != b || copy.kv_head != kv_head) {
        const T* rows = a.value.native.at(b, kv_head);
        const int64_t ld = a.value.native.stride[2];
        if (ld == Ev && copy.ld == Ev)  // rows back to back in both: one block
          std::copy_n(rows, S * Ev, copy.data);
        else
          for (int64_t j = 0; j < S; ++j) std::copy_n(rows + j * ld, Ev, copy.data + j * copy.ld);
        copy.b = b, copy.kv_head = kv_head;
      }
      values_copy = &copy;
    }
  }
  const size_t buffers = flash_tile_buffers_size<T>(qt, E, Ev);
  T* visit_scratch = scratch + size_t(count) * buffers;
  // Only the tiles the task runs are constructed (a FlashTile takes about
  // 1.3 KiB, and most tasks run one).
  static_assert(std::is_trivially_destructible_v<FlashTile<T>>);
  alignas(FlashTile<T>) unsigned char storage[kMaxTileGroup * sizeof(FlashTile<T>)];
  FlashTile<T>* tiles = reinterpret_cast<FlashTile<T>*>(storage);
  int64_t begun = 0;
  for (int64_t i = 0; i < count; ++i) {
    new (&tiles[begun]) FlashTile<T>;
    if (begin_flash_tile(c, b, h, i0 + i * qt, scratch + size_t(begun) * buffers, tiles[begun]))
      ++begun;
  }
  const int64_t chunk = key_block * std::max<int64_t>(1, kTileChunk / key_block);
  for (int64_t c0 = 0; c0 < S; c0 += chunk)
    for (int64_t i = 0; i < begun; ++i)
      visit_flash_chunk(c, tiles[i], c0, std::min(S, c0 + chunk), visit_scratch,
                        c.plan.ask_ahead && i == 0, values_copy);
  for (int64_t i = 0; i < begun; ++i) finish_flash_tile(c, tiles[i]);
}

template void flash_tiles<float>(const SdpaContext<float>&, int64_t, int64_t, int64_t, int64_t,
                                 float*, AlignedValues<float>*);
template void flash_tiles<double>(const SdpaContext<double>&, int64_t, int64_t, int64_t, int64_t,
                                  double*, AlignedValues<double>*);

}  // namespace attnx::sdpa
