// Multi-head self-attention over few rows, kept transposed end to end.
//
// With few rows (N * L at most a gemm panel) each projection computes
// y^T = w . x^T, the rows of x as the lanes of x^T, and transposes y^T back;
// the attention then transposes each head's queries again for its tile, and
// the output projection its input. Here the rows stay lanes throughout:
//
//   x^T                                      (E x lanes)        transposed in
//   [Q; K; V]^T = w_qkv . x^T + b_qkv 1^T    (3E x lanes)
//   Q^T *= scale
//   per batch n, head h, on the L lanes of batch n:
//     St = K_h . Q_h^T     (L keys x L queries; K_h read from K^T: A column-major)
//     softmax down each column (one block: every key at once)
//     O_h^T = V_h^T . St   (hd x L)
//     O_h^T *= 1 / l, per lane
//   out^T = w_out . O^T + b_out 1^T          (E_out x lanes)   transposed out
//
// Every value is the same sum in the same order as in the general path (the
// flash tile's scores St are these; its O(q, d) = sum_j P(j, q) V(j, d) is
// O^T(d, q) here, term for term), so the results are the same to the bit:
// the form is taken only where the general path would use one flash tile
// block per head (L * 4 > the query tile, every key in one block), no
// masks, no causal band and no weights. MHA B1 L16 E64 H4: four transposes
// of the rows and the attention's per-tile setup are saved.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/cache_line_array.h"
#include "attention/projection.h"
#include "attention/self_attention_few_rows.h"
#include "kernels/kernel_table.h"

namespace attnx {

template <typename T>
bool self_attention_few_rows(const MhaArgs<T>& a) {
  const KernelTable<T>& kt = active_kernels(T());
  const int64_t N = a.query.shape[0], L = a.query.shape[1], E = a.w_q.rows;
  const int64_t H = a.num_heads, hd = E / H, E_out = a.w_out.rows;
  const int qt = kt.query_tile, W = kt.vector_width;
  const int64_t lanes = transposed_lanes<T>(N * L);
  const int64_t L_lanes = transposed_lanes<T>(L);  // the lanes of one batch's queries
  const bool masked = a.masks[0].present() || a.masks[1].present();
  // One flash tile per head in the general path, all keys in one block
  // (blocks hold at least 32 keys), each batch's lanes starting on a whole
  // vector, and rows enough that linear_forward transposes them (fewer it
  // takes as dot products, which sum in another order).
  const bool one_tile = L * 4 > qt && L_lanes <= qt && L <= 32;
  if (masked || a.causal || a.weights || !one_tile || (N > 1 && L % W != 0) ||
      N * L <= kDotRowsMax)
    return false;

  const int64_t xt_size = E * lanes, qkv_size = 3 * E * lanes, o_size = E * lanes;
  const CacheLineArray<T> buffer =
      cache_line_array<T>(size_t(xt_size + qkv_size + o_size + E_out * lanes + L * qt + 3 * qt));
  T* xt = buffer.get();
  T* qkv_t = xt + xt_size;        // 3E x lanes: Q^T, K^T, V^T
  T* o_t = qkv_t + qkv_size;      // E x lanes: the heads' outputs, concatenated
  T* out_t = o_t + o_size;        // E_out x lanes
  T* st = out_t + E_out * lanes;  // L x qt: one head's scores, then probabilities
  T* m = st + L * qt;             // qt each: the softmax's max, sum, rescale
  T* l = m + qt;
  T* alpha = l + qt;

  transpose_input(a.query, lanes, xt);
  RowMajorView<const T> w_qkv = a.w_q;
  w_qkv.rows = 3 * E;
  linear_transposed(w_qkv, a.b_q, xt, lanes, qkv_t);
  // The queries scaled as the flash tile packs them (q * scale).
  kt.scale(qkv_t, E * lanes, T(1) / std::sqrt(T(hd)), qkv_t);

  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      const T* q_h = qkv_t + h * hd * lanes + n * L;
      const T* k_h = qkv_t + (E + h * hd) * lanes + n * L;
      const T* v_h = qkv_t + (2 * E + h * hd) * lanes + n * L;
      T* o_h = o_t + h * hd * lanes + n * L;
      // St(j, q) = sum_d K(j, d) Q^T(d, q), K(j, d) at k_h[d * lanes + j].
      kt.gemm(L, L_lanes, hd, k_h, 1, lanes, q_h, lanes, st, qt, GemmInit::kZero, nullptr);
      std::fill_n(m, qt, -std::numeric_limits<T>::infinity());
      std::fill_n(l, qt, T(0));
      kt.softmax_tile(st, L, static_cast<int>(L_lanes), m, l, alpha, LineRequests{});
      // O^T(d, q) = sum_j V(j, d) St(j, q), V(j, d) at v_h[d * lanes + j].
      kt.gemm(hd, L_lanes, L, v_h, lanes, 1, st, qt, o_h, lanes, GemmInit::kZero, nullptr);
      // Every query has open keys: out = O / l, as 1 / l times O.
      for (int64_t q = 0; q < L_lanes; ++q) alpha[q] = T(1) / l[q];
      kt.scale_columns(o_h, hd, lanes, L_lanes, alpha);
    }
  }

  linear_transposed(a.w_out, a.b_out, o_t, lanes, out_t);
  transpose_output(out_t, lanes, a.out);
  return true;
}

template bool self_attention_few_rows<float>(const MhaArgs<float>&);
template bool self_attention_few_rows<double>(const MhaArgs<double>&);

}  // namespace attnx
