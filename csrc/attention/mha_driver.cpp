// Multi-head attention forward, as torch.nn.functional.multi_head_attention_forward.
//
//   Q = query . w_q^T + b_q                          (N, L, E) = (N, L, H, hd)
//   K = key . w_k^T + b_k, or static_k               (N, S, E) or (N, H, S, hd)
//   V likewise; then append the bias_k/bias_v row and the zero row when asked,
//   giving S' = S_src + bias + zero keys
//   A = sdpa(Q, K, V, masks over the S_src keys, scale 1/sqrt(hd)) per head
//   out = A . w_out^T + b_out                        (heads concatenated)
//   weights: per head (N, H, L, S'), or their mean over heads
//
// Packed sequences (query_rows, key_rows): the projections run over all the
// rows at once, and sdpa sees the sequences through batch offsets into the
// projections (KeyRange::packed, each sequence's query and key lengths).
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/cache_line_array.h"
#include "attention/projection.h"
#include "attention/self_attention_few_rows.h"
#include "attention/mha_shared.h"
#include "attnx/attention.h"

namespace attnx {
namespace {

using mha::as_const;
using mha::Buffer;
using mha::heads_view;

// Keys (or values) as sdpa reads them: a (N, H, S', hd) view, backed either
// by the caller's static array or by `storage`.
template <typename T>
StridedView<const T, 4> build_keys(const StridedView<const T, 3>& input,
                                   const RowMajorView<const T>& w, const T* b, const T* bias_row,
                                   bool zero_row, const StridedView<const T, 4>& static_keys,
                                   int64_t H, Buffer<T>& storage, Precision precision,
                                   const Bf16Weights* packed) {
  const int64_t N = input.shape[0], E = w.rows, hd = E / H;
  StridedView<const T, 4> view;
  if (static_keys.present()) {
    if (!zero_row) return static_keys;  // used in place
    // Copy the static keys with one zero key after them.
    const int64_t S = static_keys.shape[2], Sp = S + 1;
    storage = Buffer<T>(size_t(N * H * Sp * hd));
    std::fill_n(storage.data(), N * H * Sp * hd, T(0));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s)
          std::copy_n(static_keys.at(n, h, s), hd, storage.data() + ((n * H + h) * Sp + s) * hd);
    view.data = storage.data();
    view.shape[0] = N, view.shape[1] = H, view.shape[2] = Sp, view.shape[3] = hd;
    view.stride[0] = H * Sp * hd, view.stride[1] = Sp * hd, view.stride[2] = hd,
    view.stride[3] = 1;
    return view;
  }
  // Projected keys, laid out (N, S', E) so that head h is columns [h*hd, (h+1)*hd).
  const int64_t S = input.shape[1];
  const int64_t Sp = S + (bias_row ? 1 : 0) + (zero_row ? 1 : 0);
  storage = Buffer<T>(size_t(N * Sp * E));
  StridedView<T, 3> projected;
  projected.data = storage.data();
  projected.shape[0] = N, projected.shape[1] = S, projected.shape[2] = E;
  projected.stride[0] = Sp * E, projected.stride[1] = E, projected.stride[2] = 1;
  linear_forward(input, w, b, projected, Activation::kNone, precision, packed);
  for (int64_t n = 0; n < N; ++n) {
    T* extra = storage.data() + (n * Sp + S) * E;
    if (bias_row) std::copy_n(bias_row, E, extra), extra += E;
    if (zero_row) std::fill_n(extra, E, T(0));
  }
  view.data = storage.data();
  view.shape[0] = N, view.shape[1] = H, view.shape[2] = Sp, view.shape[3] = hd;
  view.stride[0] = Sp * E, view.stride[1] = hd, view.stride[2] = E, view.stride[3] = 1;
  return view;
}

template <typename T, int Rank>
bool same_view(const StridedView<T, Rank>& a, const StridedView<T, Rank>& b) {
  if (a.data != b.data || a.batch_offsets || b.batch_offsets) return false;
  for (int d = 0; d < Rank; ++d)
    if (a.shape[d] != b.shape[d] || a.stride[d] != b.stride[d]) return false;
  return true;
}

// Whether the three input projections run as one over [w_q; w_k; w_v]:
// self-attention (query, key and value the same array) with the weights,
// and the biases if any, stacked in memory as in torch's in_proj_weight,
// nothing appended to or replacing the keys, and rows few enough that each
// projection copies the input, or that the stacked one is computed
// transposed: one call then transposes the input once instead of three
// times, runs one parallel loop and allocates once. The numbers are the
// same: each output is the same sum in the same order. With more rows the
// weights are packed, the projection is no faster as one, and the attention
// reads q, k and v from rows of 3E more slowly (docs/tuning.md).
template <typename T>
bool stacked_self_projection(const MhaArgs<T>& a) {
  const int64_t E = a.w_q.rows, rows = a.query.shape[0] * a.query.shape[1];
  if (!linear_copies_input<T>(rows) && !linear_transposes<T>(rows, 3 * E, a.w_q.cols))
    return false;
  const bool plain_keys = !a.static_k.present() && !a.static_v.present() && !a.bias_k &&
                          !a.bias_v && !a.add_zero_attn;
  const bool self = same_view(a.key, a.query) && same_view(a.value, a.query) &&
                    a.key_rows.starts == a.query_rows.starts;
  return plain_keys && self && a.stacked();
}

// Whether the keys and values of a call with key lengths are projected for
// each batch's first key_lengths[n] rows only, gathered end to end as
// packed keys: projected keys (not static, not the stacked self-attention
// product, which the queries need whole), queries not packed, no masks or
// weights (which packed sequences do not take), and some padding to skip.
template <typename T>
bool skips_padded_keys(const MhaArgs<T>& a, bool stacked) {
  if (!a.key_lengths || stacked || a.query_rows.present() || a.key_rows.present() ||
      a.static_k.present() || a.static_v.present() || a.weights || a.masks[0].present() ||
      a.masks[1].present())
    return false;
  const int64_t N = a.key.shape[0], S = a.key.shape[1];
  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n) total += a.key_lengths[n];
  return total > 0 && total < N * S;
}

// The first lengths[n] rows of each batch n of x, end to end: a (1, total, C)
// view of `storage`.
template <typename T>
StridedView<const T, 3> gather_rows(const StridedView<const T, 3>& x, const PackedRows& rows,
                                    Buffer<T>& storage) {
  const int64_t C = x.shape[2];
  const int64_t total = rows.starts[rows.count - 1] + rows.lengths[rows.count - 1];
  storage = Buffer<T>(size_t(total * C));
  for (int64_t n = 0; n < rows.count; ++n)
    for (int64_t s = 0; s < rows.lengths[n]; ++s)
      std::copy_n(x.at(n, s), C, storage.data() + (rows.starts[n] + s) * C);
  StridedView<const T, 3> v;
  v.data = storage.data();
  v.shape[0] = 1, v.shape[1] = total, v.shape[2] = C;
  v.stride[0] = total * C, v.stride[1] = C, v.stride[2] = 1;
  return v;
}

}  // namespace

template <typename T>
void mha_forward(const MhaArgs<T>& a) {
  const int64_t N = a.query.shape[0], L = a.query.shape[1], E = a.w_q.rows;
  const int64_t H = a.num_heads, hd = E / H;

  // Input projections. (Buffers the projections overwrite wholly are left
  // uninitialised: zero-filling them would cost a pass over memory.)
  Buffer<T> q_storage, k_storage, v_storage;
  StridedView<const T, 4> queries, keys, values;
  // Packed sequences (query_rows): the projections run over all rows at
  // once, as over one batch of N * L rows; the heads views reach each
  // sequence through offsets.
  const bool packed = a.query_rows.present();
  const PackedRows& qr = a.query_rows;
  std::vector<int64_t> q_offsets, k_offsets, out_offsets;
  // The keys' packing: the caller's, or that of skips_padded_keys.
  PackedRows key_rows = a.key_rows;
  std::vector<int64_t> gathered_starts;
  Buffer<T> k_input, v_input;
  const bool stacked = stacked_self_projection(a);
  if (stacked && a.precision == Precision::kNative && !packed && !a.key_lengths &&
      self_attention_few_rows(a))
    return;
  if (stacked) {
    // (N, L, 3E): q, k and v side by side in each row.
    q_storage = Buffer<T>(size_t(N * L * 3 * E));
    mha::project_self<T>(a, a.query, q_storage.data(), a.precision);
    if (packed) {
      q_offsets = mha::row_offsets(qr, 3 * E);
      const T* qkv = q_storage.data();
      queries = mha::packed_heads_view<const T>(qkv, qr, q_offsets.data(), E, H, 3 * E, 0);
      keys = mha::packed_heads_view<const T>(qkv, qr, q_offsets.data(), E, H, 3 * E, E);
      values = mha::packed_heads_view<const T>(qkv, qr, q_offsets.data(), E, H, 3 * E, 2 * E);
    } else {
      queries = heads_view<const T>(q_storage.data(), N, L, E, H, 3 * E, 0);
      keys = heads_view<const T>(q_storage.data(), N, L, E, H, 3 * E, E);
      values = heads_view<const T>(q_storage.data(), N, L, E, H, 3 * E, 2 * E);
    }
  } else {
    q_storage = Buffer<T>(size_t(N * L * E));
    StridedView<T, 3> q_proj;
    q_proj.data = q_storage.data();
    q_proj.shape[0] = N, q_proj.shape[1] = L, q_proj.shape[2] = E;
    q_proj.stride[0] = L * E, q_proj.stride[1] = E, q_proj.stride[2] = 1;
    linear_forward(a.query, a.w_q, a.b_q, q_proj, Activation::kNone, a.precision, a.bf16_q);
    if (packed) {
      q_offsets = mha::row_offsets(qr, E);
      queries = mha::packed_heads_view<const T>(q_storage.data(), qr, q_offsets.data(), E, H);
    } else {
      queries = heads_view<const T>(q_storage.data(), N, L, E, H);
    }
    StridedView<const T, 3> key_in = a.key, value_in = a.value;
    if (skips_padded_keys(a, stacked)) {
      // Trailing padding: its keys and values are neither projected nor read.
      gathered_starts.assign(size_t(N), 0);
      for (int64_t n = 1; n < N; ++n)
        gathered_starts[size_t(n)] = gathered_starts[size_t(n - 1)] + a.key_lengths[n - 1];
      key_rows.count = N;
      key_rows.starts = gathered_starts.data();
      key_rows.lengths = a.key_lengths;
      for (int64_t n = 0; n < N; ++n)
        key_rows.max_length = std::max(key_rows.max_length, a.key_lengths[n]);
      key_in = gather_rows(a.key, key_rows, k_input);
      value_in = same_view(a.value, a.key) ? key_in : gather_rows(a.value, key_rows, v_input);
    }
    keys = build_keys(key_in, a.w_k, a.b_k, a.bias_k, a.add_zero_attn, a.static_k, H, k_storage,
                      a.precision, a.bf16_k);
    values = build_keys(value_in, a.w_v, a.b_v, a.bias_v, a.add_zero_attn, a.static_v, H,
                        v_storage, a.precision, a.bf16_v);
    if (key_rows.present()) {
      // Projected (1, total_k, E) rows: the same buffers seen per sequence.
      k_offsets = mha::row_offsets(key_rows, E);
      keys = mha::packed_heads_view<const T>(keys.data, key_rows, k_offsets.data(), E, H);
      values = mha::packed_heads_view<const T>(values.data, key_rows, k_offsets.data(), E, H);
    }
  }
  const int64_t S_src = a.static_k.present()   ? a.static_k.shape[2]
                        : key_rows.present()   ? key_rows.max_length
                        : stacked && packed    ? qr.max_length
                                               : a.key.shape[1];
  const int64_t Sp = keys.shape[2];

  // Attention per head, written with the heads concatenated.
  Buffer<T> attn_storage(size_t(N * L * E));
  Buffer<T> per_head_weights;
  SdpaArgs<T> sdpa;
  sdpa.query = queries;
  sdpa.key = StoredView<T>::of(keys);
  sdpa.value = StoredView<T>::of(values);
  for (int m = 0; m < kMaxMasks; ++m) sdpa.masks[m] = a.masks[m];
  sdpa.mask_cols = S_src;
  sdpa.range.causal = a.causal;
  sdpa.range.bottom_right = a.bottom_right;
  sdpa.range.key_lengths = a.key_lengths;
  if (packed || key_rows.present()) {
    sdpa.range.packed = true;
    if (packed) sdpa.range.query_lengths = qr.lengths;
    const PackedRows& kr = stacked ? qr : key_rows;
    if (kr.present()) sdpa.range.key_lengths = kr.lengths;
  }
  sdpa.scale = T(1) / std::sqrt(T(hd));
  if (packed) {
    out_offsets = mha::row_offsets(qr, E);
    sdpa.out = mha::packed_heads_view<T>(attn_storage.data(), qr, out_offsets.data(), E, H);
  } else {
    sdpa.out = heads_view<T>(attn_storage.data(), N, L, E, H);
  }
  sdpa.precision = a.precision;
  if (a.weights) {
    if (a.average_weights) {
      per_head_weights = Buffer<T>(size_t(N * H * L * Sp));
      sdpa.weights = per_head_weights.data();
    } else {
      sdpa.weights = a.weights;
    }
  }
  sdpa_forward(sdpa);

  if (a.weights && a.average_weights) {
    // Mean over heads, summed in head order (as torch's mean).
    const int64_t plane = L * Sp;
    for (int64_t n = 0; n < N; ++n) {
      T* dst = a.weights + n * plane;
      std::fill_n(dst, plane, T(0));
      for (int64_t h = 0; h < H; ++h) {
        const T* src = per_head_weights.data() + (n * H + h) * plane;
        for (int64_t x = 0; x < plane; ++x) dst[x] += src[x];
      }
      for (int64_t x = 0; x < plane; ++x) dst[x] /= T(H);
    }
  }

  // Output projection.
  StridedView<T, 3> attn;
  attn.data = attn_storage.data();
  attn.shape[0] = N, attn.shape[1] = L, attn.shape[2] = E;
  attn.stride[0] = L * E, attn.stride[1] = E, attn.stride[2] = 1;
  linear_forward(as_const(attn), a.w_out, a.b_out, a.out, Activation::kNone, a.precision,
                 a.bf16_out);
}

template void mha_forward<float>(const MhaArgs<float>&);
template void mha_forward<double>(const MhaArgs<double>&);

}  // namespace attnx
