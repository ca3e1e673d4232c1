// Private test bindings of the kernels' conversions: _core.widen_16bit runs
// the active float table's widening of 16-bit storage on a NumPy array, so
// the tests can check every bit pattern under every kernel.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "bindings/array_views.h"
#include "kernels/kernel_table.h"

namespace attnx::bindings {

namespace {

// src: a 1-D uint16 array of any layout, read in place where it is native,
// aligned and contiguous (so the kernel sees the caller's start address,
// aligned to a vector or not), else copied. format: "float16" or "bfloat16".
py::array_t<float> widen_16bit(py::array src, const std::string& format) {
  const KernelTable<float>& table = active_kernels(float{});
  void (*widen)(const uint16_t*, int64_t, float*) = nullptr;
  if (format == "float16")
    widen = table.widen_float16;
  else if (format == "bfloat16")
    widen = table.widen_bfloat16;
  else
    throw py::value_error("widen_16bit: format must be 'float16' or 'bfloat16', got '" + format +
                          "'");
  if (widen == nullptr)
    throw std::runtime_error(std::string("widen_16bit: kernel ") + table.name +
                             " has no widening");

  const py::dtype dtype = src.dtype();
  if (dtype.kind() != 'u' || dtype.itemsize() != 2)
    throw py::type_error("widen_16bit: src must have dtype uint16, got " +
                         std::string(py::str(dtype)));
  if (src.ndim() != 1)
    throw py::value_error("widen_16bit: src must be 1-D, got shape " + shape_string(src));

  const int64_t n = src.shape(0);
  const bool in_place = dtype.equal(py::dtype::of<uint16_t>()) &&
                        reinterpret_cast<std::uintptr_t>(src.data()) % alignof(uint16_t) == 0 &&
                        (n <= 1 || src.strides(0) == static_cast<py::ssize_t>(sizeof(uint16_t)));
  if (!in_place) {
    // NumPy's assignment handles the strides and byte order.
    py::array_t<uint16_t> copy(n);
    copy[py::ellipsis()] = src;
    src = copy;
  }
  py::array_t<float> out(n);
  const auto* data = static_cast<const uint16_t*>(src.data());
  float* dst = out.mutable_data();
  {
    // The conversion touches no Python object; src and out stay alive.
    py::gil_scoped_release release;
    widen(data, n, dst);
  }
  return out;
}

}  // namespace

void register_conversions(py::module_& m) {
  m.def("widen_16bit", &widen_16bit, py::arg("src"), py::arg("format"),
        "float32 copy of a 1-D uint16 array of float16 or bfloat16 bits, widened by the "
        "active kernel (private, for the tests).");
}

}  // namespace attnx::bindings
