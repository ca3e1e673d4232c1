// Bindings of multi-head attention and of its linear layers. Each converts
// its arrays to views, checks that the shapes agree, and runs the core with
// the GIL released.
//
// Releasing the GIL is safe: the core touches no Python object, and the
// py::array arguments keep every buffer alive until the call returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/projection.h"
#include "attnx/attention.h"
#include "bindings/array_views.h"

namespace attnx::bindings {

// Messages are put together with std::to_string, not iostreams: a build that
// links libstdc++ statically (LDFLAGS=-static-libstdc++) next to the shared
// libstdc++ that other extensions load crashed inside ostream's number
// formatting, on the error path alone.
std::string shape_string(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) s += (d ? ", " : "") + std::to_string(a.shape(d));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

namespace {

using OptArray = std::optional<py::array>;

// out = x . w^T + b.
template <typename T>
void linear_typed(const py::array& x, const py::array& w, const OptArray& b, py::array& out) {
  StridedView<const T, 3> x3;
  const StridedView<const T, 2> x2 = const_view<T, 2>(x, "x");
  x3.data = x2.data;
  x3.shape[0] = 1, x3.shape[1] = x2.shape[0], x3.shape[2] = x2.shape[1];
  x3.stride[0] = 0, x3.stride[1] = x2.stride[0], x3.stride[2] = 1;
  const RowMajorView<const T> wv = matrix_view<T>(w, "w");
  if (wv.cols != x2.shape[1])
    throw py::value_error("w: shape " + shape_string(w) + " does not match x " + shape_string(x));
  const T* bias = vector_data<T>(b, "b", wv.rows);
  const StridedView<T, 2> o2 = mutable_view<T, 2>(out, "out");
  if (o2.shape[0] != x2.shape[0] || o2.shape[1] != wv.rows)
    throw py::value_error("out: shape " + shape_string(out) + ", expected (" +
                          std::to_string(x2.shape[0]) + ", " + std::to_string(wv.rows) + ")");
  StridedView<T, 3> o3;
  o3.data = o2.data;
  o3.shape[0] = 1, o3.shape[1] = o2.shape[0], o3.shape[2] = o2.shape[1];
  o3.stride[0] = 0, o3.stride[1] = o2.stride[0], o3.stride[2] = 1;
  if (x2.shape[0] == 0 || wv.rows == 0) return;
  py::gil_scoped_release release;
  linear_forward(x3, wv, bias, o3);
}

template <typename T>
void mha_typed(int64_t num_heads, const py::array& query, const py::array& key,
               const py::array& value, const py::array& w_q, const py::array& w_k,
               const py::array& w_v, const OptArray& b_q, const OptArray& b_k, const OptArray& b_v,
               const OptArray& bias_k, const OptArray& bias_v, bool add_zero_attn,
               const OptArray& static_k, const OptArray& static_v, const OptArray& attn_mask,
               const OptArray& key_padding_mask, bool causal, const py::array& w_out,
               const OptArray& b_out, py::array& out, OptArray& weights, bool average_weights,
               bool bottom_right) {
  MhaArgs<T> a;
  a.query = const_view<T, 3>(query, "query");
  a.key = const_view<T, 3>(key, "key");
  a.value = const_view<T, 3>(value, "value");
  const int64_t N = a.query.shape[0], L = a.query.shape[1], E = a.query.shape[2];
  const int64_t S = a.key.shape[1];
  if (num_heads < 1 || E % num_heads != 0)
    throw py::value_error("embed_dim (" + std::to_string(E) + ") must be divisible by num_heads (" +
                          std::to_string(num_heads) + ")");
  const int64_t H = num_heads, hd = E / H;
  a.num_heads = H;
  require_shape(a.key, "key", {N, S});
  require_shape(a.value, "value", {N, S});
  a.w_q = matrix_view<T>(w_q, "q_proj_weight");
  a.w_k = matrix_view<T>(w_k, "k_proj_weight");
  a.w_v = matrix_view<T>(w_v, "v_proj_weight");
  a.w_out = matrix_view<T>(w_out, "out_proj_weight");
  if (a.w_q.rows != E || a.w_q.cols != E) throw py::value_error("q_proj_weight: wrong shape");
  if (a.w_k.rows != E || a.w_k.cols != a.key.shape[2])
    throw py::value_error("k_proj_weight: wrong shape");
  if (a.w_v.rows != E || a.w_v.cols != a.value.shape[2])
    throw py::value_error("v_proj_weight: wrong shape");
  if (a.w_out.cols != E) throw py::value_error("out_proj_weight: wrong shape");
  a.b_q = vector_data<T>(b_q, "q bias", E);
  a.b_k = vector_data<T>(b_k, "k bias", E);
  a.b_v = vector_data<T>(b_v, "v bias", E);
  a.b_out = vector_data<T>(b_out, "out_proj_bias", a.w_out.rows);  // E_out
  a.bias_k = vector_data<T>(bias_k, "bias_k", E);
  a.bias_v = vector_data<T>(bias_v, "bias_v", E);
  if (bool(a.bias_k) != bool(a.bias_v))
    throw py::value_error("bias_k and bias_v must be given together");
  a.add_zero_attn = add_zero_attn;
  a.static_k = optional_view<T, 4>(static_k, "static_k");
  a.static_v = optional_view<T, 4>(static_v, "static_v");
  if (a.static_k.present()) require_shape(a.static_k, "static_k", {N, H, a.static_k.shape[2], hd});
  if (a.static_v.present()) require_shape(a.static_v, "static_v", {N, H, a.static_v.shape[2], hd});
  if (a.static_k.present() && a.bias_k) throw py::value_error("bias_k cannot be added to static_k");
  if (a.static_v.present() && a.bias_v) throw py::value_error("bias_v cannot be added to static_v");
  const int64_t S_k = a.static_k.present() ? a.static_k.shape[2] : S;
  const int64_t S_v = a.static_v.present() ? a.static_v.shape[2] : S;
  if (S_k != S_v) throw py::value_error("keys and values have different lengths");
  a.masks[0] = optional_view<T, 4>(attn_mask, "attn_mask", false);
  a.masks[1] = optional_view<T, 4>(key_padding_mask, "key_padding_mask", false);
  for (const auto& mask : a.masks)
    if (mask.present()) require_shape(mask, "mask", {N, H, L, S_k});
  a.causal = causal;
  a.bottom_right = bottom_right;
  a.out = mutable_view<T, 3>(out, "out");
  require_shape(a.out, "out", {N, L, a.w_out.rows});
  const int64_t Sp = S_k + (a.bias_k ? 1 : 0) + (add_zero_attn ? 1 : 0);
  a.average_weights = average_weights;
  if (average_weights)
    a.weights = contiguous_output<T>(weights, "weights", {N, L, Sp});
  else
    a.weights = contiguous_output<T>(weights, "weights", {N, H, L, Sp});
  py::gil_scoped_release release;
  mha_forward(a);
}

// Equal, not identical: an unpickled array has an equal but distinct dtype object.
bool is_dtype(const py::array& a, const py::dtype& dt) { return a.dtype().equal(dt); }

}  // namespace

void register_attention(py::module_& m) {
  m.def(
      "linear",
      [](const py::array& x, const py::array& w, const OptArray& b, py::array& out) {
        if (is_dtype(x, py::dtype::of<float>()))
          linear_typed<float>(x, w, b, out);
        else if (is_dtype(x, py::dtype::of<double>()))
          linear_typed<double>(x, w, b, out);
        else
          throw py::type_error("x: expected float32 or float64");
      },
      py::arg("x"), py::arg("w"), py::arg("b"), py::arg("out"),
      "out = x . w^T + b for x (N, K), w (M, K), b (M,) or None, out (N, M).");
  m.def(
      "mha",
      [](int64_t num_heads, const py::array& query, const py::array& key, const py::array& value,
         const py::array& w_q, const py::array& w_k, const py::array& w_v, const OptArray& b_q,
         const OptArray& b_k, const OptArray& b_v, const OptArray& bias_k,
         const OptArray& bias_v, bool add_zero_attn, const OptArray& static_k,
         const OptArray& static_v, const OptArray& attn_mask, const OptArray& key_padding_mask,
         bool causal, const py::array& w_out, const OptArray& b_out, py::array& out,
         OptArray weights, bool average_weights, bool bottom_right) {
        if (is_dtype(query, py::dtype::of<float>()))
          mha_typed<float>(num_heads, query, key, value, w_q, w_k, w_v, b_q, b_k, b_v, bias_k,
                           bias_v, add_zero_attn, static_k, static_v, attn_mask,
                           key_padding_mask, causal, w_out, b_out, out, weights, average_weights,
                           bottom_right);
        else if (is_dtype(query, py::dtype::of<double>()))
          mha_typed<double>(num_heads, query, key, value, w_q, w_k, w_v, b_q, b_k, b_v, bias_k,
                            bias_v, add_zero_attn, static_k, static_v, attn_mask,
                            key_padding_mask, causal, w_out, b_out, out, weights,
                            average_weights, bottom_right);
        else
          throw py::type_error("query: expected float32 or float64");
      },
      py::arg("num_heads"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("w_q"),
      py::arg("w_k"), py::arg("w_v"), py::arg("b_q"), py::arg("b_k"), py::arg("b_v"),
      py::arg("bias_k"), py::arg("bias_v"), py::arg("add_zero_attn"), py::arg("static_k"),
      py::arg("static_v"), py::arg("attn_mask"), py::arg("key_padding_mask"), py::arg("causal"),
      py::arg("w_out"), py::arg("b_out"), py::arg("out"), py::arg("weights"),
      py::arg("average_weights"), py::arg("bottom_right") = false,
      "Multi-head attention forward on canonical (N, L, E) views.");
}

}  // namespace attnx::bindings
