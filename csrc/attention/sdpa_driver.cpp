// Scaled dot-product attention, forward.
//
// Tile path (flash attention; no L x S matrix is stored), per task = one
// (b, h, tile of QT queries), with QT the kernel's lane count:
//   Qt = scale * Q_tile^T                                   (E x QT, packed once)
//   m = -inf, l = 0, O = 0                                  per query lane
//   for each key block Kb, Vb the tile may attend:
//     St = Kb . Qt              (keys x queries: lanes are queries)      (1)
//     close masked / causal entries: St = -inf by selection              (2)
//     online softmax down each column: m, l, alpha; St = exp(St - m)     (3)
//     O = diag(alpha) O + St^T . Vb                                      (4)
//   out = O / l, or 0 for a query with no open key                       (5)
// Computing St rather than S keeps the softmax vertical (no horizontal
// reductions), and both products read K and V rows in place, unpacked.
//
// Row path, for few queries per head and for the weights: each query row
// against key blocks with the row kernels (dot, axpy); with weights, each
// row's probabilities are written to the weights, then out = p.V. Without
// weights, long key sequences are split into chunks of kKeyChunk keys, one
// task each, whose softmax states (m, l, acc) are merged in chunk order:
// decoding (one query, many keys) then uses every core.
//
// Each output row is computed by one thread in a fixed order, so results do
// not depend on the thread count.
#include <algorithm>
#include <memory>
#include <vector>

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

// What masking found in a range of keys.
struct KeyStates {
  bool any_open = false;
  bool any_closed = false;
};

// Applies the masks and the causal rule to the scores of query row i against
// keys [j0, j0 + n). A closed key (a mask value of -inf, or above the causal
// diagonal) gets the score -inf by selection, not addition, so that a NaN in
// its key cannot reach this row.
template <typename T>
KeyStates apply_masks(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j0,
                      int64_t n, T* s) {
  const int64_t end = j0 + n;
  const int64_t masked_end = std::min(end, a.mask_cols);  // keys past it are always open
  const int64_t causal_end = a.causal ? std::min(masked_end, std::max(j0, i + 1)) : masked_end;
  for (int64_t j = causal_end; j < masked_end; ++j) s[j - j0] = kNegInf<T>;
  KeyStates states;
  states.any_open = masked_end < end;
  states.any_closed = causal_end < masked_end;
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks)
    if (mask.present()) rows[count] = mask.at(b, h, i), steps[count++] = mask.stride[3];
  if (count == 0) {
    states.any_open = states.any_open || causal_end > j0;
    return states;
  }
  for (int64_t j = j0; j < causal_end; ++j) {
    // The masks are summed before they are added, as torch merges them.
    bool open = true;
    T added = 0;
    for (int m = 0; m < count; ++m) {
      const T value = rows[m][j * steps[m]];
      open = open && value != kNegInf<T>;
      added += value;
    }
    s[j - j0] = open ? s[j - j0] + added : kNegInf<T>;
    states.any_open = states.any_open || open;
    states.any_closed = states.any_closed || !open;
  }
  return states;
}

// Whether query i may not attend key j (a mask value of -inf, or causal).
template <typename T>
bool key_closed(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (j >= a.mask_cols) return false;
  if (a.causal && j > i) return true;
  for (const auto& mask : a.masks)
    if (mask.present() && mask.at(b, h, i)[j * mask.stride[3]] == kNegInf<T>) return true;
  return false;
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
                       const T* v, int64_t ldv, int64_t Ev, T* acc) {
  if (!any_closed || rows_finite(kt, v, ldv, n, Ev)) {
    kt.accumulate_pv(p, v, ldv, n, Ev, acc);
    return;
  }
  for (int64_t j = 0; j < n; ++j)
    if (!key_closed(a, b, h, i, j0 + j)) kt.accumulate_pv(p + j, v + j * ldv, ldv, 1, Ev, acc);
}

// Row path over keys [j_begin, j_end). With `partial` null it writes the
// output rows; otherwise each row's state (m, l, open, acc[Ev]) goes to
// partial + r * partial_stride, to be merged with the other key chunks.
template <typename T>
void flash_rows(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h, int64_t i0,
                int64_t i1, int64_t j_begin, int64_t j_end, T* scratch, T* partial,
                int64_t partial_stride) {
  const int64_t E = a.query.shape[3], Ev = a.value.shape[3];
  const int64_t kv_head = h / (a.query.shape[1] / a.key.shape[1]);
  const int64_t rows = i1 - i0;
  T* tile = scratch;                      // rows x kKeyBlock scores
  T* acc = tile + rows * kKeyBlock;       // rows x Ev
  T* m = acc + rows * Ev;                 // rows
  T* l = m + rows;                        // rows
  bool open[kQueryBlock] = {};            // whether the row has any open key
  std::fill(acc, acc + rows * Ev, T(0));
  std::fill(m, m + rows, kNegInf<T>);
  std::fill(l, l + rows, T(0));

  const T* k_base = a.key.at(b, kv_head);
  const T* v_base = a.value.at(b, kv_head);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, j_end - j0);
    // Causal: a block wholly above the diagonal of every row is skipped.
    if (a.causal && j0 > i1 - 1 && j0 + n <= a.mask_cols) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      T* s = tile + r * kKeyBlock;
      // (1) scores
      kt.scores(a.query.at(b, h, i), k_base + j0 * a.key.stride[2], a.key.stride[2], n, E,
                a.scale, s);
      const KeyStates states = apply_masks(a, b, h, i, j0, n, s);
      open[r] = open[r] || states.any_open;
      // (2) new running max and the rescale of what was accumulated
      T block_max = kNegInf<T>;
      for (int64_t j = 0; j < n; ++j) block_max = max_ignoring_nan(block_max, s[j]);
      const T m_new = max_ignoring_nan(m[r], block_max);
      const T shift = exp_shift(m_new);
      const T alpha = std::exp(m[r] - shift);
      const T block_sum = kt.exp_shift_sum(s, n, shift);
      // (3) update
      T* acc_r = acc + r * Ev;
      if (alpha != T(1)) kt.scale(acc_r, Ev, alpha);
      l[r] = alpha * l[r] + block_sum;
      m[r] = m_new;
      accumulate_values(a, kt, b, h, i, j0, n, states.any_closed, s,
                        v_base + j0 * a.value.stride[2], a.value.stride[2], Ev, acc_r);
    }
  }
  if (partial) {
    for (int64_t r = 0; r < rows; ++r) {
      T* state = partial + r * partial_stride;
      state[0] = m[r], state[1] = l[r], state[2] = open[r] ? T(1) : T(0);
      std::copy_n(acc + r * Ev, Ev, state + 3);
    }
    return;
  }
  // (4) normalise. A row with no open key is zero; a row with open keys
  // whose scores were all -inf (an Inf in the inputs) is 0/0 = NaN.
  for (int64_t r = 0; r < rows; ++r) {
    T* o = a.out.at(b, h, i0 + r);
    const T* acc_r = acc + r * Ev;
    if (!open[r]) {
      std::fill(o, o + Ev, T(0));
    } else {
      const T inv = T(1) / l[r];
      for (int64_t d = 0; d < Ev; ++d) o[d] = acc_r[d] * inv;
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

template <typename T>
void rows_with_weights(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h,
                       int64_t i0, int64_t i1) {
  const int64_t Hq = a.query.shape[1], L = a.query.shape[2], S = a.key.shape[2];
  const int64_t E = a.query.shape[3], Ev = a.value.shape[3];
  const int64_t kv_head = h / (Hq / a.key.shape[1]);
  const T* k_base = a.key.at(b, kv_head);
  const T* v_base = a.value.at(b, kv_head);
  for (int64_t i = i0; i < i1; ++i) {
    T* p = a.weights + ((b * Hq + h) * L + i) * S;
    T* o = a.out.at(b, h, i);
    kt.scores(a.query.at(b, h, i), k_base, a.key.stride[2], S, E, a.scale, p);
    const KeyStates states = apply_masks(a, b, h, i, 0, S, p);
    T row_max = kNegInf<T>;
    for (int64_t j = 0; j < S; ++j) row_max = max_ignoring_nan(row_max, p[j]);
    const T sum = kt.exp_shift_sum(p, S, exp_shift(row_max));
    std::fill(o, o + Ev, T(0));
    if (!states.any_open) {  // fully masked row
      std::fill(p, p + S, T(0));
      continue;
    }
    kt.scale(p, S, T(1) / sum);
    accumulate_values(a, kt, b, h, i, 0, S, states.any_closed, p, v_base, a.value.stride[2], Ev,
                      o);
  }
}


// Step (2) of the tile path on a tile of n keys x QT lanes: lanes r < rows
// are queries i0 + r. Returns whether any entry was closed.
template <typename T>
bool close_tile(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                int64_t n, int qt, T* st, bool* open) {
  const int64_t masked_end = std::min(j0 + n, a.mask_cols);
  if (masked_end < j0 + n) std::fill(open, open + rows, true);  // appended keys are open
  const T* mask_rows[kMaxMasks][kMaxTile];
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks) {
    if (!mask.present()) continue;
    for (int64_t r = 0; r < rows; ++r) mask_rows[count][r] = mask.at(b, h, i0 + r);
    steps[count++] = mask.stride[3];
  }
  bool any_closed = false;
  for (int64_t j = j0; j < masked_end; ++j) {
    T* srow = st + (j - j0) * qt;
    // Causal: lanes whose query precedes key j are closed.
    const int64_t first_open = a.causal ? std::clamp<int64_t>(j - i0, 0, rows) : 0;
    for (int64_t r = 0; r < first_open; ++r) srow[r] = kNegInf<T>;
    any_closed = any_closed || first_open > 0;
    if (count == 0) continue;
    for (int64_t r = first_open; r < rows; ++r) {
      bool is_open = true;
      T added = 0;  // the masks are summed before they are added, as torch merges them
      for (int m = 0; m < count; ++m) {
        const T value = mask_rows[m][r][j * steps[m]];
        is_open = is_open && value != kNegInf<T>;
        added += value;
      }
      srow[r] = is_open ? srow[r] + added : kNegInf<T>;
      open[r] = open[r] || is_open;
      any_closed = any_closed || !is_open;
    }
  }
  return any_closed;
}

// Keys per block of the tile path. One block's keys and values (E + Ev per
// key) and its score tile (qt per key) should share half of a 48 KiB L1
// with room for the packed queries and the accumulator: so
// keys = 24 KiB / ((E + Ev + qt) * sizeof(T)), a multiple of 16 in [32, 256].
// (E = Ev = 64, qt = 32, float: 38 -> 32; E = Ev = 16: 96.)
template <typename T>
int64_t tile_key_block(int qt, int64_t E, int64_t Ev) {
  const int64_t keys = (24 * 1024) / ((E + Ev + qt) * int64_t(sizeof(T)));
  return std::clamp<int64_t>(keys / 16 * 16, 32, 256);
}

template <typename T>
size_t tile_scratch_size(int qt, int64_t E, int64_t Ev, int64_t key_block) {
  return size_t(E * qt + key_block * qt + 2 * qt * Ev + 5 * qt + key_block);
}

// Keys per accumulation chunk of the tile path. Blocks add into a chunk's
// accumulator, and chunks into the total: float32 sums then take
// S / kTileChunk + kTileChunk / key_block steps rather than S / key_block,
// which kept the error at a few 1e-6 over a million keys (one running sum
// reached 2e-4 there).
constexpr int64_t kTileChunk = 1024;

template <typename T>
void flash_tile(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h, int64_t i0,
                int64_t key_block, T* scratch) {
  const int qt = kt.query_tile;
  const int64_t L = a.query.shape[2], S = a.key.shape[2];
  const int64_t E = a.query.shape[3], Ev = a.value.shape[3];
  const int64_t rows = std::min<int64_t>(qt, L - i0), i_last = i0 + rows - 1;
  const int64_t kv_head = h / (a.query.shape[1] / a.key.shape[1]);
  const int64_t ldk = a.key.stride[2], ldv = a.value.stride[2];
  const T* k_base = a.key.at(b, kv_head);
  const T* v_base = a.value.at(b, kv_head);
  T* q_t = scratch;                 // E x qt
  T* st = q_t + E * qt;             // key_block x qt
  T* o = st + key_block * qt;       // qt x Ev
  T* m = o + qt * Ev;               // qt
  T* l = m + qt;                    // qt
  T* alpha = l + qt;                // qt
  T* p_row = alpha + qt;            // key_block
  T* o_total = p_row + key_block;   // qt x Ev: the chunks merged so far
  T* l_total = o_total + qt * Ev;   // qt
  T* m_start = l_total + qt;        // qt: the running max when the chunk began

  // Pack the scaled query tile, transposed; lanes past the last query are 0.
  kt.pack_transposed(a.query.at(b, h, i0), a.query.stride[2], rows, E, a.scale, q_t, qt);
  std::fill(o_total, o_total + qt * Ev, T(0));
  std::fill(l_total, l_total + qt, T(0));
  std::fill(m, m + qt, kNegInf<T>);
  const bool has_masks = a.masks[0].present() || a.masks[1].present();
  // Without masks every query has an open key when there is any (causal
  // always opens key 0); with masks, openness is found while closing.
  bool open[kMaxTile];
  std::fill(open, open + qt, !has_masks && S > 0);

  const int64_t chunk = key_block * std::max<int64_t>(1, kTileChunk / key_block);
  for (int64_t c0 = 0; c0 < S; c0 += chunk) {
    const int64_t c1 = std::min(S, c0 + chunk);
    if (a.causal && c0 > i_last && c1 <= a.mask_cols) continue;  // above the diagonal
    std::fill(o, o + qt * Ev, T(0));
    std::fill(l, l + qt, T(0));
    std::copy_n(m, qt, m_start);
    for (int64_t j0 = c0; j0 < c1; j0 += key_block) {
      int64_t n = std::min(key_block, c1 - j0);
      if (a.causal && j0 + n <= a.mask_cols) {
        // Causal: keys past the tile's last query are closed for all of it, so
        // a block above the diagonal is skipped and the diagonal block cut.
        if (j0 > i_last) continue;
        n = std::min(n, i_last + 1 - j0);
      }
      // (1) scores
      kt.gemm(n, qt, E, k_base + j0 * ldk, ldk, 1, q_t, qt, st, qt, GemmInit::kZero, nullptr);
      // (2) masks; only blocks the diagonal crosses need the causal rule
      const bool on_diagonal = a.causal && j0 + n - 1 > i0 && j0 < a.mask_cols;
      bool any_closed = false;
      if (has_masks || on_diagonal) any_closed = close_tile(a, b, h, i0, rows, j0, n, qt, st, open);
      // (3) online softmax
      kt.softmax_tile(st, n, m, l, alpha);
      // (4) accumulate. A closed key has probability 0, and 0 * NaN would
      // carry a NaN in its value into this row: where keys were closed and
      // the values are not all finite, accumulate row by row, key by key
      // (see accumulate_values).
      const T* vb = v_base + j0 * ldv;
      if (!any_closed || rows_finite(kt, vb, ldv, n, Ev)) {
        kt.gemm(rows, Ev, n, st, 1, qt, vb, ldv, o, Ev, GemmInit::kScaleRows, alpha);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          kt.scale(o + r * Ev, Ev, alpha[r]);
          for (int64_t j = 0; j < n; ++j) p_row[j] = st[j * qt + r];
          accumulate_values(a, kt, b, h, i0 + r, j0, n, true, p_row, vb, ldv, Ev, o + r * Ev);
        }
      }
    }
    // Merge the chunk: the total was accumulated against the max m_start, the
    // chunk against the max m, so the total is rescaled by e^(m_start - m).
    for (int64_t r = 0; r < rows; ++r) {
      const T rescale = std::exp(m_start[r] - exp_shift(m[r]));
      T* total = o_total + r * Ev;
      const T* part = o + r * Ev;
      for (int64_t d = 0; d < Ev; ++d) total[d] = total[d] * rescale + part[d];
      l_total[r] = l_total[r] * rescale + l[r];
    }
  }
  // (5) normalise. A query with open keys whose scores were all -inf (an Inf
  // in the inputs) has l = 0 and gives 0/0 = NaN.
  for (int64_t r = 0; r < rows; ++r) {
    T* out = a.out.at(b, h, i0 + r);
    if (!open[r]) {
      std::fill(out, out + Ev, T(0));
    } else {
      std::copy_n(o_total + r * Ev, Ev, out);
      kt.scale(out, Ev, T(1) / l_total[r]);
    }
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
  const int64_t S = a.key.shape[2], E = a.query.shape[3], Ev = a.value.shape[3];
  if (B == 0 || Hq == 0 || L == 0 || Ev == 0) return;
  const KernelTable<T>& kt = active_kernels(T());
  const int nthreads = threads_for(double(B * Hq) * double(L) * double(S) * double(E + Ev));

  // The tile path wants most of a tile's lanes busy; fewer queries per head
  // (decoding) and the weights take the row path.
  const bool tiled = !a.weights && L * 4 >= kt.query_tile;
  const int64_t rows_per_task = tiled ? kt.query_tile : kQueryBlock;
  const int64_t q_blocks = (L + rows_per_task - 1) / rows_per_task;
  // The row path splits long key sequences into chunks merged afterwards, so
  // that one (b, h) of a decoding step can use every core. The split depends
  // on the shape only, never on the thread count.
  const int64_t chunks =
      tiled || a.weights ? 1 : std::max<int64_t>(1, (S + kKeyChunk - 1) / kKeyChunk);
  const int64_t tasks = B * Hq * q_blocks * chunks;
  const int64_t key_block = tile_key_block<T>(kt.query_tile, E, Ev);
  const size_t scratch_per_thread =
      tiled ? tile_scratch_size<T>(kt.query_tile, E, Ev, key_block)
            : a.weights ? 0 : size_t(kQueryBlock * (kKeyBlock + Ev + 2));
  // Allocated before the parallel region: an allocation failure raises here
  // (MemoryError in Python) rather than inside a worker thread.
  T* scratch = calling_thread_scratch<T>(size_t(nthreads) * scratch_per_thread);
  const int64_t state_size = Ev + 3;
  std::vector<T> states(chunks > 1 ? size_t(B * Hq * L * chunks * state_size) : 0);

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    T* my_scratch = scratch + current_thread() * scratch_per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t c = t % chunks, qb = (t / chunks) % q_blocks, bh = t / (chunks * q_blocks);
      const int64_t b = bh / Hq, h = bh % Hq;
      const int64_t i0 = qb * rows_per_task, i1 = std::min(L, i0 + rows_per_task);
      if (tiled) {
        flash_tile(a, kt, b, h, i0, key_block, my_scratch);
      } else if (a.weights) {
        rows_with_weights(a, kt, b, h, i0, i1);
      } else if (chunks == 1) {
        flash_rows(a, kt, b, h, i0, i1, 0, S, my_scratch, static_cast<T*>(nullptr), 0);
      } else {
        const int64_t j_begin = c * kKeyChunk, j_end = std::min(S, j_begin + kKeyChunk);
        T* first_state = states.data() + ((bh * L + i0) * chunks + c) * state_size;
        flash_rows(a, kt, b, h, i0, i1, j_begin, j_end, my_scratch, first_state,
                   chunks * state_size);
      }
    }
    if (chunks > 1) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < B * Hq * L; ++row) {
        const int64_t bh = row / L, i = row % L;
        merge_chunks(states.data() + row * chunks * state_size, chunks, state_size, Ev,
                     a.out.at(bh / Hq, bh % Hq, i));
      }
    }
  }
}

template void sdpa_forward<float>(const SdpaArgs<float>&);
template void sdpa_forward<double>(const SdpaArgs<double>&);

}  // namespace attnx
