// Runtime configuration: kernel choice, threads, build facts.
#include <pybind11/pybind11.h>

#include <string>

#include "attnx/runtime.h"

namespace py = pybind11;

namespace attnx::bindings {

void register_runtime(py::module_& m) {
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); });
  m.def("cpu_isa", [] { return std::string(isa_name(detect_cpu_isa())); });
  m.def("compiled_isas", [] {
    py::list names;
    for (int isa = 0; isa <= static_cast<int>(best_compiled_isa()); ++isa)
      names.append(isa_name(static_cast<Isa>(isa)));
    return names;
  }, "The kernels this build has, lowest first.");
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
  m.def(
      "fma_peak",
      [](int threads, double seconds) {
        if (threads < 1 || threads > 1024)
          throw py::value_error("fma_peak: threads must be in [1, 1024], got " +
                                std::to_string(threads));
        if (!(seconds > 0 && seconds <= 60))
          throw py::value_error("fma_peak: seconds must be in (0, 60], got " +
                                std::to_string(seconds));
        py::gil_scoped_release release;
        return measure_fma_peak(threads, seconds);
      },
      py::arg("threads"), py::arg("seconds") = 0.25,
      "Float32 multiply-add GFLOP/s of the active kernel on `threads` threads (register-only "
      "chains, about `seconds` each): the arithmetic peak benchmarks compare against.");
  m.def("compiler", &compiler_name);
  m.attr("__version__") = ATTNX_VERSION;
}

}  // namespace attnx::bindings
