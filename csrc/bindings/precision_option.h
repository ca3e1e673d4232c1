// The precision option of the compute bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "attnx/precision.h"

namespace attnx::bindings {

namespace py = pybind11;

// The precision of a call's products from the options' integer (0 native,
// 1 bfloat16), which Python has checked: ValueError naming the options
// otherwise, and for bfloat16 products in a float64 call.
inline Precision checked_precision(int precision, bool compute_is_double) {
  if (precision == 0) return Precision::kNative;
  if (precision != 1)
    throw py::value_error("precision: expected 0 (native) or 1 (bfloat16), got " +
                          std::to_string(precision));
  if (compute_is_double)
    throw py::value_error("precision 'bfloat16' computes in float32: give float32 inputs and "
                          "parameters, or leave precision at its default for float64");
  return Precision::kBFloat16;
}

}  // namespace attnx::bindings
