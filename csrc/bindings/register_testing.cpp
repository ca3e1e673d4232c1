// attnx._core._testing: hooks into the core that only attnx's tests use (the
// Python module attnx._testing re-exports them). They check the core's parts
// one by one and are no API: they may change with any release.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/array_views.h"
#include "dispatch/balanced_shares.h"
#include "dispatch/core_waits.h"
#include "kernels/kernel_table.h"

namespace attnx::bindings {

namespace {

// The active float table's widening of 16-bit storage, run on a NumPy array,
// so that the tests can check every bit pattern under every kernel. src: a
// 1-D uint16 array of any layout, read in place where it is native, aligned
// and contiguous (so the kernel sees the caller's start address, aligned to a
// vector or not), else copied. format: "float16" or "bfloat16".
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

// The active table's activation of transformer layers on a copy of a 2-D
// float32 or float64 array, kind "relu" or "gelu".
template <typename T>
py::array_t<T> activate_typed(const py::array& x, Activation kind) {
  py::array_t<T, py::array::c_style | py::array::forcecast> src(x);
  if (src.ndim() != 2) throw py::value_error("activate: x must be 2-D, got " + shape_string(src));
  py::array_t<T> out({src.shape(0), src.shape(1)});
  std::copy_n(src.data(), src.size(), out.mutable_data());
  active_kernels(T()).activate(out.mutable_data(), src.shape(0), src.shape(1), src.shape(1), kind);
  return out;
}

}  // namespace

void register_testing(py::module_& testing) {
  testing.def(
      "activate",
      [](const py::array& x, const std::string& kind) -> py::array {
        Activation a;
        if (kind == "relu")
          a = Activation::kRelu;
        else if (kind == "gelu")
          a = Activation::kGelu;
        else
          throw py::value_error("activate: kind must be 'relu' or 'gelu', got '" + kind + "'");
        if (is_dtype(x, py::dtype::of<double>())) return activate_typed<double>(x, a);
        if (is_dtype(x, py::dtype::of<float>())) return activate_typed<float>(x, a);
        throw py::type_error("activate: x must be float32 or float64");
      },
      py::arg("x"), py::arg("kind"),
      "A copy of the 2-D float32 or float64 array x through the active kernel's activation\n"
      "of transformer layers, kind 'relu' or 'gelu'.");
  testing.def("widen_16bit", &widen_16bit, py::arg("src"), py::arg("format"),
              "float32 copy of a 1-D uint16 array of float16 or bfloat16 bits, widened by the "
              "active kernel.");
  testing.def(
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
      "A balanced parallel loop of n iterations on `threads` threads, each sleeping "
      "`microseconds` (`slow_microseconds` on thread `slow_thread`). Returns (runs, ran_on): "
      "how many times each iteration ran, and the thread that ran it.");
  testing.def(
      "core_sharing",
      [](const std::vector<std::pair<double, double>>& rounds) {
        CoreSharing sharing;
        const CoreSharing::Clock::time_point start{};
        std::vector<bool> shared;
        for (const auto& [waited_us, at_ms] : rounds) {
          if (!(waited_us >= 0 && waited_us < 1e12 && at_ms >= 0 && at_ms < 1e9))
            throw py::value_error("core_sharing: each round is (waited_us >= 0, at_ms >= 0)");
          const auto at = std::chrono::duration_cast<CoreSharing::Clock::duration>(
              std::chrono::duration<double, std::milli>(at_ms));
          shared.push_back(sharing.add_round(uint64_t(waited_us * 1000), start + at));
        }
        return shared;
      },
      py::arg("rounds"),
      "A worker's judgement of whether its core is shared, after each of `rounds`: "
      "(microseconds waited for the core in that round, milliseconds since the first).");
  testing.def(
      "core_wait_ns", [] { return CoreWaitClock().waited_ns(); },
      "Nanoseconds the calling thread has waited for a core (0 where the OS does not say).");
}

}  // namespace attnx::bindings
