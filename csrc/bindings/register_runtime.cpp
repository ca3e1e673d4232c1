// Runtime configuration: kernel choice, threads, build facts.
#include <pybind11/pybind11.h>

#include <string>

#include "attnx/runtime.h"
#include "kernels/bf16_table.h"
#include "kernels/int8_table.h"

namespace py = pybind11;

namespace attnx::bindings {

void register_runtime(py::module_& m) {
  // The float kernels' instruction sets: "avx512" at the avx512_bf16 level,
  // whose float kernels those are (the bfloat16 products: precision_kernels).
  m.def("active_isa", [] { return std::string(isa_name(float_kernels_isa(active_isa()))); });
  m.def("cpu_isa", [] { return std::string(isa_name(float_kernels_isa(detect_cpu_isa()))); });
  m.def("compiled_isas", [] {
    py::list names;
    for (int isa = 0; isa <= static_cast<int>(float_kernels_isa(best_compiled_isa())); ++isa)
      names.append(isa_name(static_cast<Isa>(isa)));
    return names;
  }, "The float kernels this build has, lowest first.");
  m.def("precision_kernels", [] {
    const std::string floats = isa_name(float_kernels_isa(active_isa()));
    const Bf16KernelTable& bf16 = active_bf16_kernels();
    py::dict kernels;
    kernels["float32"] = floats;
    kernels["float64"] = floats;
    kernels["bfloat16"] = bf16_products() == Bf16Products::kFloat
                              ? floats + " (float32 products)"
                          : bf16.native ? std::string("avx512_bf16")
                                        : std::string(isa_name(bf16.isa)) + " (emulated)";
    const Int8KernelTable& int8 = active_int8_kernels();
    kernels["int8"] = int8.isa == Isa::kAvx512 ? std::string("avx512_vnni")
                      : int8.isa == Isa::kAvx2 ? std::string("avx2 (vpmaddubsw)")
                                               : std::string(isa_name(int8.isa)) + " (float32 products)";
    return kernels;
  }, "The kernels of each precision's products: the float kernels' instruction set, for "
     "bfloat16 'avx512_bf16' (vdpbf16ps), '<isa> (float32 products)' (float32 multiply-adds of "
     "the rounded operands) or '<isa> (emulated)' (vdpbf16ps's arithmetic, with "
     "ATTNX_BF16_PRODUCTS=pairs), and for int8 'avx512_vnni' (vpdpbusd), 'avx2 (vpmaddubsw)' or "
     "'scalar (float32 products)' (the same sums, exact in float32, on the scalar float kernels).");
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
