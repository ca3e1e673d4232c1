// Test hook of the narrowing of float32 / float64 values to float16 / bfloat16 storage
// (attnx._core._testing).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "attention/narrowing.h"
#include "bindings/array_views.h"

namespace py = pybind11;

namespace attnx::bindings {
namespace {

template <typename T>
void narrow(const T* src, int64_t n, bool bfloat16, uint16_t* dst) {
  if (bfloat16)
    narrow_to_bfloat16(src, n, dst);
  else
    narrow_to_float16(src, n, dst);
}

// The 16-bit bits of src's values, narrowed by the core. src: a 1-D contiguous float32 or
// float64 array (native byte order, aligned), read in place. format: "float16" or "bfloat16".
py::array_t<uint16_t> narrow_16bit(const py::array& src, const std::string& format) {
  bool bfloat16 = false;
  if (format == "bfloat16")
    bfloat16 = true;
  else if (format != "float16")
    throw py::value_error("narrow_16bit: format must be 'float16' or 'bfloat16', got '" +
                          format + "'");
  const bool is_double = src.dtype().equal(py::dtype::of<double>());
  if (is_double)
    check_array<double>(src, "narrow_16bit: src", 1, true, false);
  else
    check_array<float>(src, "narrow_16bit: src", 1, true, false);

  const int64_t n = src.shape(0);
  py::array_t<uint16_t> out(n);
  const void* data = src.data();
  uint16_t* dst = out.mutable_data();
  {
    // The conversion touches no Python object; src and out stay alive.
    py::gil_scoped_release release;
    if (is_double)
      narrow(static_cast<const double*>(data), n, bfloat16, dst);
    else
      narrow(static_cast<const float*>(data), n, bfloat16, dst);
  }
  return out;
}

}  // namespace

void register_testing_narrowing(py::module_& testing) {
  testing.def("narrow_16bit", &narrow_16bit, py::arg("src"), py::arg("format"),
              "uint16 bits of a 1-D contiguous float32 or float64 array narrowed to float16 or "
              "bfloat16 by the core, as NumPy (ml_dtypes for bfloat16) assigns them.");
}

}  // namespace attnx::bindings
