// The weights path (need_weights) of scaled dot-product attention, a tile of
// queries at a time (see sdpa_weights_tile.h).
#include <algorithm>
#include <cmath>

#include "attention/sdpa_weights_tile.h"

namespace attnx::sdpa {

template <typename T>
void weights_tile(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, T* scratch) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const int64_t key_block = c.plan.key_block;
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

  // The keys computed end at S_end (see TileMasks::weights_end). Blocks
  // that the map of mask blocks finds closed to every row of the tile are
  // not computed either: scores -inf, weights 0, values not read.
  TileMasks<T> masks;
  masks.begin(a, c.mask_blocks, b, h, qlen, i0, rows);
  const bool* open = masks.open;
  const int64_t S_end = masks.weights_end(a);
  const int lanes = static_cast<int>((rows + W - 1) / W) * W;
  kt.pack_transposed(a.query.at(b, h, i0), a.query.stride[2], rows, E, a.query_scale(), q_t, qt);
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);

  // (1) scores and (2) masks, block by block
  bool any_closed = false;  // among the keys read
  for (int64_t j0 = 0; j0 < S_end; j0 += key_block) {
    const int64_t n = std::min(key_block, S_end - j0);
    T* sb = st + j0 * qt;
    const MaskBlock mask_block = masks.classify(a, j0, n);
    if (mask_block == MaskBlock::kClosed) {
      std::fill(sb, sb + n * qt, kNegInf<T>);
      continue;
    }
    int64_t ldk;
    const T* kb = keys.rows(j0, n, k_buf, ldk);
    kt.gemm(n, lanes, E, kb, ldk, 1, q_t, qt, sb, qt, GemmInit::kZero, nullptr);
    soft_cap(a, kt, sb, n, qt, lanes, a.softcap_folded());
    any_closed = masks.apply(a, kt, mask_block, j0, n, sb, mask_scratch) || any_closed;
  }
  // (3) the scores transposed into the rows of the weights (zero past
  // S_end), straight into the weights where their rows are whole vectors
  const bool direct = S % W == 0;
  T* p = direct ? weights_row(0) : w_rows;
  const int64_t ldp = direct ? S : S_lanes;
  kt.pack_transposed(st, qt, S_end, rows, T(1), p, ldp);
  // (4) softmax over each row, as rows_with_weights: a fully masked row is
  // zero; one with open keys whose scores were all -inf (an Inf in the
  // inputs) has sum 0 and gives 0/0 = NaN. The keys past S_end are closed,
  // weight 0 / sum: NaN where the sum is NaN (a NaN score) or 0, as in
  // rows_with_weights. Keys past a batch's key length (trailing padding,
  // never read) are closed keys too: a NaN row's weights are NaN there, as
  // torch gives them for the padding mask they stand for.
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
    round_operands(c, pr, S_end);
    closed_weight[r] = T(0) / sum;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (!direct) std::copy_n(w_rows + r * S_lanes, S_end, weights_row(r));
    std::fill(weights_row(r) + S_end, weights_row(r) + S, closed_weight[r]);
  }

  // (5) the output: the probabilities times the values (a closed block's
  // are all 0: it adds nothing)
  bool first_block = true;
  for (int64_t j0 = 0; j0 < S_end; j0 += key_block) {
    const int64_t n = std::min(key_block, S_end - j0);
    if (masks.closed(a, j0, n)) continue;
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

template void weights_tile<float>(const SdpaContext<float>&, int64_t, int64_t, int64_t, float*);
template void weights_tile<double>(const SdpaContext<double>&, int64_t, int64_t, int64_t, double*);

}  // namespace attnx::sdpa
