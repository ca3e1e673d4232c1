// A transformer layer in one call (attnx/transformer.h):
//
//   [decoding: x -> contiguous rows, the order (n, l)]
//   pre-norm: h = norm1(x)
//   for each block (self-attention, [cross-attention,] feed-forward):
//     sub = block(pre-norm ? h : x)            (mha_forward / mha_step; two
//                                               linear layers, the activation
//                                               applied as each tile of the
//                                               first completes)
//     post-norm: x = norm_b(x + sub)           (one pass over each row)
//     pre-norm:  x = x + sub; h = norm_b+1(x)  (one pass over each row)
//   out = x, through the final norm where there is one (the same pass)
//
// The blocks run on the attention drivers and the linear layers; the sums
// and norms go row by row, each row's sums in one order, so the results do
// not depend on the thread count.
#include <algorithm>
#include <cstdint>

#include "attention/mha_shared.h"
#include "attention/projection.h"
#include "attnx/transformer.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

using mha::as_const;
using mha::Buffer;
using mha::rows_view;

// An element of a residual sum and layer norm costs about as much time as
// this many multiply-adds of threads_for's count: three passes over the row,
// from memory rather than registers (measurements: docs/tuning.md).
constexpr double kNormElementWork = 40;

// Per row r = (n, l) of x: s = x + y (y: contiguous rows of E, or null);
// sum_out = s where given; out = norm(s) where given (norm then too). out
// and sum_out may be x's own rows.
template <typename T>
void residual_norm(const StridedView<const T, 3>& x, const T* y, const LayerNormParams<T>* norm,
                   const StridedView<T, 3>* sum_out, const StridedView<T, 3>* out) {
  const KernelTable<T>& kt = active_kernels(T());
  const int64_t L = x.shape[1], E = x.shape[2], rows = x.shape[0] * L;
  parallel_for(rows, threads_for(kNormElementWork * double(rows) * double(E)),
               [&](int64_t r) {
                 const int64_t n = r / L, l = r % L;
                 kt.add_layer_norm(x.at(n, l), y ? y + r * E : nullptr, E,
                                   norm ? norm->weight : nullptr, norm ? norm->bias : nullptr,
                                   norm ? norm->eps : T(0), sum_out ? sum_out->at(n, l) : nullptr,
                                   out ? out->at(n, l) : nullptr);
               });
}

template <typename T>
void self_attention(const TransformerLayerArgs<T>& a, const StridedView<const T, 3>& input,
                    T* sub) {
  const int64_t N = input.shape[0], L = input.shape[1], E = input.shape[2];
  if (a.self_cache) {
    // input is contiguous here: the step's rows, (n, l) order.
    MhaStepArgs<T> s;
    s.params = a.params.self_attn;
    s.rows = RowMajorView<const T>{input.data, N * L, E, E};
    s.batch = N, s.tokens = L, s.batch_first = true;
    s.cache = *a.self_cache;
    s.out = sub;
    s.precision = a.precision;
    mha_step(s);
    return;
  }
  MhaArgs<T> m;
  static_cast<MhaParams<T>&>(m) = a.params.self_attn;
  m.query = m.key = m.value = input;
  for (int k = 0; k < kMaxMasks; ++k) m.masks[k] = a.self_masks.masks[k];
  m.causal = a.self_masks.causal;
  m.query_rows = m.key_rows = a.x_rows;
  m.out = rows_view(sub, N, L, E);
  m.precision = a.precision;
  mha_forward(m);
}

template <typename T>
void cross_attention(const TransformerLayerArgs<T>& a, const StridedView<const T, 3>& input,
                     T* sub) {
  MhaArgs<T> m;
  static_cast<MhaParams<T>&>(m) = a.params.cross_attn;
  m.query = input;
  m.key = m.value = a.memory;
  // Decoding: the memory's keys and values as projected once (they replace
  // the projections of key and value, which are then not read).
  m.static_k = a.memory_keys;
  m.static_v = a.memory_values;
  for (int k = 0; k < kMaxMasks; ++k) m.masks[k] = a.cross_masks.masks[k];
  m.causal = a.cross_masks.causal;
  m.query_rows = a.x_rows;
  m.key_rows = a.memory_rows;
  m.out = rows_view(sub, input.shape[0], input.shape[1], input.shape[2]);
  m.precision = a.precision;
  mha_forward(m);
}

template <typename T>
void feed_forward(const TransformerLayerArgs<T>& a, const StridedView<const T, 3>& input,
                  T* hidden, T* sub) {
  const FeedForwardParams<T>& ff = a.params.ff;
  const int64_t N = input.shape[0], L = input.shape[1], E = input.shape[2], F = ff.w1.rows;
  const StridedView<T, 3> h = rows_view(hidden, N, L, F);
  linear_forward(input, ff.w1, ff.b1, h, a.activate ? Activation::kNone : ff.activation,
                 a.precision, a.params.bf16_w1);
  if (a.activate) a.activate(hidden, N * L, F);
  linear_forward(as_const(h), ff.w2, ff.b2, rows_view(sub, N, L, E), Activation::kNone,
                 a.precision, a.params.bf16_w2);
}

}  // namespace

template <typename T>
void transformer_layer_forward(const TransformerLayerArgs<T>& a) {
  const TransformerLayerParams<T>& p = a.params;
  const int64_t N = a.x.shape[0], L = a.x.shape[1], E = a.x.shape[2], rows = N * L;
  if (rows == 0) return;
  // (Buffers each stage overwrites wholly are left uninitialised.)
  Buffer<T> stream(size_t(rows * E)), sub(size_t(rows * E));
  Buffer<T> normed(p.norm_first ? size_t(rows * E) : 0);
  Buffer<T> hidden(size_t(rows * p.ff.w1.rows));
  const StridedView<T, 3> stream_rows = rows_view(stream.data(), N, L, E);
  const StridedView<T, 3> normed_rows = rows_view(normed.data(), N, L, E);

  StridedView<const T, 3> x = a.x;
  if (a.self_cache) {
    // The step reads its rows contiguous, in the order (n, l).
    residual_norm<T>(x, nullptr, nullptr, &stream_rows, nullptr);
    x = as_const(stream_rows);
  }
  if (p.norm_first) residual_norm<T>(x, nullptr, &p.norms[0], nullptr, &normed_rows);

  const int blocks = p.has_cross ? 3 : 2;
  for (int b = 0; b < blocks; ++b) {
    const StridedView<const T, 3> input = p.norm_first ? as_const(normed_rows) : x;
    const bool last = b == blocks - 1;
    if (b == 0)
      self_attention(a, input, sub.data());
    else if (!last)
      cross_attention(a, input, sub.data());
    else
      feed_forward(a, input, hidden.data(), sub.data());

    const StridedView<T, 3> dst = last ? a.out : stream_rows;
    if (!p.norm_first) {
      residual_norm<T>(x, sub.data(), &p.norms[b], nullptr, &dst);
      if (last && a.final_norm) residual_norm<T>(as_const(dst), nullptr, a.final_norm, nullptr, &dst);
    } else if (!last) {
      residual_norm<T>(x, sub.data(), &p.norms[b + 1], &dst, &normed_rows);
    } else if (a.final_norm) {
      residual_norm<T>(x, sub.data(), a.final_norm, nullptr, &dst);
    } else {
      residual_norm<T>(x, sub.data(), nullptr, &dst, nullptr);
    }
    x = as_const(dst);
  }
}

template void transformer_layer_forward<float>(const TransformerLayerArgs<float>&);
template void transformer_layer_forward<double>(const TransformerLayerArgs<double>&);

}  // namespace attnx
