// Strided, non-owning views of the arrays the core reads and writes.
//
// The bindings build these straight from NumPy arrays without copying, so a
// broadcast operand (stride 0), a transposed one or a reversed one (negative
// stride) is read in place. Strides are in elements, not bytes.
#pragma once

#include <cstdint>

namespace attnx {

template <typename T, int Rank>
struct StridedView {
  T* data = nullptr;
  int64_t shape[Rank] = {};
  int64_t stride[Rank] = {};
  // When set, the offset of each index of dim 0, replacing index * stride[0]:
  // several broadcast batch dims whose strides cannot merge into one (say
  // (0, s)) are then still read in place.
  const int64_t* batch_offsets = nullptr;

  bool present() const { return data != nullptr; }

  // Pointer to the element at the given leading indices; the remaining
  // indices are zero. Used to reach a row whose last dim is then walked.
  template <typename... Index>
  T* at(Index... index) const {
    static_assert(sizeof...(Index) >= 1 && sizeof...(Index) <= Rank, "bad index count");
    const int64_t idx[] = {static_cast<int64_t>(index)...};
    int64_t offset = batch_offsets ? batch_offsets[idx[0]] : idx[0] * stride[0];
    for (int d = 1; d < static_cast<int>(sizeof...(Index)); ++d) offset += idx[d] * stride[d];
    return data + offset;
  }
};

// A matrix whose rows are contiguous (weights, packed buffers).
template <typename T>
struct RowMajorView {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;

  bool present() const { return data != nullptr; }
  T* row(int64_t r) const { return data + r * row_stride; }
};

}  // namespace attnx
