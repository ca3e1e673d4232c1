// The scores of scaled dot-product attention at a stage of their way to the
// probabilities (see sdpa_scores in attnx/attention.h), for callers that
// want to see them: a pass of its own, apart from the output's, so that the
// output is the same bits with or without them. Each row of a (b, h) is
// computed as rows_with_weights computes it: the scores with the row
// kernels, a block of keys at a time for a few rows together, then the soft
// cap, the masks and the softmax a whole row at a time.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention/masking/masking.h"
#include "attention/sdpa_bf16.h"
#include "attention/sdpa_common.h"
#include "attention/sdpa_rows.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"

namespace attnx {

using namespace sdpa;

namespace {

// Query rows taken through each block of keys together.
constexpr int64_t kScoreRows = 8;

}  // namespace

template <typename T>
void sdpa_scores(const SdpaArgs<T>& a, ScoreStage stage, T* scores) {
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  const int64_t E = a.query.shape[3], Hk = a.key.shape(1), S = a.key.shape(2);
  if (B == 0 || Hq == 0 || L == 0 || S == 0) return;
  const KernelTable<T>& kt = active_kernels(T());
  if constexpr (std::is_same_v<T, float>) {
    if (a.precision == Precision::kBFloat16) {
      // The scores of the rounded operands, as the weights paths compute them.
      Bf16Operands ops;
      SdpaArgs<T> a16;
      prepare_bf16(a, kt, SdpaPath::kRowsWithWeights, ops, a16);
      a16.precision = Precision::kNative;
      return sdpa_scores(a16, stage, scores);
    }
  }
  const int64_t row_groups = (L + kScoreRows - 1) / kScoreRows;
  const int nthreads = threads_for(double(B * Hq * L) * double(S) * double(E + 4));
  // Widened 16-bit keys, a block per thread; allocated here, so that a
  // failure raises in the calling thread.
  std::vector<T> key_buffers(a.key.storage == Storage::kNative ? 0
                                                               : size_t(nthreads * kKeyBlock * E));
  parallel_for(B * Hq * row_groups, nthreads, [&](int64_t task) {
    const int64_t bh = task / row_groups, i0 = task % row_groups * kScoreRows;
    const int64_t b = bh / Hq, h = bh % Hq, kv_head = h / (Hq / Hk);
    const int rows = static_cast<int>(std::min(kScoreRows, L - i0));
    const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
    T* k_buf = key_buffers.empty() ? nullptr : key_buffers.data() + current_thread() * kKeyBlock * E;
    const T* q_rows[kScoreRows];
    T* out_rows[kScoreRows];
    for (int r = 0; r < rows; ++r) {
      q_rows[r] = a.query.at(b, h, i0 + r);
      out_rows[r] = scores + (bh * L + i0 + r) * S;
    }
    // (1) scale * Q K^T, or that divided by the soft cap (see query_scale)
    const T query_scale = stage == ScoreStage::kQk ? a.scale : a.query_scale();
    for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, S - j0);
      int64_t ldk;
      const T* kb = keys.rows(j0, n, k_buf, ldk);
      T* dst[kScoreRows];
      for (int r = 0; r < rows; ++r) dst[r] = out_rows[r] + j0;
      kt.scores(q_rows, rows, kb, ldk, n, E, query_scale, dst, keys.native);
    }
    if (stage == ScoreStage::kQk) return;
    for (int r = 0; r < rows; ++r) {
      T* p = out_rows[r];
      // (2) the soft cap, (3) the masks and the key range
      soft_cap(a, kt, p, 1, S, S, a.softcap_folded());
      if (stage == ScoreStage::kSoftcapped) continue;
      const KeyStates states = apply_masks(a, b, h, i0 + r, 0, S, p);
      if (stage == ScoreStage::kMasked) continue;
      // (4) the probabilities, as rows_with_weights has them
      row_probabilities(kt, p, S, states.any_open);
    }
  });
}

template void sdpa_scores<float>(const SdpaArgs<float>&, ScoreStage, float*);
template void sdpa_scores<double>(const SdpaArgs<double>&, ScoreStage, double*);

}  // namespace attnx
