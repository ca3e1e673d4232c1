// Scaled dot-product attention, forward.
//
// Tile path (flash attention; no L x S matrix is stored), per task = one
// (b, h, tile of QT queries), with QT the kernel's lane count:
//   Qt = scale * Q_tile^T                                   (E x QT, packed once)
//   m = -inf, l = 0, O = 0                                  per query lane
//   for each key block Kb, Vb the tile may attend:
//     St = Kb . Qt              (keys x queries: lanes are queries)      (1)
//     close masked / out-of-band entries: St = -inf by selection         (2)
//     online softmax down each column: m, l, alpha; St = exp(St - m)     (3)
//     O = diag(alpha) O + St^T . Vb                                      (4)
//   out = O / l, or 0 for a query with no open key                       (5)
// Computing St rather than S keeps the softmax vertical (no horizontal
// reductions), and both products read K and V rows in place, unpacked.
//
// Row path, for few queries per head and for the weights: each query row
// against key blocks with the row kernels (dot, axpy); with weights, each
// row's probabilities are written to the weights, then out = p.V. Without
// weights, the rows of the query heads that share a key head are taken
// together (each block of keys and values is read once per group), and long
// key sequences are split into chunks of kKeyChunk keys, one task each,
// whose softmax states (m, l, acc) are merged in chunk order: decoding (one
// query, many keys) then uses every core.
//
// Key range: each row may attend a band of keys (causal, sliding window,
// per-batch key lengths; see KeyRange). Blocks outside every band of a task
// are skipped and never read; only blocks a band end crosses are masked.
// Keys and values stored as 16-bit floats are widened block by block.
//
// Each output row is computed by one thread in a fixed order, so results do
// not depend on the thread count.
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention/mask_blocks.h"
#include "attention/softmax_rules.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

constexpr int kMaxTile = 64;  // the widest query tile of any kernel

constexpr int64_t kQueryBlock = 32;   // rows per task on the row path
constexpr int64_t kKeyBlock = 128;    // keys per block on the row path
constexpr int64_t kKeyChunk = 512;    // keys per task on the row path (a multiple of kKeyBlock)

// Rows of one (b, head) of the keys or the values, as T: read in place, or
// widened from 16-bit storage into a buffer one block at a time.
template <typename T>
struct RowReader {
  const T* native = nullptr;
  const uint16_t* bits = nullptr;
  int bits_kind = 0;  // 0 float16, 1 bfloat16: the index of the 16-bit row kernels
  int64_t ld = 0, dim = 0;
  void (*widen)(const uint16_t*, int64_t, float*) = nullptr;

  // Rows [j0, j0 + n); sets row_stride. buf holds n * dim values.
  const T* rows(int64_t j0, int64_t n, T* buf, int64_t& row_stride) const {
    if (!bits) {
      row_stride = ld;
      return native + j0 * ld;
    }
    if constexpr (std::is_same_v<T, float>) {
      const uint16_t* src = bits + j0 * ld;
      if (ld == dim) {
        widen(src, n * dim, buf);
      } else {
        for (int64_t j = 0; j < n; ++j) widen(src + j * ld, dim, buf + j * dim);
      }
    }
    row_stride = dim;
    return buf;
  }
};

template <typename T>
RowReader<T> row_reader(const StoredView<T>& v, const KernelTable<T>& kt, int64_t b, int64_t h) {
  RowReader<T> r;
  r.ld = v.stride(2);
  r.dim = v.shape(3);
  if (v.storage == Storage::kNative) {
    r.native = v.native.at(b, h);
  } else if constexpr (std::is_same_v<T, float>) {
    r.bits = v.bits.at(b, h);
    r.bits_kind = v.storage == Storage::kFloat16 ? 0 : 1;
    r.widen = v.storage == Storage::kFloat16 ? kt.widen_float16 : kt.widen_bfloat16;
  }
  return r;
}

template <typename T>
int64_t key_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.key_lengths ? a.range.key_lengths[b] : a.mask_cols;
}

template <typename T>
int64_t query_length(const SdpaArgs<T>& a, int64_t b) {
  return a.range.query_lengths ? a.range.query_lengths[b] : a.query.shape[2];
}

// The source keys [lo, hi) a row may attend, masks aside (see KeyRange).
// hi <= the key length always; an empty band has lo == hi. Over the rows of
// one batch both ends only move right, padding rows aside.
struct Band {
  int64_t lo = 0, hi = 0;
  bool empty() const { return hi <= lo; }
};

// The band of row i of a batch whose query and key lengths are qlen and klen.
inline Band band_of(const KeyRange& r, int64_t qlen, int64_t klen, int64_t i) {
  if (i >= qlen) return {0, 0};
  Band band{0, klen};
  if (r.banded()) {
    const int64_t diagonal = i + (r.bottom_right ? klen - qlen : 0);
    if (r.causal) band.hi = std::min(band.hi, diagonal + 1);
    if (r.window_right >= 0) band.hi = std::min(band.hi, diagonal + r.window_right + 1);
    if (r.window_left >= 0) band.lo = std::min(klen, std::max(band.lo, diagonal - r.window_left));
  }
  band.hi = std::max(band.hi, band.lo);
  return band;
}

template <typename T>
Band row_band(const SdpaArgs<T>& a, int64_t b, int64_t i) {
  return band_of(a.range, query_length(a, b), key_length(a, b), i);
}

// What masking found in a range of keys.
struct KeyStates {
  bool any_open = false;
  bool any_closed = false;
};

// The masks' values for key j, summed as torch merges them. The key is closed
// where the sum is -inf; a +inf or NaN of one mask where another is -inf sums
// to NaN, so the key stays open and the NaN reaches the row, as in torch.
template <typename T>
T merged_masks(const T* const* rows, const int64_t* steps, int count, int64_t j) {
  T sum = 0;
  for (int m = 0; m < count; ++m) sum += rows[m][j * steps[m]];
  return sum;
}

// Applies the key range and the masks to the scores of query row i against
// keys [j0, j0 + n). A closed key (outside the row's band, or masks summing
// to -inf) gets the score -inf by selection, not addition, so that a NaN in
// its key cannot reach this row. `masks_zero`: the caller knows the masks
// add exactly 0 to these keys (s + 0 is s), and they are not read.
template <typename T>
KeyStates apply_masks(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j0,
                      int64_t n, T* s, bool masks_zero = false) {
  const int64_t end = j0 + n;
  const int64_t masked_end = std::clamp(a.mask_cols, j0, end);  // keys past it are always open
  const Band band = row_band(a, b, i);
  int64_t open_begin = std::max(j0, band.lo), open_end = std::min(masked_end, band.hi);
  if (open_end < open_begin) open_begin = open_end = j0;
  for (int64_t j = j0; j < open_begin; ++j) s[j - j0] = kNegInf<T>;
  for (int64_t j = open_end; j < masked_end; ++j) s[j - j0] = kNegInf<T>;
  KeyStates states;
  states.any_open = masked_end < end;
  states.any_closed = open_begin > j0 || open_end < masked_end;
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks)
    if (mask.present()) rows[count] = mask.at(b, h, i), steps[count++] = mask.stride[3];
  if (count == 0 || masks_zero) {
    states.any_open = states.any_open || open_end > open_begin;
    return states;
  }
  for (int64_t j = open_begin; j < open_end; ++j) {
    const T added = merged_masks(rows, steps, count, j);
    const bool open = added != kNegInf<T>;
    s[j - j0] = open ? s[j - j0] + added : kNegInf<T>;
    states.any_open = states.any_open || open;
    states.any_closed = states.any_closed || !open;
  }
  return states;
}

// Whether query i may not attend key j (outside its band, or masked).
template <typename T>
bool key_closed(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (j >= a.mask_cols) return false;
  const Band band = row_band(a, b, i);
  if (j < band.lo || j >= band.hi) return true;
  T added = 0;  // as merged_masks
  for (const auto& mask : a.masks)
    if (mask.present()) added += mask.at(b, h, i)[j * mask.stride[3]];
  return added == kNegInf<T>;
}

template <typename T>
bool rows_finite(const KernelTable<T>& kt, const T* v, int64_t ldv, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j)
    if (!kt.all_finite(v + j * ldv, dim)) return false;
  return true;
}

// acc += p . V over keys [j0, j0 + n) for query i, with each key's value
// either reaching the row or not exactly as the reference has it: a closed
// key's value never does, an open key's always does, even when its
// probability underflowed to 0 (so that 0 * NaN is NaN there). Plain
// accumulation differs only where a closed key's value is not finite, so
// only then is the slower, key-by-key form used.
template <typename T>
void accumulate_values(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                       int64_t i, int64_t j0, int64_t n, bool any_closed, const T* p,
                       const T* v, int64_t ldv, int64_t Ev, T* acc, bool stream) {
  if (!any_closed || rows_finite(kt, v, ldv, n, Ev)) {
    kt.accumulate_pv(&p, 1, v, ldv, n, Ev, &acc, stream);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* p_j = p + j;
    if (!key_closed(a, b, h, i, j0 + j))
      kt.accumulate_pv(&p_j, 1, v + j * ldv, ldv, 1, Ev, &acc, false);
  }
}

// Whether each value row of each (b, key head) is all finite, for keys
// [0, S_read): taken once a call where query tiles would check the same
// blocks of values again and again (a masked call: B2 H12 L512, 6.6% of
// its time went to those checks).
struct FiniteRows {
  std::vector<uint8_t> flags;  // empty: not taken
  int64_t heads = 0, keys = 0;

  template <typename T>
  void take(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t B, int64_t Hk,
            int64_t S_read, int nthreads) {
    heads = Hk, keys = S_read;
    flags.resize(size_t(B * Hk * S_read));
    const int64_t ld = a.value.stride(2), Ev = a.value.shape(3);
    parallel_for(B * Hk, nthreads, Schedule::kStatic, [&](int64_t bh) {
      const T* rows = a.value.native.at(bh / Hk, bh % Hk);
      uint8_t* f = flags.data() + bh * S_read;
      for (int64_t j = 0; j < S_read; ++j) f[j] = kt.all_finite(rows + j * ld, Ev) ? 1 : 0;
    });
  }
  // Whether rows [start, start + n) of (b, h) are all finite: from the
  // flags where taken, else check().
  template <typename Check>
  bool all(int64_t b, int64_t h, int64_t start, int64_t n, const Check& check) const {
    if (flags.empty() || start + n > keys) return check();
    const uint8_t* f = flags.data() + (b * heads + h) * keys + start;
    return std::find(f, f + n, uint8_t(0)) == f + n;
  }
};

// Scratch of one row-path task.
template <typename T>
size_t rows_scratch_size(int64_t E, int64_t Ev) {
  return size_t(kQueryBlock * (kKeyBlock + Ev + 2) + kKeyBlock * (E + Ev));
}

// The masks of rows [i0, i0 + rows) of (b, h) as one row of keys, where
// they are the same for each of those rows: broadcast over queries (as a
// key padding mask is), or a single row. `shared` is false otherwise.
template <typename T>
struct SharedMaskRow {
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  bool shared = true;
  T at(int64_t j) const { return merged_masks(rows, steps, count, j); }
};

template <typename T>
SharedMaskRow<T> shared_mask_row(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i0,
                                 int64_t rows) {
  SharedMaskRow<T> row;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    if (rows > 1 && mask.stride[2] != 0) row.shared = false;
    row.rows[row.count] = mask.at(b, h, i0);
    row.steps[row.count++] = mask.stride[3];
  }
  return row;
}

// The source keys [lo, hi) outside of which the shared masks close every
// key (a batch's padding), so that those keys need not be computed; all of
// [0, mask_cols) where the masks are not shared. A closed key adds nothing
// to a row (probability 0, its value never read).
template <typename T>
Band keys_open_in_masks(const SdpaArgs<T>& a, const SharedMaskRow<T>& masks) {
  Band open{0, a.mask_cols};
  if (!masks.shared || masks.count == 0) return open;
  while (open.lo < open.hi && masks.at(open.lo) == kNegInf<T>) ++open.lo;
  while (open.hi > open.lo && masks.at(open.hi - 1) == kNegInf<T>) --open.hi;
  return open;
}

// Whether the shared masks add exactly 0 to keys [j0, j0 + n): the open
// keys of a padding mask, which then need no masking (s + 0 is s).
template <typename T>
bool shared_masks_zero(const SharedMaskRow<T>& masks, int64_t j0, int64_t n) {
  if (!masks.shared) return false;
  for (int64_t j = j0; j < j0 + n; ++j)
    if (masks.at(j) != T(0)) return false;
  return true;
}

// Row path over keys [j_begin, j_end) for rows [r0, r1) of one (b, key
// head): row r is query row r % L of query head kv_head * group + r / L, so
// the query heads that share a key head (grouped-query attention) read each
// block of keys and values once. With `states` null it writes the output
// rows; otherwise each row's softmax state (m, l, open, acc[Ev]) goes to its
// slot for key chunk `chunk` of `chunks`, to be merged afterwards.
template <typename T>
void flash_rows(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t kv_head,
                int64_t r0, int64_t r1, int64_t j_begin, int64_t j_end, T* scratch, T* states,
                int64_t chunks, int64_t chunk) {
  const int64_t Hq = a.query.shape[1], L = a.query.shape[2], E = a.query.shape[3];
  const int64_t Ev = a.value.shape(3), group = Hq / a.key.shape(1);
  const int64_t rows = r1 - r0;
  T* tile = scratch;                      // rows x kKeyBlock scores
  T* acc = tile + rows * kKeyBlock;       // rows x Ev
  T* m = acc + rows * Ev;                 // rows
  T* l = m + rows;                        // rows
  T* k_buf = l + rows;                    // kKeyBlock x E: widened keys
  T* v_buf = k_buf + kKeyBlock * E;       // kKeyBlock x Ev: widened values
  int64_t head[kQueryBlock], row[kQueryBlock];
  bool open[kQueryBlock] = {};            // whether the row has any open key
  const T* q_rows[kQueryBlock];
  T* s_rows[kQueryBlock];
  T* acc_rows[kQueryBlock];
  std::fill(acc, acc + rows * Ev, T(0));
  std::fill(m, m + rows, kNegInf<T>);
  std::fill(l, l + rows, T(0));
  // The keys any of the rows may attend: blocks outside are skipped.
  int64_t lo = a.mask_cols, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    head[r] = kv_head * group + (r0 + r) / L;
    row[r] = (r0 + r) % L;
    q_rows[r] = a.query.at(b, head[r], row[r]);
    s_rows[r] = tile + r * kKeyBlock;
    acc_rows[r] = acc + r * Ev;
    const Band band = row_band(a, b, row[r]);
    if (!band.empty()) lo = std::min(lo, band.lo), hi = std::max(hi, band.hi);
  }
  // And that the masks leave open to any of them, in whole blocks: the
  // kernels' sums over a block's keys (exp_shift_sum, the P.V) group them by
  // their place in the block, and a block cut at either end would round
  // differently.
  Band mask_open{a.mask_cols, 0};
  for (int64_t r = 0; r < rows; ++r) {
    const Band open_keys = keys_open_in_masks(a, shared_mask_row(a, b, head[r], row[r], 1));
    if (!open_keys.empty())
      mask_open.lo = std::min(mask_open.lo, open_keys.lo),
      mask_open.hi = std::max(mask_open.hi, open_keys.hi);
  }
  // Where every row reads the same row of the masks (a padding mask,
  // broadcast over heads and queries), a block where it adds 0 is not
  // masked (the flash tile does the same).
  const SharedMaskRow<T> first_masks = shared_mask_row(a, b, head[0], row[0], 1);
  bool one_mask_row = first_masks.count > 0;
  for (int64_t r = 1; r < rows && one_mask_row; ++r) {
    const SharedMaskRow<T> masks = shared_mask_row(a, b, head[r], row[r], 1);
    for (int m = 0; m < masks.count; ++m)
      one_mask_row = one_mask_row && masks.rows[m] == first_masks.rows[m];
  }
  if (mask_open.lo > j_begin)
    lo = std::max(lo, j_begin + (mask_open.lo - j_begin) / kKeyBlock * kKeyBlock);
  if (mask_open.hi <= mask_open.lo)
    hi = 0;  // every source key closed
  else if (mask_open.hi > j_begin)
    hi = std::min(hi, j_begin + (mask_open.hi - j_begin + kKeyBlock - 1) / kKeyBlock * kKeyBlock);
  else
    hi = std::min(hi, j_begin);

  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);
  // 16-bit keys and values are read straight from storage by the 16-bit row
  // kernels, widened in registers, for up to 4 rows (decoding, grouped heads
  // included); for more rows a block is widened once into a buffer and read
  // from there by every row. (Decoding at H32 D128, 2k-8k keys: direct reads
  // took 25-30% less time than widening into a buffer.)
  const bool direct_keys = rows <= 4 && keys.bits, direct_values = rows <= 4 && values.bits;
  const int n_rows = static_cast<int>(rows);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyBlock) {
    int64_t start = j0, n = std::min(kKeyBlock, j_end - j0);
    if (j0 + n <= a.mask_cols) {  // source keys only: cut to the rows' band
      start = std::max(j0, lo);
      const int64_t stop = std::min(j0 + n, hi);
      if (stop <= start) continue;
      n = stop - start;
    }
    int64_t ldk = 0, ldv = 0;
    const T* kb = direct_keys ? nullptr : keys.rows(start, n, k_buf, ldk);
    const T* vb = direct_values ? nullptr : values.rows(start, n, v_buf, ldv);
    // (1) the scores of every row: the kernel takes a few rows through each
    // key at once; the first of them read the block from memory, the others
    // from cache.
    if constexpr (std::is_same_v<T, float>) {
      if (direct_keys)
        kt.scores_16bit[keys.bits_kind](q_rows, n_rows, keys.bits + start * keys.ld, keys.ld, n,
                                        E, a.scale, s_rows, true);
    }
    if (!direct_keys) kt.scores(q_rows, n_rows, kb, ldk, n, E, a.scale, s_rows, keys.native);
    // The rows whose values go through the block in one pass, together.
    const T* p_plain[kQueryBlock];
    T* acc_plain[kQueryBlock];
    int plain = 0;
    const bool masks_zero =
        one_mask_row && start < a.mask_cols &&
        shared_masks_zero(first_masks, start, std::min(n, a.mask_cols - start));
    for (int64_t r = 0; r < rows; ++r) {
      T* s = s_rows[r];
      const KeyStates states = apply_masks(a, b, head[r], row[r], start, n, s, masks_zero);
      open[r] = open[r] || states.any_open;
      // (2) new running max and the rescale of what was accumulated
      const T m_new = max_ignoring_nan(m[r], kt.row_max(s, n));
      const T shift = exp_shift(m_new);
      const T alpha = std::exp(m[r] - shift);
      const T block_sum = kt.exp_shift_sum(s, n, shift);
      // (3) update
      T* acc_r = acc_rows[r];
      if (alpha != T(1)) kt.scale(acc_r, Ev, alpha, acc_r);
      l[r] = alpha * l[r] + block_sum;
      m[r] = m_new;
      if (states.any_closed) {
        // A closed key's value must not reach the row (0 * NaN): where the
        // block holds a value that is not finite, the row goes key by key
        // (see accumulate_values).
        if (direct_values && vb == nullptr) vb = values.rows(start, n, v_buf, ldv);
        if (!rows_finite(kt, vb, ldv, n, Ev)) {
          accumulate_values(a, kt, b, head[r], row[r], start, n, true, s, vb, ldv, Ev, acc_r,
                            false);
          continue;
        }
      }
      p_plain[plain] = s;
      acc_plain[plain++] = acc_r;
    }
    if (plain == 0) continue;
    if (direct_values) {
      if constexpr (std::is_same_v<T, float>)
        kt.accumulate_pv_16bit[values.bits_kind](p_plain, plain, values.bits + start * values.ld,
                                                 values.ld, n, Ev, acc_plain, true);
    } else {
      kt.accumulate_pv(p_plain, plain, vb, ldv, n, Ev, acc_plain, values.native);
    }
  }
  if (states) {
    const int64_t state_size = Ev + 3;
    for (int64_t r = 0; r < rows; ++r) {
      T* state = states + (((b * Hq + head[r]) * L + row[r]) * chunks + chunk) * state_size;
      state[0] = m[r], state[1] = l[r], state[2] = open[r] ? T(1) : T(0);
      std::copy_n(acc + r * Ev, Ev, state + 3);
    }
    return;
  }
  // (4) normalise. A row with no open key is zero; a row with open keys
  // whose scores were all -inf (an Inf in the inputs) is 0/0 = NaN.
  for (int64_t r = 0; r < rows; ++r) {
    T* o = a.out.at(b, head[r], row[r]);
    const T* acc_r = acc + r * Ev;
    if (!open[r]) {
      std::fill(o, o + Ev, T(0));
    } else {
      kt.scale(acc_r, Ev, T(1) / l[r], o);
    }
  }
}

// Merges the per-chunk states of one query row, in chunk order:
// M = max_c m_c; l = sum_c l_c e^(m_c - M); acc = sum_c acc_c e^(m_c - M).
template <typename T>
void merge_chunks(const T* states, int64_t chunks, int64_t stride, int64_t Ev, T* out) {
  T row_max = kNegInf<T>;
  bool open = false;
  for (int64_t c = 0; c < chunks; ++c) {
    row_max = max_ignoring_nan(row_max, states[c * stride]);
    open = open || states[c * stride + 2] != T(0);
  }
  std::fill(out, out + Ev, T(0));
  if (!open) return;
  const T shift = exp_shift(row_max);
  T l = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const T* state = states + c * stride;
    const T weight = std::exp(state[0] - shift);
    l += state[1] * weight;
    for (int64_t d = 0; d < Ev; ++d) out[d] += state[3 + d] * weight;
  }
  const T inv = T(1) / l;
  for (int64_t d = 0; d < Ev; ++d) out[d] *= inv;
}

// Rows [i0, i1) of one (b, h) with their probabilities written to the
// weights. Keys past the batch's key length are not read; their weights are 0.
template <typename T>
void rows_with_weights(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                       int64_t i0, int64_t i1, T* scratch) {
  const int64_t Hq = a.query.shape[1], L = a.query.shape[2], S = a.key.shape(2);
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  const int64_t kv_head = h / (Hq / a.key.shape(1));
  const int64_t S_read = a.range.key_lengths ? a.range.key_lengths[b] : S;
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);
  T* k_buf = scratch;                   // kKeyBlock x E
  T* v_buf = k_buf + kKeyBlock * E;     // kKeyBlock x Ev
  for (int64_t i = i0; i < i1; ++i) {
    T* p = a.weights + ((b * Hq + h) * L + i) * S;
    T* o = a.out.at(b, h, i);
    const T* q = a.query.at(b, h, i);
    for (int64_t j0 = 0; j0 < S_read; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, S_read - j0);
      int64_t ldk;
      const T* kb = keys.rows(j0, n, k_buf, ldk);
      T* scores = p + j0;
      kt.scores(&q, 1, kb, ldk, n, E, a.scale, &scores, i == i0 && keys.native);
    }
    std::fill(p + S_read, p + S, T(0));
    const KeyStates states = apply_masks(a, b, h, i, 0, S_read, p);
    const T sum = kt.exp_shift_sum(p, S_read, exp_shift(kt.row_max(p, S_read)));
    std::fill(o, o + Ev, T(0));
    if (!states.any_open) {  // fully masked row
      std::fill(p, p + S_read, T(0));
      continue;
    }
    kt.scale(p, S_read, T(1) / sum, p);
    for (int64_t j0 = 0; j0 < S_read; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, S_read - j0);
      int64_t ldv;
      const T* vb = values.rows(j0, n, v_buf, ldv);
      accumulate_values(a, kt, b, h, i, j0, n, states.any_closed, p + j0, vb, ldv, Ev, o,
                        i == i0 && values.native);
    }
  }
}

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
// same bits. (A key padding mask and an attn_mask on MHA B4 L128 E256 H4,
// one thread: the masking took 13% of the call's time a lane and a key at a
// time, about 3.5% so.)
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

// Keys per block of the tile path: at least 128, more for small head dims
// (keys = 48 KiB / ((E + Ev + qt) * sizeof(T)), a multiple of 16, at most
// 256: E = Ev = 16, float32: 192). A block's keys, values and score tile
// come from L2 once per query tile whatever its length, and longer blocks
// amortise the per-block work (the online softmax's rescaling, the P.V
// tile's loads and stores of the accumulator). Sized to fit a 48 KiB L1
// instead, large heads got short blocks and lost to that work: 128 keys
// against 32 (AVX-512, one core, in-process interleaved runs): D128 L1024
// -6.5%, D256 -7%, float64 D64 -6%, float64 D128 -10%; D80 against 48 keys
// -3%; AVX2 D128 -4%. With D64 (64 keys before) it was level within 1%.
// Calls that may skip blocks (`skips_blocks`: a causal band or window, key
// or query lengths, or masks, whose closed blocks are skipped) take at least
// 64 keys instead: blocks of 128 skip too coarsely (block-sparse masks in
// 64 x 64 blocks took 1.9x the time, documents of 64 tokens 1.16x), and
// for D64 64 keys were as fast. One rule for all of them keeps the bits the
// same whichever way a mask is given: written out or broadcast, or as
// is_causal.
template <typename T>
int64_t tile_key_block(int qt, int64_t E, int64_t Ev, bool skips_blocks) {
  const int64_t keys = (48 * 1024) / ((E + Ev + qt) * int64_t(sizeof(T)));
  return std::clamp<int64_t>(keys / 16 * 16, skips_blocks ? 64 : 128, 256);
}

// Keys per accumulation chunk of the tile path. Blocks add into a chunk's
// accumulator, and chunks into the total: float32 sums then take
// S / kTileChunk + kTileChunk / key_block steps rather than S / key_block,
// which kept the error at a few 1e-6 over a million keys (one running sum
// reached 2e-4 there).
constexpr int64_t kTileChunk = 1024;

// Query tiles per task of the flash path where a tile's keys span several
// chunks (see flash_tiles): as many as keep their buffers (queries and
// accumulators) within kTileGroupBytes, next to a chunk's keys and values
// in L2, and at most kMaxTileGroup.
constexpr int64_t kMaxTileGroup = 16;
constexpr int64_t kTileGroupBytes = 512 * 1024;
// Tiles are grouped only where a head's keys and values outgrow this:
// those of 2048 keys of D64 (1 MiB) stay in L2 from one tile to the next,
// and grouped, the causal B1 H12 L2048 D64 took 1.4% longer.
constexpr double kTileGroupMinKeyBytes = 1 << 20;

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

// The cache lines of `rows` rows of `cols` elements of T, `ld` apart.
template <typename T>
LineRange row_lines(const T* first_row, int64_t ld, int64_t rows, int64_t cols) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(first_row);
  const int64_t offset = int64_t(start % 64);
  LineRange lines;
  lines.first = start - uintptr_t(offset);
  lines.ld_bytes = ld * int64_t(sizeof(T));
  lines.row_lines = (offset + cols * int64_t(sizeof(T)) + 63) / 64;
  lines.end = rows * lines.row_lines;
  return lines;
}

// The cache lines of rows j0 .. j0 + rows - 1 of (b, h) of a key or value
// array, as it is stored.
template <typename T>
LineRange stored_row_lines(const StoredView<T>& v, int64_t b, int64_t h, int64_t j0,
                           int64_t rows) {
  if (v.storage == Storage::kNative)
    return row_lines(v.native.at(b, h, j0), v.native.stride[2], rows, v.native.shape[3]);
  return row_lines(v.bits.at(b, h, j0), v.bits.stride[2], rows, v.bits.shape[3]);
}

// Asks for the next `count` lines of `lines` (from lines.begin) to be
// brought into L2 (not L1, where the block being computed is).
inline void request_lines_to_l2(LineRange& lines, int64_t count) {
  count = std::min(count, lines.size());
  if (count <= 0) return;
  int64_t row = lines.begin / lines.row_lines, line = lines.begin - row * lines.row_lines;
  uintptr_t row_start = lines.first + uintptr_t(row * lines.ld_bytes);
  for (int64_t k = 0; k < count; ++k) {
#if defined(__GNUC__)
    __builtin_prefetch(reinterpret_cast<const void*>(row_start + uintptr_t(line * 64)), 0, 2);
#endif
    if (++line == lines.row_lines) line = 0, row_start += uintptr_t(lines.ld_bytes);
  }
  lines.begin += count;
}

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
// cost more than they saved. Two threads, L16 against S4096 D128, in-process
// interleaved runs on a Xeon with a large shared L3: H8 and H16 (32 and 64
// MiB) +14% and -2%, H24 -21%, H32 -20% (L32 -16%, L64 -11%, L128 -6%);
// D64, H64: L16 -17%, L128 -3%.
constexpr double kAheadMinCallBytes = 64 << 20;
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

// One query tile of the flash path, whose keys may be visited a chunk at a
// time with other tiles' visits between (see flash_tiles): what a tile
// keeps from one chunk to the next. Its buffers are in the scratch of the
// thread that runs it.
template <typename T>
struct FlashTile {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
  int lanes = 0;  // the tile's queries rounded up to whole vectors
  // Each lane's band; the tile's keys are [keys_lo, keys_hi) of the union.
  int64_t lo[kMaxTile], hi[kMaxTile];
  bool open[kMaxTile];
  bool has_masks = false;
  SharedMaskRow<T> shared_masks;
  const MaskBlock* blocks = nullptr;
  int64_t keys_lo = 0, keys_hi = 0;
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

// Elements of a FlashTile's buffers, and of the scratch its visits share.
template <typename T>
size_t flash_tile_buffers_size(int qt, int64_t E, int64_t Ev) {
  return size_t(E * qt + 2 * qt * Ev + 3 * qt);
}

template <typename T>
size_t flash_visit_scratch_size(int qt, int64_t E, int64_t Ev, int64_t key_block) {
  return size_t(key_block * qt + 2 * qt + key_block + key_block * (E + Ev) + 2 * key_block * qt);
}

// Sets up the tile starting at query i0 of (b, h): zeroes its padding rows,
// finds its bands and keys, packs its queries. False when no row is left.
template <typename T>
bool begin_flash_tile(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                      int64_t i0, int64_t key_block, T* buffers,
                      const MaskBlockMap<T>& mask_blocks, FlashTile<T>& t) {
  const int qt = kt.query_tile;
  const int64_t L = a.query.shape[2], S = a.key.shape(2);
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  // Padding rows (past the batch's query length) are zero.
  const int64_t tile_rows = std::min<int64_t>(qt, L - i0);
  const int64_t qlen = query_length(a, b);
  const int64_t rows = std::clamp<int64_t>(qlen - i0, 0, tile_rows);
  for (int64_t r = rows; r < tile_rows; ++r) {
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

  t.has_masks = tile_bands(a, b, qlen, i0, rows, t.lo, t.hi, t.open);
  // Keys that the masks close for every row are skipped as those outside
  // the band: blocks past the last open key are skipped and the block
  // holding it cut, which keeps the bits (only terms of 0 go). Before the
  // first, only whole blocks: the P.V of a block cut at its start would sum
  // its values in other runs (kSumRun) and round differently.
  // So are the blocks that the map of mask blocks finds closed to every row
  // of the tile (a causal or block mask): those at either end here, those
  // between as the visits meet them.
  t.shared_masks = shared_mask_row(a, b, h, i0, rows);
  const Band mask_open = keys_open_in_masks(a, t.shared_masks);
  t.blocks = mask_blocks.tile(b, h, i0);
  const auto map_open = t.blocks ? mask_blocks.open_keys(t.blocks)
                                 : typename MaskBlockMap<T>::Open{0, a.mask_cols};
  t.keys_lo = std::max(
      {t.lo[0], mask_open.lo / key_block * key_block, map_open.lo / key_block * key_block});
  t.keys_hi = std::min({t.hi[rows - 1], mask_open.hi, map_open.hi});

  // The query lanes computed: the tile's queries rounded up to whole vectors
  // (the tile of a short sequence, or the last of a longer one, leaves the
  // rest of the query_tile lanes idle).
  t.lanes = static_cast<int>((rows + kt.vector_width - 1) / kt.vector_width) * kt.vector_width;
  // Pack the scaled query tile, transposed; lanes past the last query are 0.
  prefetch_rows(a.query.at(b, h, i0), a.query.stride[2], rows, E * int64_t(sizeof(T)));
  kt.pack_transposed(a.query.at(b, h, i0), a.query.stride[2], rows, E, a.scale, t.q_t, qt);
  std::fill(t.m, t.m + qt, kNegInf<T>);
  t.have_total = false;

  // The lines of this tile's output rows and of the next tile's query rows
  // are requested during the softmax of the last blocks, a line of each per
  // key, so that the stores of finish_flash_tile and the next tile's pack
  // find them in cache. (B8 H12 L128 D64: each would otherwise cost a burst
  // of 128 misses per tile that stalls the core; requested, the call took 8%
  // less time on one Zen 3 core and 11% less on two, median of 10
  // interleaved runs.)
  t.pending = LineRequests{};
  t.pending.ranges[0] = row_lines(a.out.at(b, h, i0), a.out.stride[2], rows, Ev);
  t.pending.ranges[1] = next_tile_queries(a, qt, b, h, i0);
  const int64_t most_lines = std::max(t.pending.ranges[0].size(), t.pending.ranges[1].size());
  const int64_t last_key = S > a.mask_cols ? S : std::min(S, t.keys_hi);
  t.request_from = last_key - (most_lines + key_block - 1) / key_block * key_block;
  return true;
}

// The tile's keys in the chunk [c0, c1): its blocks added into the chunk's
// accumulator, which is then merged into the total.
template <typename T>
void visit_flash_chunk(const SdpaArgs<T>& a, const KernelTable<T>& kt, FlashTile<T>& t,
                       int64_t c0, int64_t c1, int64_t key_block, T* scratch,
                       const FiniteRows& finite_values, const MaskBlockMap<T>& mask_blocks,
                       bool ask_ahead) {
  if (c1 <= a.mask_cols && (c1 <= t.keys_lo || c0 >= t.keys_hi)) return;  // outside every band
  const int qt = kt.query_tile;
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  const int64_t b = t.b, h = t.h, i0 = t.i0, rows = t.rows;
  const int64_t S = a.key.shape(2);
  const int64_t kv_head = h / (a.query.shape[1] / a.key.shape(1));
  T* st = scratch;                  // key_block x qt
  T* alpha = st + key_block * qt;   // qt
  T* m_start = alpha + qt;          // qt: the running max when the chunk began
  T* p_row = m_start + qt;          // key_block
  T* k_buf = p_row + key_block;     // key_block x E: widened keys
  T* v_buf = k_buf + key_block * E; // key_block x Ev: widened values
  T* mask_scratch = v_buf + key_block * Ev;  // 2 x key_block x qt: masks in the tile's layout
  T* o = t.o;
  T* l = t.l;
  T* m = t.m;
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);

  std::fill(l, l + qt, T(0));
  std::copy_n(m, qt, m_start);
  // The chunk's first computed block writes o rather than rescaling it
  // (o is not cleared beforehand).
  bool first_block = true;
  for (int64_t j0 = c0; j0 < c1; j0 += key_block) {
    int64_t start = j0, n = std::min(key_block, c1 - j0);
    MaskBlock mask_block = MaskBlock::kMixed;
    if (j0 + n <= a.mask_cols) {
      // Source keys only: a block outside the tile's keys is skipped, one
      // across their ends is cut (causal: the diagonal block).
      start = std::max(j0, t.keys_lo);
      const int64_t stop = std::min(j0 + n, t.keys_hi);
      if (stop <= start) continue;
      n = stop - start;
      if (t.blocks) mask_block = mask_blocks.state(t.blocks, start, stop);
      if (mask_block == MaskBlock::kClosed) continue;
    }
    // (1) scores
    int64_t ldk, ldv;
    const T* kb = keys.rows(start, n, k_buf, ldk);
    if (ask_ahead) {
      LineRange value_lines = stored_row_lines(a.value, b, kv_head, start, n);
      const int64_t pieces = (n + kAheadKeysPerPiece - 1) / kAheadKeysPerPiece;
      for (int64_t j = 0; j < n; j += kAheadKeysPerPiece) {
        request_lines_to_l2(value_lines, (value_lines.end + pieces - 1) / pieces);
        kt.gemm(std::min(kAheadKeysPerPiece, n - j), t.lanes, E, kb + j * ldk, ldk, 1, t.q_t, qt,
                st + j * qt, qt, GemmInit::kZero, nullptr);
      }
    } else {
      kt.gemm(n, t.lanes, E, kb, ldk, 1, t.q_t, qt, st, qt, GemmInit::kZero, nullptr);
    }
    // (2) masks; the band rules only where a band end crosses the block
    const int64_t source_end = std::min(start + n, a.mask_cols);
    const bool crosses_band =
        start < source_end && (start < t.lo[rows - 1] || source_end > t.hi[0]);
    bool any_closed = false;
    if (t.has_masks && !crosses_band && start + n <= a.mask_cols &&
        (mask_block == MaskBlock::kZero || shared_masks_zero(t.shared_masks, start, n))) {
      // The masks add 0 (a padding mask's open keys, a causal mask's
      // blocks below the diagonal): every row of the tile is open.
      std::fill(t.open, t.open + rows, true);
    } else if (t.has_masks || crosses_band) {
      any_closed =
          close_tile(a, kt, b, h, i0, rows, start, n, qt, t.lo, t.hi, st, t.open, mask_scratch);
    }
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
    const T* vb = values.rows(start, n, v_buf, ldv);
    if (!any_closed || finite_values.all(b, kv_head, start, n, [&] {
          return rows_finite(kt, vb, ldv, n, Ev);
        })) {
      const GemmInit init = first_block ? GemmInit::kZero : GemmInit::kScaleRows;
      if (ask_ahead && start + n < S) {
        LineRange key_lines =
            stored_row_lines(a.key, b, kv_head, start + n, std::min(key_block, S - start - n));
        const int64_t pieces = (Ev + kAheadColumnsPerPiece - 1) / kAheadColumnsPerPiece;
        for (int64_t c = 0; c < Ev; c += kAheadColumnsPerPiece) {
          request_lines_to_l2(key_lines, (key_lines.end + pieces - 1) / pieces);
          kt.gemm(rows, std::min(kAheadColumnsPerPiece, Ev - c), n, st, 1, qt, vb + c, ldv, o + c,
                  Ev, init, alpha);
        }
      } else {
        kt.gemm(rows, Ev, n, st, 1, qt, vb, ldv, o, Ev, init, alpha);
      }
    } else {
      if (first_block) std::fill(o, o + qt * Ev, T(0));
      for (int64_t r = 0; r < rows; ++r) {
        kt.scale(o + r * Ev, Ev, alpha[r], o + r * Ev);
        for (int64_t j = 0; j < n; ++j) p_row[j] = st[j * qt + r];
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
void finish_flash_tile(const SdpaArgs<T>& a, const KernelTable<T>& kt, FlashTile<T>& t) {
  const int qt = kt.query_tile;
  const int64_t Ev = a.value.shape(3);
  if (!t.have_total) {
    std::fill(t.o_total, t.o_total + qt * Ev, T(0));
    std::fill(t.l_total, t.l_total + qt, T(0));
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    T* out = a.out.at(t.b, t.h, t.i0 + r);
    if (!t.open[r]) {
      std::fill(out, out + Ev, T(0));
    } else {
      kt.scale(t.o_total + r * Ev, Ev, T(1) / t.l_total[r], out);
    }
  }
}

// `count` consecutive query tiles of (b, h) from query i0, visited a chunk
// of keys at a time: each chunk's keys and values are read from memory into
// L2 once for all the tiles, where one tile at a time through all its keys
// read every chunk again for each tile (once the keys and values of a head
// outgrow L2: S = 4096, D64 is 2 MiB). Each tile sums the same blocks in the
// same order either way: the same bits.
template <typename T>
void flash_tiles(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                 int64_t i0, int64_t count, int64_t key_block, bool ask_ahead, T* scratch,
                 const FiniteRows& finite_values, const MaskBlockMap<T>& mask_blocks) {
  const int qt = kt.query_tile;
  const int64_t S = a.key.shape(2), E = a.query.shape[3], Ev = a.value.shape(3);
  const size_t buffers = flash_tile_buffers_size<T>(qt, E, Ev);
  T* visit_scratch = scratch + size_t(count) * buffers;
  FlashTile<T> tiles[kMaxTileGroup];
  int64_t begun = 0;
  for (int64_t i = 0; i < count; ++i)
    if (begin_flash_tile(a, kt, b, h, i0 + i * qt, key_block, scratch + size_t(begun) * buffers,
                         mask_blocks, tiles[begun]))
      ++begun;
  const int64_t chunk = key_block * std::max<int64_t>(1, kTileChunk / key_block);
  for (int64_t c0 = 0; c0 < S; c0 += chunk)
    for (int64_t i = 0; i < begun; ++i)
      visit_flash_chunk(a, kt, tiles[i], c0, std::min(S, c0 + chunk), key_block, visit_scratch,
                        finite_values, mask_blocks, ask_ahead && i == 0);
  for (int64_t i = 0; i < begun; ++i) finish_flash_tile(a, kt, tiles[i]);
}

// The weights path (need_weights) a tile of queries at a time, against all
// its keys at once: the scores come from the kernel's gemm block by block
// (keys x qt, as in flash_tile) and are masked as there, then transposed
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

template <typename T>
void weights_tile(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                  int64_t i0, int64_t key_block, T* scratch, const MaskBlockMap<T>& mask_blocks) {
  const int qt = kt.query_tile, W = kt.vector_width;
  const int64_t Hq = a.query.shape[1], L = a.query.shape[2], S = a.key.shape(2);
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  const int64_t kv_head = h / (Hq / a.key.shape(1));
  auto weights_row = [&](int64_t r) { return a.weights + ((b * Hq + h) * L + i0 + r) * S; };
  // Padding rows (past the batch's query length) are zero.
  const int64_t tile_rows = std::min<int64_t>(qt, L - i0);
  const int64_t qlen = query_length(a, b);
  const int64_t rows = std::clamp<int64_t>(qlen - i0, 0, tile_rows);
  for (int64_t r = rows; r < tile_rows; ++r) {
    std::fill_n(a.out.at(b, h, i0 + r), Ev, T(0));
    std::fill_n(weights_row(r), S, T(0));
  }
  if (rows == 0) return;
  const int64_t S_lanes = (S + W - 1) / W * W;
  T* q_t = scratch;                          // E x qt
  T* st = q_t + E * qt;                      // (S + key_block) x qt: every key's scores
  T* o = st + (S + key_block) * qt;          // qt x Ev
  T* k_buf = o + qt * Ev;                    // key_block x E: widened keys
  T* v_buf = k_buf + key_block * E;          // key_block x Ev: widened values
  T* mask_scratch = v_buf + key_block * Ev;  // 2 x key_block x qt
  T* w_rows = mask_scratch + 2 * key_block * qt;  // qt x S_lanes: the weights' rows

  int64_t lo[kMaxTile], hi[kMaxTile];
  bool open[kMaxTile];
  const bool has_masks = tile_bands(a, b, qlen, i0, rows, lo, hi, open);
  // Keys past the last band end, or past the last key the masks leave open
  // to any row (a batch's padding), and not appended, are closed to every
  // row: not read, weight 0. (Only terms of 0 go from the sums: the same
  // bits.)
  // Blocks that the map of mask blocks finds closed to every row of the tile
  // are not computed either: scores -inf, weights 0, values not read.
  const SharedMaskRow<T> shared_masks = shared_mask_row(a, b, h, i0, rows);
  const Band mask_open = keys_open_in_masks(a, shared_masks);
  const MaskBlock* blocks = mask_blocks.tile(b, h, i0);
  const int64_t map_end = blocks ? mask_blocks.open_keys(blocks).hi : S;
  const int64_t S_end =
      S > a.mask_cols ? S
                      : std::min({S, hi[rows - 1], mask_open.empty() ? 0 : mask_open.hi, map_end});
  // The block of keys [j0, j0 + n) by the map.
  auto block_at = [&](int64_t j0, int64_t n) {
    return blocks && j0 + n <= a.mask_cols ? mask_blocks.state(blocks, j0, j0 + n)
                                           : MaskBlock::kMixed;
  };
  const int lanes = static_cast<int>((rows + W - 1) / W) * W;
  kt.pack_transposed(a.query.at(b, h, i0), a.query.stride[2], rows, E, a.scale, q_t, qt);
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);

  // (1) scores and (2) masks, block by block
  bool any_closed = false;  // among the keys read
  for (int64_t j0 = 0; j0 < S_end; j0 += key_block) {
    const int64_t n = std::min(key_block, S_end - j0);
    T* sb = st + j0 * qt;
    const MaskBlock mask_block = block_at(j0, n);
    if (mask_block == MaskBlock::kClosed) {
      std::fill(sb, sb + n * qt, kNegInf<T>);
      continue;
    }
    int64_t ldk;
    const T* kb = keys.rows(j0, n, k_buf, ldk);
    kt.gemm(n, lanes, E, kb, ldk, 1, q_t, qt, sb, qt, GemmInit::kZero, nullptr);
    const int64_t source_end = std::min(j0 + n, a.mask_cols);
    const bool crosses_band = j0 < source_end && (j0 < lo[rows - 1] || source_end > hi[0]);
    if (has_masks && !crosses_band && j0 + n <= a.mask_cols &&
        (mask_block == MaskBlock::kZero || shared_masks_zero(shared_masks, j0, n))) {
      std::fill(open, open + rows, true);  // the masks add 0 (flash_tile)
    } else if (has_masks || crosses_band) {
      any_closed = close_tile(a, kt, b, h, i0, rows, j0, n, qt, lo, hi, sb, open, mask_scratch) ||
                   any_closed;
    }
  }
  // (3) the scores transposed into the rows of the weights (zero past
  // S_end), straight into the weights where their rows are whole vectors
  const bool direct = S % W == 0;
  T* p = direct ? weights_row(0) : w_rows;
  const int64_t ldp = direct ? S : S_lanes;
  kt.pack_transposed(st, qt, S_end, rows, T(1), p, ldp);
  // (4) softmax over each row, as rows_with_weights: a fully masked row is
  // zero; one with open keys whose scores were all -inf (an Inf in the
  // inputs) has sum 0 and gives 0/0 = NaN. The keys past S_end (and within
  // the batch's key length) are closed, weight 0 / sum: NaN where the sum is
  // NaN (a NaN score) or 0, as in rows_with_weights; past the key length, 0.
  T closed_weight[kMaxTile];
  for (int64_t r = 0; r < rows; ++r) {
    T* pr = p + r * ldp;
    closed_weight[r] = T(0);
    if (!open[r] || S_end == 0) {
      std::fill(pr, pr + S_end, T(0));
      continue;
    }
    const T sum = kt.exp_shift_sum(pr, S_end, exp_shift(kt.row_max(pr, S_end)));
    kt.scale(pr, S_end, T(1) / sum, pr);
    closed_weight[r] = T(0) / sum;
  }
  const int64_t closed_end = std::clamp<int64_t>(key_length(a, b), S_end, S);
  for (int64_t r = 0; r < rows; ++r) {
    if (!direct) std::copy_n(w_rows + r * S_lanes, S_end, weights_row(r));
    std::fill(weights_row(r) + S_end, weights_row(r) + closed_end, closed_weight[r]);
    std::fill(weights_row(r) + closed_end, weights_row(r) + S, T(0));
  }

  // (5) the output: the probabilities times the values (a closed block's
  // are all 0: it adds nothing)
  bool first_block = true;
  for (int64_t j0 = 0; j0 < S_end; j0 += key_block) {
    const int64_t n = std::min(key_block, S_end - j0);
    if (block_at(j0, n) == MaskBlock::kClosed) continue;
    int64_t ldv;
    const T* vb = values.rows(j0, n, v_buf, ldv);
    // A closed key has probability 0, and 0 * NaN would carry a NaN in its
    // value into the row (see accumulate_values).
    if (!any_closed || rows_finite(kt, vb, ldv, n, Ev)) {
      kt.gemm(rows, Ev, n, p + j0, ldp, 1, vb, ldv, o, Ev,
              first_block ? GemmInit::kZero : GemmInit::kAccumulate, nullptr);
    } else {
      if (first_block) std::fill(o, o + qt * Ev, T(0));
      for (int64_t r = 0; r < rows; ++r)
        accumulate_values(a, kt, b, h, i0 + r, j0, n, true, p + r * ldp + j0, vb, ldv, Ev,
                          o + r * Ev, false);
    }
    first_block = false;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* out = a.out.at(b, h, i0 + r);
    if (first_block || !open[r])
      std::fill(out, out + Ev, T(0));
    else
      std::copy_n(o + r * Ev, Ev, out);
  }
}

}  // namespace

// Scratch memory of the calling thread, uninitialised, kept between calls
// (it only grows): a small call pays neither an allocation nor a fill.
template <typename T>
T* calling_thread_scratch(size_t size) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local size_t capacity = 0;
  if (size > capacity) {
    buffer.reset(new T[size]);
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
  // and values read, at 8 multiply-adds an element. A decoding step does a
  // few multiply-adds an element, and its time is the memory's: H12 S512 D64
  // (0.8 million multiply-adds, 3 MiB) takes ~100 us on one core.
  const double streamed = double(B * Hk) * double(S_read) * double(E + Ev);
  const int nthreads =
      threads_for(double(B * Hq) * double(L) * double(S_read) * double(E + Ev) + 8 * streamed);

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
  const size_t scratch_per_thread =
      tiled           ? size_t(group) * flash_tile_buffers_size<T>(kt.query_tile, E, Ev) +
                            flash_visit_scratch_size<T>(kt.query_tile, E, Ev, key_block)
      : weights_tiled ? weights_tile_scratch_size<T>(kt.query_tile, kt.vector_width, S, E, Ev,
                                                     key_block)
      : a.weights     ? size_t(kKeyBlock * (E + Ev))
                      : rows_scratch_size<T>(E, Ev);
  // Allocated before the parallel region: an allocation failure raises here
  // (MemoryError in Python) rather than inside a worker thread.
  T* scratch = calling_thread_scratch<T>(size_t(nthreads) * scratch_per_thread);
  const int64_t state_size = Ev + 3;
  std::vector<T> states(chunks > 1 ? size_t(B * Hq * L * chunks * state_size) : 0);

  // With masks, most query tiles close a key in most blocks, and each then
  // checks that block's values (see flash_tile): the checks are made once.
  FiniteRows finite_values;
  const bool has_masks = a.masks[0].present() || a.masks[1].present();
  if (tiled && has_masks && a.value.storage == Storage::kNative)
    finite_values.take(a, kt, B, Hk, S_read, nthreads);
  MaskBlockMap<T> mask_blocks;
  if (has_masks && (tiled || weights_tiled))
    mask_blocks.build(a, kt, kt.query_tile, nthreads);

  // A head's tasks go to one thread together where there are heads enough
  // to share out: its keys and values are then read into one core's cache,
  // not into each core's.
  const int64_t grain = B * heads >= 4 * nthreads ? q_groups * chunks : 1;
  parallel_for(tasks, nthreads, Schedule::kDynamic, [&](int64_t t) {
    T* my_scratch = scratch + current_thread() * scratch_per_thread;
    const int64_t c = t % chunks, qg = (t / chunks) % q_groups, bh = t / (chunks * q_groups);
    const int64_t b = bh / heads, h = bh % heads;
    const int64_t qb = qg * group;
    const int64_t r0 = qb * rows_per_task, r1 = std::min(rows_per_head, r0 + rows_per_task);
    if (tiled) {
      flash_tiles(a, kt, b, h, r0, std::min(group, q_blocks - qb), key_block, ask_ahead,
                  my_scratch, finite_values, mask_blocks);
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
  }, grain);
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
