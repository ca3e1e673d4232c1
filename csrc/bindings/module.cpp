// The private extension module attnx._core. It only creates the module; each
// area registers its functions from its own file.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "attnx/runtime.h"

namespace py = pybind11;

namespace attnx::bindings {
void register_mha(py::module_& m);
void register_mha_testing(py::module_& testing);
void register_paged(py::module_& m);
void register_runtime(py::module_& m);
void register_sdpa(py::module_& m);
void register_sdpa_testing(py::module_& testing);
void register_testing(py::module_& testing);
void register_testing_bf16(py::module_& testing);
void register_testing_int8(py::module_& testing);
void register_testing_narrowing(py::module_& testing);
void register_testing_planner(py::module_& testing);
void register_transformer(py::module_& m);
}  // namespace attnx::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnx C++ core (private: use the attnx package)";
  // The core chooses its kernel on first use; using it here makes a bad
  // ATTNX_ISA fail the import (an ImportError whose cause is the ValueError
  // saying why) rather than a later call.
  try {
    attnx::active_isa();
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    throw py::error_already_set();
  }
  attnx::bindings::register_mha(m);
  attnx::bindings::register_paged(m);
  attnx::bindings::register_runtime(m);
  attnx::bindings::register_sdpa(m);
  attnx::bindings::register_transformer(m);
  py::module_ testing = m.def_submodule(
      "_testing", "Hooks for attnx's own tests (private, no API; see attnx._testing).");
  attnx::bindings::register_testing(testing);
  attnx::bindings::register_testing_bf16(testing);
  attnx::bindings::register_testing_int8(testing);
  attnx::bindings::register_testing_narrowing(testing);
  attnx::bindings::register_sdpa_testing(testing);
  attnx::bindings::register_mha_testing(testing);
  attnx::bindings::register_testing_planner(testing);
}
