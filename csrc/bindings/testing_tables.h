// The tables of one kind (bfloat16 or int8 products) that a test hook runs,
// by name, so that one process can compare them.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "attnx/runtime.h"

namespace attnx::bindings {

namespace py = pybind11;

// The table named `name` among a kind's: `native` (the avx512_bf16 level's
// own), "avx512", "avx2" or "scalar"; `find(level)` gives it, or null where
// this build has none. ValueError naming the choices, or saying why this
// process cannot run it.
template <typename Table, typename Find>
const Table& testing_table(const std::string& name, const char* native, Find find,
                           const char* fn) {
  Isa level;
  if (name == native)
    level = Isa::kAvx512Bf16;
  else if (name == "avx512")
    level = Isa::kAvx512;
  else if (name == "avx2")
    level = Isa::kAvx2;
  else if (name == "scalar")
    level = Isa::kScalar;
  else
    throw py::value_error(std::string(fn) + ": table must be None, '" + native +
                          "', 'avx512', 'avx2' or 'scalar', got '" + name + "'");
  const Table* found = find(level);
  if (found == nullptr)
    throw py::value_error(std::string(fn) + ": table '" + name + "' is not in this build");
  // CPUID once: in a virtual machine each query traps to the host (microseconds).
  static const Isa cpu = detect_cpu_isa();
  if (level > cpu)
    throw py::value_error(std::string(fn) + ": table '" + name + "' needs " + isa_name(level) +
                          ", which this CPU lacks");
  return *found;
}

}  // namespace attnx::bindings
