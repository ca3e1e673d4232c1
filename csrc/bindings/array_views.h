// NumPy arrays -> the core's strided views, without copying.
//
// The Python layer already canonicalises every argument; these checks are a
// second line of defence so that no call into the private module, however
// wrong, can read or write out of bounds.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>

#include "attnx/strided_view.h"

namespace attnx::bindings {

namespace py = pybind11;

using OptArray = std::optional<py::array>;

// "(2, 3)", "(7,)": a shape as Python writes it. Put together with
// std::to_string, not iostreams: a build that links libstdc++ statically
// (LDFLAGS=-static-libstdc++) next to the shared libstdc++ that other
// extensions load crashed inside ostream's number formatting.
inline std::string shape_string(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) s += (d ? ", " : "") + std::to_string(a.shape(d));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Equal, not identical: an unpickled array has an equal but distinct dtype object.
inline bool is_dtype(const py::array& a, const py::dtype& dt) { return a.dtype().equal(dt); }

// Checks rank, alignment and element-multiple strides of `a`, whose elements
// are `item` bytes; with `contiguous_last`, also that its last dimension is
// unit-stride.
inline void check_layout(const py::array& a, const char* name, int rank, bool contiguous_last,
                         bool writable, py::ssize_t item) {
  if (a.ndim() != rank)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(rank) +
                          " dimensions, got shape " + shape_string(a));
  if (writable && !a.writeable())
    throw py::value_error(std::string(name) + ": the array is read-only");
  if (reinterpret_cast<std::uintptr_t>(a.data()) % static_cast<std::uintptr_t>(item) != 0)
    throw py::value_error(std::string(name) + ": the array is not aligned");
  // The stride of a dimension of extent 1 is never stepped along, so it may be
  // anything (NumPy calls such an array contiguous whatever that stride is);
  // view_stride() reads it as 0.
  for (int d = 0; d < rank; ++d)
    if (a.shape(d) > 1 && a.strides(d) % item != 0)
      throw py::value_error(std::string(name) + ": strides are not a multiple of the item size");
  // An empty array is never read: its strides do not matter (NumPy gives a
  // broadcast empty array all-zero strides).
  if (contiguous_last && a.size() > 0 && a.shape(rank - 1) > 1 && a.strides(rank - 1) != item)
    throw py::value_error(std::string(name) + ": the last dimension must be contiguous");
}

// check_layout() for an array that must have dtype T.
template <typename T>
void check_array(const py::array& a, const char* name, int rank, bool contiguous_last,
                 bool writable) {
  if (!py::isinstance<py::array_t<T>>(a) || !a.dtype().equal(py::dtype::of<T>()))
    throw py::type_error(std::string(name) + ": expected dtype " +
                         std::string(py::str(py::dtype::of<T>())) + ", got " +
                         std::string(py::str(a.dtype())));
  check_layout(a, name, rank, contiguous_last, writable, static_cast<py::ssize_t>(sizeof(T)));
}

// The stride of dimension d in elements (0 for an extent-1 dimension, whose
// byte stride need not be a multiple of the item size).
template <typename T>
int64_t view_stride(const py::array& a, int d) {
  return a.shape(d) > 1 ? a.strides(d) / static_cast<py::ssize_t>(sizeof(T)) : 0;
}

template <typename T, int Rank>
StridedView<const T, Rank> const_view(const py::array& a, const char* name,
                                      bool contiguous_last = true) {
  check_array<T>(a, name, Rank, contiguous_last, false);
  StridedView<const T, Rank> v;
  v.data = static_cast<const T*>(a.data());
  for (int d = 0; d < Rank; ++d) {
    v.shape[d] = a.shape(d);
    v.stride[d] = view_stride<T>(a, d);
  }
  return v;
}

template <typename T, int Rank>
StridedView<T, Rank> mutable_view(py::array& a, const char* name) {
  check_array<T>(a, name, Rank, true, true);
  StridedView<T, Rank> v;
  v.data = static_cast<T*>(a.mutable_data());
  for (int d = 0; d < Rank; ++d) {
    v.shape[d] = a.shape(d);
    v.stride[d] = view_stride<T>(a, d);
  }
  return v;
}

template <typename T, int Rank>
StridedView<const T, Rank> optional_view(const std::optional<py::array>& a, const char* name,
                                         bool contiguous_last = true) {
  return a ? const_view<T, Rank>(*a, name, contiguous_last) : StridedView<const T, Rank>{};
}

// A matrix with contiguous rows.
template <typename T>
RowMajorView<const T> matrix_view(const py::array& a, const char* name) {
  const StridedView<const T, 2> v = const_view<T, 2>(a, name);
  return RowMajorView<const T>{v.data, v.shape[0], v.shape[1], v.stride[0]};
}

// A C-contiguous vector of exactly `size` elements, or null.
template <typename T>
const T* vector_data(const std::optional<py::array>& a, const char* name, int64_t size) {
  if (!a) return nullptr;
  const StridedView<const T, 1> v = const_view<T, 1>(*a, name);
  if (v.shape[0] != size)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(size) +
                          " elements, got shape " + shape_string(*a));
  return v.data;
}

// Checks the leading extents of a view (a shape mismatch raises ValueError).
template <typename View>
void require_shape(const View& v, const char* name, std::initializer_list<int64_t> expected) {
  int d = 0;
  for (int64_t extent : expected) {
    if (v.shape[d] != extent)
      throw py::value_error(std::string(name) + ": dimension " + std::to_string(d) + " is " +
                            std::to_string(v.shape[d]) + ", expected " + std::to_string(extent));
    ++d;
  }
}

// A C-contiguous output buffer of exactly the given shape, or null.
template <typename T>
T* contiguous_output(std::optional<py::array>& a, const char* name,
                     std::initializer_list<int64_t> shape) {
  if (!a) return nullptr;
  check_array<T>(*a, name, static_cast<int>(shape.size()), true, true);
  if (!(a->flags() & py::array::c_style))
    throw py::value_error(std::string(name) + ": must be C-contiguous");
  int d = 0;
  for (int64_t extent : shape)
    if (a->shape(d++) != extent)
      throw py::value_error(std::string(name) + ": wrong shape " + shape_string(*a));
  return static_cast<T*>(a->mutable_data());
}

}  // namespace attnx::bindings
