// The precision option of the compute bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "attnx/precision.h"

namespace attnx::bindings {

namespace py = pybind11;

// The precision of a call's products from the options' integer (0 native,
// 1 bfloat16, 2 int8 where `int8` allows it: attention, whose driver checks
// that its keys and values are int8), which Python has checked: ValueError
// naming the options otherwise, and for bfloat16 or int8 products in a
// float64 call.
inline Precision checked_precision(int precision, bool compute_is_double, bool int8 = false) {
  if (precision == 0) return Precision::kNative;
  if (precision != 1 && !(int8 && precision == 2))
    throw py::value_error(std::string("precision: expected 0 (native), 1 (bfloat16)") +
                          (int8 ? " or 2 (int8)" : "") + ", got " + std::to_string(precision));
  if (compute_is_double)
    throw py::value_error(std::string("precision '") + (precision == 1 ? "bfloat16" : "int8") +
                          "' computes in float32: give float32 inputs and parameters, or leave "
                          "precision at its default for float64");
  return precision == 1 ? Precision::kBFloat16 : Precision::kInt8;
}

}  // namespace attnx::bindings
