// Scaled dot-product attention, forward.
//
// Without weights (flash attention: no L x S matrix is ever stored):
//   parallel for each (b, h, block of query rows):
//     m = -inf, l = 0, acc = 0                            per query row
//     for each key block the rows may attend:
//       s = scale * q.k^T + masks; s = -inf where causal forbids     (1)
//       m' = max(m, max_j s); p = exp(s - m'); alpha = exp(m - m')   (2)
//       l = alpha * l + sum_j p; acc = alpha * acc + p.V; m = m'      (3)
//     out = acc / l, or 0 where l == 0 (a fully masked row)          (4)
// With weights: each row's scores are written to the weights, softmaxed in
// place (max, exp and sum, normalise), then out = p.V.
//
// Each output row is computed by one thread in a fixed order, so results do
// not depend on the thread count.
#include <algorithm>
#include <vector>

#include "attention/softmax_rules.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

constexpr int64_t kQueryBlock = 32;   // rows per task
constexpr int64_t kKeyBlock = 128;    // keys per score tile: q rows x keys fit in L1

// Applies the masks and the causal rule to the scores of query row i against
// keys [j0, j0 + n). A closed key (a mask value of -inf, or above the causal
// diagonal) gets the score -inf by selection, not addition, so that a NaN in
// its key cannot reach this row. Returns whether any of these keys is open.
template <typename T>
bool apply_masks(const SdpaArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                 T* s) {
  const int64_t end = j0 + n;
  const int64_t masked_end = std::min(end, a.mask_cols);  // keys past it are always open
  const int64_t causal_end = a.causal ? std::min(masked_end, std::max(j0, i + 1)) : masked_end;
  for (int64_t j = causal_end; j < masked_end; ++j) s[j - j0] = kNegInf<T>;
  bool any_open = masked_end < end;
  const T* rows[kMaxMasks];
  int64_t steps[kMaxMasks];
  int count = 0;
  for (const auto& mask : a.masks)
    if (mask.present()) rows[count] = mask.at(b, h, i), steps[count++] = mask.stride[3];
  if (count == 0) return any_open || causal_end > j0;
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
    any_open = any_open || open;
  }
  return any_open;
}

template <typename T>
void flash_rows(const SdpaArgs<T>& a, const KernelTable<T>& kt, int64_t b, int64_t h, int64_t i0,
                int64_t i1, T* scratch) {
  const int64_t S = a.key.shape[2], E = a.query.shape[3], Ev = a.value.shape[3];
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
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, S - j0);
    // Causal: a block wholly above the diagonal of every row is skipped.
    if (a.causal && j0 > i1 - 1 && j0 + n <= a.mask_cols) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      T* s = tile + r * kKeyBlock;
      // (1) scores
      kt.scores(a.query.at(b, h, i), k_base + j0 * a.key.stride[2], a.key.stride[2], n, E,
                a.scale, s);
      open[r] = apply_masks(a, b, h, i, j0, n, s) || open[r];
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
      kt.accumulate_pv(s, v_base + j0 * a.value.stride[2], a.value.stride[2], n, Ev, acc_r);
    }
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
    const bool open = apply_masks(a, b, h, i, 0, S, p);
    T row_max = kNegInf<T>;
    for (int64_t j = 0; j < S; ++j) row_max = max_ignoring_nan(row_max, p[j]);
    const T sum = kt.exp_shift_sum(p, S, exp_shift(row_max));
    std::fill(o, o + Ev, T(0));
    if (!open) {  // fully masked row
      std::fill(p, p + S, T(0));
      continue;
    }
    kt.scale(p, S, T(1) / sum);
    kt.accumulate_pv(p, v_base, a.value.stride[2], S, Ev, o);
  }
}

}  // namespace

template <typename T>
void sdpa_forward(const SdpaArgs<T>& a) {
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  const int64_t S = a.key.shape[2], E = a.query.shape[3], Ev = a.value.shape[3];
  if (B == 0 || Hq == 0 || L == 0 || Ev == 0) return;
  const KernelTable<T>& kt = active_kernels(T());

  const int64_t q_blocks = (L + kQueryBlock - 1) / kQueryBlock;
  const int64_t tasks = B * Hq * q_blocks;
  const int nthreads = threads_for(double(B * Hq) * double(L) * double(S) * double(E + Ev));
  const int64_t scratch_per_thread = kQueryBlock * (kKeyBlock + Ev + 2);
  // Allocated before the parallel region: an allocation failure raises here
  // (MemoryError in Python) rather than inside a worker thread.
  std::vector<T> scratch(a.weights ? 0 : size_t(nthreads) * size_t(scratch_per_thread));

#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = t % q_blocks, bh = t / q_blocks;
    const int64_t b = bh / Hq, h = bh % Hq;
    const int64_t i0 = qb * kQueryBlock, i1 = std::min(L, i0 + kQueryBlock);
    if (a.weights)
      rows_with_weights(a, kt, b, h, i0, i1);
    else
      flash_rows(a, kt, b, h, i0, i1, scratch.data() + current_thread() * scratch_per_thread);
  }
}

template void sdpa_forward<float>(const SdpaArgs<float>&);
template void sdpa_forward<double>(const SdpaArgs<double>&);

}  // namespace attnx
