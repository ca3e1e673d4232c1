// What the forward pass and the decode step of multi-head attention share:
// scratch buffers, the self-attention projection and the views of heads.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/cache_line_array.h"
#include "attention/projection.h"
#include "attnx/attention.h"

namespace attnx::mha {

// An uninitialised array of T (std::vector would zero-fill it), starting on
// a cache line: the rows of the heads' keys and values in it then start on
// lines too where the head dim allows, and sdpa reads them in place.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size) : data_(cache_line_array<T>(size)) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }

 private:
  CacheLineArray<T> data_;
};

// A contiguous (N, L, cols) view of `data`.
template <typename U>
StridedView<U, 3> rows_view(U* data, int64_t N, int64_t L, int64_t cols) {
  StridedView<U, 3> v;
  v.data = data;
  v.shape[0] = N, v.shape[1] = L, v.shape[2] = cols;
  v.stride[0] = L * cols, v.stride[1] = cols, v.stride[2] = 1;
  return v;
}

// Columns [offset, offset + E) of a contiguous (N, L, row) buffer seen as
// (N, H, L, hd).
template <typename U>
StridedView<U, 4> heads_view(U* data, int64_t N, int64_t L, int64_t E, int64_t H,
                             int64_t row = 0, int64_t offset = 0) {
  if (row == 0) row = E;
  StridedView<U, 4> v;
  v.data = data + offset;
  v.shape[0] = N, v.shape[1] = H, v.shape[2] = L, v.shape[3] = E / H;
  v.stride[0] = L * row, v.stride[1] = E / H, v.stride[2] = row, v.stride[3] = 1;
  return v;
}

// The packed rows of `p`'s sequences in a contiguous (total, row) buffer,
// columns [offset, offset + E), seen as (count, H, max_length, hd): sequence
// b reached through offsets[b] = starts[b] * row (row_offsets). stride[0]
// is nonzero so that the view is not read as broadcast over sequences.
template <typename U>
StridedView<U, 4> packed_heads_view(U* data, const PackedRows& p, const int64_t* offsets,
                                    int64_t E, int64_t H, int64_t row = 0, int64_t offset = 0) {
  if (row == 0) row = E;
  StridedView<U, 4> v = heads_view(data, p.count, p.max_length, E, H, row, offset);
  v.stride[0] = (p.max_length > 0 ? p.max_length : 1) * row;
  v.batch_offsets = offsets;
  return v;
}

// offsets[b] = starts[b] * row: where each packed sequence starts in a buffer
// of rows of `row` elements.
inline std::vector<int64_t> row_offsets(const PackedRows& p, int64_t row) {
  std::vector<int64_t> offsets(size_t(p.count));
  for (int64_t b = 0; b < p.count; ++b) offsets[size_t(b)] = p.starts[b] * row;
  return offsets;
}

// qkv (N, L, 3E) = the query, key and value projections of x side by side in
// each row: one product where the weights are stacked as torch's
// in_proj_weight (the same sums as three; with bfloat16 products x is then
// rounded once, against the stacked weights packed as one, bf16_qkv, or by
// the call where none of them is packed), else three.
template <typename T>
void project_self(const MhaParams<T>& p, const StridedView<const T, 3>& x, T* qkv,
                  Precision precision = Precision::kNative) {
  const int64_t N = x.shape[0], L = x.shape[1], E = p.w_q.rows;
  const bool one_packing = precision == Precision::kNative || p.bf16_qkv || !p.bf16_q;
  if (p.stacked() && one_packing) {
    RowMajorView<const T> w_qkv = p.w_q;
    w_qkv.rows = 3 * E;
    linear_forward(x, w_qkv, p.b_q, rows_view(qkv, N, L, 3 * E), Activation::kNone, precision,
                   p.bf16_qkv);
    return;
  }
  const RowMajorView<const T>* weights[3] = {&p.w_q, &p.w_k, &p.w_v};
  const T* biases[3] = {p.b_q, p.b_k, p.b_v};
  const Bf16Weights* packed[3] = {p.bf16_q, p.bf16_k, p.bf16_v};
  for (int i = 0; i < 3; ++i) {
    StridedView<T, 3> y = rows_view(qkv + i * E, N, L, E);
    y.stride[0] = L * 3 * E, y.stride[1] = 3 * E;
    linear_forward(x, *weights[i], biases[i], y, Activation::kNone, precision, packed[i]);
  }
}

template <typename T>
StridedView<const T, 3> as_const(const StridedView<T, 3>& v) {
  StridedView<const T, 3> c;
  c.data = v.data;
  for (int d = 0; d < 3; ++d) c.shape[d] = v.shape[d], c.stride[d] = v.stride[d];
  return c;
}

}  // namespace attnx::mha
