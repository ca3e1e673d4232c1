// Runtime configuration: kernel choice, threads, build facts.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "attnx/runtime.h"

namespace py = pybind11;

namespace attnx::bindings {

void register_runtime(py::module_& m) {
  m.def(
      "select_isa",
      [](const std::string& requested) {
        try {
          select_isa(requested);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("requested"), "Choose the kernel ('' = the best this CPU supports).");
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); });
  m.def("cpu_isa", [] { return std::string(isa_name(detect_cpu_isa())); });
  m.def("get_num_threads", &get_num_threads);
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1)
          throw py::value_error("set_num_threads: n must be >= 1, got " + std::to_string(n));
        set_num_threads(n);
      },
      py::arg("n"));
  m.def("have_openmp", &have_openmp);
  m.def("compiler", &compiler_name);
  m.attr("__version__") = ATTNX_VERSION;
}

}  // namespace attnx::bindings
