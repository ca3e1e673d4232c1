// Test hooks of the bfloat16 products (attnx._core._testing): every table's
// gemm, rounding and packing of pairs on NumPy arrays, any table this CPU
// runs chosen by name, so that one process can compare them; and the active
// float32 gemm, to measure the two against each other.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>

#include "attnx/runtime.h"
#include "bindings/array_views.h"
#include "kernels/bf16_table.h"
#include "kernels/kernel_table.h"

namespace py = pybind11;

namespace attnx::bindings {
namespace {

// The table named `table`: None, the active one; "native" (vdpbf16ps),
// "avx512", "avx2" or "scalar", that instruction set's emulation.
const Bf16KernelTable& bf16_table(const std::optional<std::string>& table, const char* fn) {
  if (!table) return active_bf16_kernels();
  Isa level;
  if (*table == "native")
    level = Isa::kAvx512Bf16;
  else if (*table == "avx512")
    level = Isa::kAvx512;
  else if (*table == "avx2")
    level = Isa::kAvx2;
  else if (*table == "scalar")
    level = Isa::kScalar;
  else
    throw py::value_error(std::string(fn) + ": table must be None, 'native', 'avx512', 'avx2' " +
                          "or 'scalar', got '" + *table + "'");
  const Bf16KernelTable* found = bf16_kernels_of(level);
  if (found == nullptr)
    throw py::value_error(std::string(fn) + ": table '" + *table + "' is not in this build");
  // CPUID once: in a virtual machine each query traps to the host (microseconds).
  static const Isa cpu = detect_cpu_isa();
  if (level > cpu)
    throw py::value_error(std::string(fn) + ": table '" + *table + "' needs " +
                          isa_name(level) + ", which this CPU lacks");
  return *found;
}

GemmInit parse_init(const std::string& name, const char* fn) {
  if (name == "zero") return GemmInit::kZero;
  if (name == "accumulate") return GemmInit::kAccumulate;
  if (name == "scale_rows") return GemmInit::kScaleRows;
  if (name == "bias_columns") return GemmInit::kBiasColumns;
  if (name == "bias_rows") return GemmInit::kBiasRows;
  if (name == "add_sum") return GemmInit::kAddSum;
  throw py::value_error(std::string(fn) + ": init must be 'zero', 'accumulate', 'scale_rows', "
                        "'bias_columns', 'bias_rows' or 'add_sum', got '" + name + "'");
}

// Strides of a 2-D array in elements, none negative (the kernels take them
// as they are: a negative one would need an offset start).
template <typename T>
void check_strides(const py::array& x, const std::string& name) {
  for (int d = 0; d < 2; ++d)
    if (view_stride<T>(x, d) < 0)
      throw py::value_error(name + ": negative strides are not supported");
}

int checked_repeat(int64_t repeat, const char* fn) {
  if (repeat < 1 || repeat > 1000000)
    throw py::value_error(std::string(fn) + ": repeat must be in [1, 1000000], got " +
                          std::to_string(repeat));
  return static_cast<int>(repeat);
}

// C = init + A.B, `repeat` times, by `gemm` on elements E of A and B (a
// bfloat16 pair, or float): a (M, K) with any non-negative strides, b (K, N)
// and c (M, N) with contiguous rows; init_values 1-D, M or N float32 values
// where init needs them.
template <typename E, typename Gemm>
void run_gemm(const char* fn, Gemm gemm, const py::array& a, const py::array& b, py::array& c,
              const std::string& init_name, const OptArray& init_values, int64_t repeat) {
  const GemmInit init = parse_init(init_name, fn);
  const std::string f = fn;
  check_array<E>(a, (f + ": a").c_str(), 2, false, false);
  check_strides<E>(a, f + ": a");
  check_array<E>(b, (f + ": b").c_str(), 2, true, false);
  check_strides<E>(b, f + ": b");
  check_array<float>(c, (f + ": c").c_str(), 2, true, true);
  check_strides<float>(c, f + ": c");
  const int64_t M = a.shape(0), K = a.shape(1), N = b.shape(1);
  if (b.shape(0) != K || c.shape(0) != M || c.shape(1) != N)
    throw py::value_error(f + ": shapes do not match: a " + shape_string(a) + ", b " +
                          shape_string(b) + ", c " + shape_string(c) +
                          " (need a (M, K), b (K, N), c (M, N))");
  const float* values = nullptr;
  int64_t want = 0;
  if (init == GemmInit::kScaleRows || init == GemmInit::kBiasRows) want = M;
  if (init == GemmInit::kBiasColumns) want = N;
  if (want > 0 || init_values) {
    if (!init_values)
      throw py::value_error(f + ": init '" + init_name + "' needs init_values");
    check_array<float>(*init_values, (f + ": init_values").c_str(), 1, true, false);
    if (init_values->shape(0) != want)
      throw py::value_error(f + ": init_values must have " + std::to_string(want) +
                            " values for init '" + init_name + "', got shape " +
                            shape_string(*init_values));
    values = static_cast<const float*>(init_values->data());
  }
  const int times = checked_repeat(repeat, fn);
  const auto* pa = static_cast<const E*>(a.data());
  const auto* pb = static_cast<const E*>(b.data());
  auto* pc = static_cast<float*>(c.mutable_data());
  const int64_t a_row = view_stride<E>(a, 0), a_col = view_stride<E>(a, 1);
  const int64_t ldb = view_stride<E>(b, 0), ldc = view_stride<float>(c, 0);
  // The kernel touches no Python object; the arrays stay alive.
  py::gil_scoped_release release;
  for (int i = 0; i < times; ++i)
    gemm(M, N, K, pa, a_row, a_col, pb, ldb, pc, ldc, init, values);
}

}  // namespace

void register_testing_bf16(py::module_& testing) {
  testing.def(
      "bf16_gemm",
      [](const py::array& a, const py::array& b, py::array& c, const std::string& init,
         const OptArray& init_values, const std::optional<std::string>& table, int64_t repeat) {
        const Bf16KernelTable& t = bf16_table(table, "bf16_gemm");
        run_gemm<uint32_t>("bf16_gemm", t.gemm, a, b, c, init, init_values, repeat);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("init"), py::arg("init_values") = py::none(),
      py::arg("table") = py::none(), py::arg("repeat") = 1,
      "c = init + A.B in place, by a bfloat16 table's gemm: a (M, K2) and b (K2, N) uint32\n"
      "pairs (a in any layout: a.T of a (K2, M) array is the column-major case), c (M, N)\n"
      "float32; init 'zero', 'accumulate', 'scale_rows', 'bias_columns', 'bias_rows' or\n"
      "'add_sum' (init_values: M or N float32); table None (active), 'native', 'avx512',\n"
      "'avx2' or 'scalar'; run `repeat` times.");
  testing.def(
      "gemm_f32",
      [](const py::array& a, const py::array& b, py::array& c, const std::string& init,
         const OptArray& init_values, bool wide, int64_t repeat) {
        const KernelTable<float>& t = active_kernels(float{});
        run_gemm<float>("gemm_f32", wide ? t.gemm_wide : t.gemm, a, b, c, init, init_values,
                        repeat);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("init"), py::arg("init_values") = py::none(),
      py::arg("wide") = false, py::arg("repeat") = 1,
      "bf16_gemm's float32 counterpart: the active float32 table's gemm (gemm_wide with wide).");
  testing.def(
      "bf16_round",
      [](const py::array& x, const std::optional<std::string>& table) {
        const Bf16KernelTable& t = bf16_table(table, "bf16_round");
        check_array<float>(x, "bf16_round: x", 1, true, false);
        const int64_t n = x.shape(0);
        py::array_t<uint16_t> bits(n);
        py::array_t<float> values(n);
        const auto* src = static_cast<const float*>(x.data());
        uint16_t* dst = bits.mutable_data();
        float* rounded = values.mutable_data();
        {
          // The kernels touch no Python object; the arrays stay alive.
          py::gil_scoped_release release;
          t.round(src, n, dst);
          for (int64_t i = 0; i < n; ++i) rounded[i] = src[i];
          t.round_in_place(rounded, n);
        }
        return py::make_tuple(bits, values);
      },
      py::arg("x"), py::arg("table") = py::none(),
      "(bits, values): a 1-D contiguous float32 array rounded to bfloat16 by a table's round\n"
      "(uint16 bits) and round_in_place (float32 values, on a copy).");
  testing.def(
      "bf16_pack_pairs",
      [](const py::array& x, float scale, const std::optional<std::string>& table) {
        const Bf16KernelTable& t = bf16_table(table, "bf16_pack_pairs");
        check_array<float>(x, "bf16_pack_pairs: x", 2, false, false);
        check_strides<float>(x, "bf16_pack_pairs: x");
        const int64_t K = x.shape(0), N = x.shape(1), pairs = (K + 1) / 2;
        py::array_t<uint32_t> out({pairs, N});
        const auto* src = static_cast<const float*>(x.data());
        const int64_t ld_k = view_stride<float>(x, 0), ld_n = view_stride<float>(x, 1);
        uint32_t* dst = out.mutable_data();
        {
          // The kernel touches no Python object; the arrays stay alive.
          py::gil_scoped_release release;
          t.pack_pairs(src, ld_k, ld_n, K, N, scale, dst, N);
        }
        return out;
      },
      py::arg("x"), py::arg("scale") = 1.0f, py::arg("table") = py::none(),
      "((K + 1) // 2, N) uint32 pairs of the (K, N) float32 array x (any non-negative strides:\n"
      "x.T of a row-major array is the transposing pack), scaled by `scale` and rounded.");
}

}  // namespace attnx::bindings
