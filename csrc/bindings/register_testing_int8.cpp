// Test hooks of the int8 products (attnx._core._testing): every table's
// scores and P.V on NumPy arrays, any table this CPU runs chosen by name, so
// that one process can compare them bit for bit.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnx/runtime.h"
#include "bindings/array_views.h"
#include "kernels/int8_table.h"

namespace py = pybind11;

namespace attnx::bindings {
namespace {

// The table named `table`: None, the active one; "vnni" (vpdpbusd), "avx2"
// or "scalar" (those instruction sets' float32 kernels). ValueError naming
// the choices, or saying why this process cannot run it.
const Int8KernelTable& int8_table(const std::optional<std::string>& table, const char* fn) {
  if (!table) return active_int8_kernels();
  const Int8KernelTable* found = nullptr;
  std::string needs;
  if (*table == "vnni") {
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)
    if (cpu_has_avx512_vnni()) found = &avx512_vnni_int8_kernels();
#endif
    needs = "AVX512_VNNI and a build with it";
  } else if (*table == "avx2") {
    // CPUID once: in a virtual machine each query traps to the host (microseconds).
    static const Isa cpu = detect_cpu_isa();
    if (cpu >= Isa::kAvx2) found = int8_kernels_of(Isa::kAvx2);
    if (found && found->isa != Isa::kAvx2) found = nullptr;
    needs = "AVX2 and a build with the x86 kernels";
  } else if (*table == "scalar") {
    found = &scalar_int8_kernels();
  } else {
    throw py::value_error(std::string(fn) + ": table must be None, 'vnni', 'avx2' or 'scalar', got '" +
                          *table + "'");
  }
  if (found == nullptr)
    throw py::value_error(std::string(fn) + ": table '" + *table + "' needs " + needs);
  return *found;
}

// Row pointers of a C-contiguous 2-D array.
template <typename E>
std::vector<const E*> rows_of(const py::array& x) {
  std::vector<const E*> rows(size_t(x.shape(0)));
  for (py::ssize_t i = 0; i < x.shape(0); ++i)
    rows[size_t(i)] = static_cast<const E*>(x.data()) + i * x.shape(1);
  return rows;
}

void check_2d(const py::array& x, const std::string& name, bool is_int8) {
  const bool dtype_ok = is_int8 ? py::isinstance<py::array_t<int8_t>>(x)
                                 : py::isinstance<py::array_t<float>>(x);
  if (!dtype_ok || x.ndim() != 2 || !(x.flags() & py::array::c_style))
    throw py::value_error(name + " must be a C-contiguous 2-D " + (is_int8 ? "int8" : "float32") +
                          " array");
}

void check_1d(const py::array& x, const std::string& name, py::ssize_t n) {
  if (!py::isinstance<py::array_t<float>>(x) || x.ndim() != 1 || x.shape(0) != n ||
      !(x.flags() & py::array::c_style))
    throw py::value_error(name + " must be a contiguous float32 array of " + std::to_string(n) +
                          " values");
}

}  // namespace

void register_testing_int8(py::module_& testing) {
  testing.def(
      "int8_scores",
      [](const py::array& q, const py::array& q_scales, const py::array& k,
         const py::array& k_scales, const std::optional<std::string>& table) {
        const Int8KernelTable& t = int8_table(table, "int8_scores");
        check_2d(q, "int8_scores: q", true);
        check_2d(k, "int8_scores: k", true);
        if (q.shape(1) != k.shape(1) || q.shape(0) > 32)
          throw py::value_error("int8_scores: q (rows <= 32, dim) and k (keys, dim) must share dim");
        check_1d(q_scales, "int8_scores: q_scales", q.shape(0));
        check_1d(k_scales, "int8_scores: k_scales", k.shape(0));
        const int rows = static_cast<int>(q.shape(0));
        const int64_t n = k.shape(0), dim = q.shape(1);
        py::array_t<float> out({py::ssize_t(rows), py::ssize_t(n)});
        const auto qr = rows_of<int8_t>(q), kr = rows_of<int8_t>(k);
        std::vector<float*> dst(static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r) dst[size_t(r)] = out.mutable_data(r, 0);
        t.scores(qr.data(), static_cast<const float*>(q_scales.data()), rows, kr.data(),
                 static_cast<const float*>(k_scales.data()), n, n, dim, dst.data());
        return out;
      },
      py::arg("q"), py::arg("q_scales"), py::arg("k"), py::arg("k_scales"),
      py::arg("table") = py::none(),
      "An int8 table's scores: (rows, keys) float32 from int8 q (rows, dim) and k (keys,\n"
      "dim) with their float32 scales; table None (active), 'vnni', 'avx2' or 'scalar'.");
  testing.def(
      "int8_accumulate_pv",
      [](const py::array& p, const py::array& v, const py::array& v_scales, py::array& acc,
         const std::optional<std::string>& table) {
        const Int8KernelTable& t = int8_table(table, "int8_accumulate_pv");
        check_2d(p, "int8_accumulate_pv: p", false);
        check_2d(v, "int8_accumulate_pv: v", true);
        check_2d(acc, "int8_accumulate_pv: acc", false);
        if (p.shape(1) != v.shape(0) || acc.shape(0) != p.shape(0) || acc.shape(1) != v.shape(1) ||
            p.shape(0) > 32 || v.shape(0) > kInt8MaxBlock)
          throw py::value_error("int8_accumulate_pv: p (rows <= 32, keys <= " +
                                std::to_string(kInt8MaxBlock) +
                                "), v (keys, dim), acc (rows, dim) do not match");
        check_1d(v_scales, "int8_accumulate_pv: v_scales", v.shape(0));
        const int rows = static_cast<int>(p.shape(0));
        const int64_t n = v.shape(0), dim = v.shape(1);
        const auto pr = rows_of<float>(p);
        const auto vr = rows_of<int8_t>(v);
        std::vector<float*> out(static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r)
          out[size_t(r)] = static_cast<float*>(acc.mutable_data()) + r * dim;
        t.accumulate_pv(pr.data(), rows, vr.data(), static_cast<const float*>(v_scales.data()), n,
                        n, dim, out.data());
      },
      py::arg("p"), py::arg("v"), py::arg("v_scales"), py::arg("acc"),
      py::arg("table") = py::none(),
      "acc += an int8 table's P.V in place: p (rows, keys) float32, int8 v (keys, dim) with its\n"
      "float32 scales, acc (rows, dim) float32; table as int8_scores'.");
}

}  // namespace attnx::bindings
