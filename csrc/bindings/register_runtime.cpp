// Runtime configuration: kernel choice, threads, build facts.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "attnx/runtime.h"
#include "dispatch/balanced_shares.h"

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
  m.def(
      "trace_balanced_loop",
      [](int64_t n, int threads, int64_t microseconds, int slow_thread,
         int64_t slow_microseconds) {
        const auto check = [](const char* name, int64_t value, int64_t most) {
          if (value < 0 || value > most)
            throw py::value_error(std::string("trace_balanced_loop: ") + name +
                                  " must be in [0, " + std::to_string(most) + "], got " +
                                  std::to_string(value));
        };
        check("n", n, 1000000);
        check("threads", threads, 1024);
        if (threads < 1) throw py::value_error("trace_balanced_loop: threads must be >= 1, got 0");
        check("microseconds", microseconds, 100000);
        check("slow_microseconds", slow_microseconds, 100000);
        std::vector<int32_t> runs, ran_on;
        {
          py::gil_scoped_release release;
          runs = trace_balanced_loop(n, threads, microseconds, slow_thread, slow_microseconds,
                                     ran_on);
        }
        return py::make_tuple(runs, ran_on);
      },
      py::arg("n"), py::arg("threads"), py::arg("microseconds") = 0, py::arg("slow_thread") = -1,
      py::arg("slow_microseconds") = 0,
      "For the tests: a balanced parallel loop of n iterations on `threads` threads, each "
      "sleeping `microseconds` (`slow_microseconds` on thread `slow_thread`). Returns (runs, "
      "ran_on): how many times each iteration ran, and the thread that ran it.");
  m.def("compiler", &compiler_name);
  m.attr("__version__") = ATTNX_VERSION;
}

}  // namespace attnx::bindings
