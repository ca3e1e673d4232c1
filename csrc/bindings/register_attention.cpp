// Bindings of the two attention entry points. Each converts its arrays to
// views, checks that the shapes agree, and runs the core with the GIL
// released.
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

template <typename View>
void require_shape(const View& v, const char* name, std::initializer_list<int64_t> expected) {
  int d = 0;
  for (int64_t extent : expected) {
    if (v.shape[d] != extent)
      throw py::value_error(std::string(name) + ": dimension " + std::to_string(d) + " is " +
                            std::to_string(v.shape[d]) + ", expected " + std::to_string(extent));
    ++d;
  }
}

// A mask broadcast to (lead..., H, L, S), any number of lead dims, as a
// (B, H, L, S) view: one lead dim is a plain stride; several get a table of
// batch offsets computed from the array's own strides, so a broadcast mask
// is read in place however its lead dims are laid out.
template <typename T>
StridedView<const T, 4> batched_mask_view(const py::array& mask, const char* name,
                                          std::vector<int64_t>& offsets) {
  check_array<T>(mask, name, static_cast<int>(mask.ndim()), false, false);
  const int lead = static_cast<int>(mask.ndim()) - 3;
  if (lead < 1) throw py::value_error(std::string(name) + ": expected at least 4 dimensions");
  StridedView<const T, 4> v;
  v.data = static_cast<const T*>(mask.data());
  for (int d = 0; d < 3; ++d) {
    v.shape[1 + d] = mask.shape(lead + d);
    v.stride[1 + d] = mask.strides(lead + d) / static_cast<py::ssize_t>(sizeof(T));
  }
  v.shape[0] = 1;
  for (int d = 0; d < lead; ++d) v.shape[0] *= mask.shape(d);
  if (lead == 1) {
    v.stride[0] = mask.strides(0) / static_cast<py::ssize_t>(sizeof(T));
    return v;
  }
  offsets.assign(size_t(v.shape[0]), 0);
  // Row-major over the lead dims: offset(b) = sum_d index_d(b) * stride_d.
  for (int64_t b = 0; b < v.shape[0]; ++b) {
    int64_t rest = b, offset = 0;
    for (int d = lead - 1; d >= 0; --d) {
      offset += (rest % mask.shape(d)) * (mask.strides(d) / static_cast<py::ssize_t>(sizeof(T)));
      rest /= mask.shape(d);
    }
    offsets[size_t(b)] = offset;
  }
  v.batch_offsets = offsets.data();
  return v;
}

// Keys or values: an array of T, or, for a float32 call, of float16 or
// bfloat16 (read in place and widened as they are loaded).
template <typename T>
StoredView<T> stored_view(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  if constexpr (std::is_same_v<T, float>) {
    const bool float16 = dt.kind() == 'f' && dt.itemsize() == 2;
    // ml_dtypes' bfloat16 is a 2-byte type of its own, known by its name.
    const bool bfloat16 = dt.itemsize() == 2 && std::string(py::str(dt)) == "bfloat16";
    if ((float16 || bfloat16) && dt.attr("isnative").template cast<bool>()) {
      check_layout(a, name, 4, true, false, 2);
      StoredView<T> v;
      v.storage = float16 ? Storage::kFloat16 : Storage::kBFloat16;
      v.bits.data = static_cast<const uint16_t*>(a.data());
      for (int d = 0; d < 4; ++d) {
        v.bits.shape[d] = a.shape(d);
        v.bits.stride[d] = a.shape(d) > 1 ? a.strides(d) / 2 : 0;
      }
      return v;
    }
  }
  return StoredView<T>::of(const_view<T, 4>(a, name));
}

// Per-batch lengths: a C-contiguous int64 vector of B values in [0, limit].
const int64_t* lengths_data(const OptArray& a, const char* name, int64_t B, int64_t limit) {
  if (!a) return nullptr;
  const int64_t* data = vector_data<int64_t>(a, name, B);
  for (int64_t b = 0; b < B; ++b)
    if (data[b] < 0 || data[b] > limit)
      throw py::value_error(std::string(name) + ": " + std::to_string(data[b]) + " at index " +
                            std::to_string(b) + " is outside [0, " + std::to_string(limit) + "]");
  return data;
}

// A window extent: < 0 unbounded; extents past `limit` mean the same as it.
int64_t window_extent(int64_t w, int64_t limit) { return w < 0 ? -1 : std::min(w, limit); }

template <typename T>
void sdpa_typed(const py::array& query, const py::array& key, const py::array& value,
                const OptArray& attn_mask, bool causal, double scale, py::array& out,
                OptArray& weights, bool bottom_right, int64_t window_left, int64_t window_right,
                const OptArray& key_lengths, const OptArray& query_lengths) {
  SdpaArgs<T> a;
  a.query = const_view<T, 4>(query, "query");
  a.key = stored_view<T>(key, "key");
  a.value = stored_view<T>(value, "value");
  const int64_t B = a.query.shape[0], Hq = a.query.shape[1], L = a.query.shape[2];
  const int64_t E = a.query.shape[3], Hk = a.key.shape(1), S = a.key.shape(2);
  const int64_t Ev = a.value.shape(3);
  const auto require = [](const StoredView<T>& v, const char* name,
                          std::initializer_list<int64_t> expected) {
    int d = 0;
    for (int64_t extent : expected) {
      if (v.shape(d) != extent)
        throw py::value_error(std::string(name) + ": dimension " + std::to_string(d) + " is " +
                              std::to_string(v.shape(d)) + ", expected " +
                              std::to_string(extent));
      ++d;
    }
  };
  require(a.key, "key", {B, Hk, S, E});
  require(a.value, "value", {B, Hk, S, Ev});
  if (Hq > 0 && (Hk == 0 || Hq % Hk != 0))
    throw py::value_error("query heads (" + std::to_string(Hq) +
                          ") must be a multiple of key heads (" + std::to_string(Hk) + ")");
  std::vector<int64_t> mask_offsets;
  if (attn_mask) {
    a.masks[0] = batched_mask_view<T>(*attn_mask, "attn_mask", mask_offsets);
    require_shape(a.masks[0], "attn_mask", {B, Hq, L, S});
  }
  if (!std::isfinite(scale)) throw py::value_error("scale must be finite");
  a.mask_cols = S;
  a.range.causal = causal;
  a.range.bottom_right = bottom_right;
  a.range.window_left = window_extent(window_left, S + L);
  a.range.window_right = window_extent(window_right, S + L);
  a.range.key_lengths = lengths_data(key_lengths, "key_lengths", B, S);
  a.range.query_lengths = lengths_data(query_lengths, "query_lengths", B, L);
  a.scale = static_cast<T>(scale);
  a.out = mutable_view<T, 4>(out, "out");
  require_shape(a.out, "out", {B, Hq, L, Ev});
  a.weights = contiguous_output<T>(weights, "weights", {B, Hq, L, S});
  py::gil_scoped_release release;
  sdpa_forward(a);
}

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

// The common call -- three 4-D arrays of one dtype with the same (B, H), rows
// contiguous, no mask -- without the Python layer's general canonicalisation
// (which costs more than a small call's arithmetic). Returns None for any
// other input, which then takes the general path and its checks.
template <typename T>
py::object sdpa_plain_typed(const py::array& q, const py::array& k, const py::array& v,
                            bool causal, bool enable_gqa) {
  const py::ssize_t item = sizeof(T);
  for (const py::array* a : {&q, &k, &v}) {
    if (a->ndim() != 4 || !is_dtype(*a, py::dtype::of<T>())) return py::none();
    if (a->size() == 0 || a->strides(3) != item || a->strides(0) % item || a->strides(1) % item ||
        a->strides(2) % item || reinterpret_cast<std::uintptr_t>(a->data()) % alignof(T))
      return py::none();
  }
  const py::ssize_t B = q.shape(0), H = q.shape(1), L = q.shape(2), E = q.shape(3);
  // Key heads: as many as the query's, or with enable_gqa a divisor of them.
  const py::ssize_t Hk = k.shape(1);
  const bool heads_match = Hk == H || (enable_gqa && H % Hk == 0);
  if (k.shape(0) != B || !heads_match || k.shape(3) != E || v.shape(0) != B ||
      v.shape(1) != Hk || v.shape(2) != k.shape(2))
    return py::none();
  py::array_t<T> out({B, H, L, v.shape(3)});
  SdpaArgs<T> a;
  a.query = const_view<T, 4>(q, "query");
  a.key = StoredView<T>::of(const_view<T, 4>(k, "key"));
  a.value = StoredView<T>::of(const_view<T, 4>(v, "value"));
  a.mask_cols = k.shape(2);
  a.range.causal = causal;
  a.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(E)));
  py::array out_array = out;
  a.out = mutable_view<T, 4>(out_array, "out");
  {
    py::gil_scoped_release release;
    sdpa_forward(a);
  }
  return std::move(out);
}

}  // namespace

void register_attention(py::module_& m) {
  m.def(
      "sdpa",
      [](const py::array& query, const py::array& key, const py::array& value,
         const OptArray& attn_mask, bool causal, double scale, py::array& out, OptArray weights,
         bool bottom_right, int64_t window_left, int64_t window_right,
         const OptArray& key_lengths, const OptArray& query_lengths) {
        if (is_dtype(query, py::dtype::of<float>()))
          sdpa_typed<float>(query, key, value, attn_mask, causal, scale, out, weights,
                            bottom_right, window_left, window_right, key_lengths, query_lengths);
        else if (is_dtype(query, py::dtype::of<double>()))
          sdpa_typed<double>(query, key, value, attn_mask, causal, scale, out, weights,
                             bottom_right, window_left, window_right, key_lengths, query_lengths);
        else
          throw py::type_error("query: expected float32 or float64");
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask"),
      py::arg("causal"), py::arg("scale"), py::arg("out"), py::arg("weights"),
      py::arg("bottom_right") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
      py::arg("key_lengths") = py::none(), py::arg("query_lengths") = py::none(),
      "Scaled dot-product attention on canonical (B, H, L, E) views. key and value may be\n"
      "float16 or bfloat16 for a float32 query. Row i of batch b attends key j < klen_b,\n"
      "with causal: j <= i + d; window_left >= 0: j >= i + d - window_left; window_right >= 0:\n"
      "j <= i + d + window_right; d = klen_b - qlen_b with bottom_right, else 0;\n"
      "klen_b = key_lengths[b] or S, qlen_b = query_lengths[b] or L (rows past it are zero).");
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
      "sdpa_plain",
      [](const py::handle& query, const py::handle& key, const py::handle& value, bool causal,
         bool enable_gqa) -> py::object {
        if (!py::isinstance<py::array>(query) || !py::isinstance<py::array>(key) ||
            !py::isinstance<py::array>(value))
          return py::none();
        const auto q = py::reinterpret_borrow<py::array>(query);
        const auto k = py::reinterpret_borrow<py::array>(key);
        const auto v = py::reinterpret_borrow<py::array>(value);
        if (is_dtype(q, py::dtype::of<float>()))
          return sdpa_plain_typed<float>(q, k, v, causal, enable_gqa);
        if (is_dtype(q, py::dtype::of<double>()))
          return sdpa_plain_typed<double>(q, k, v, causal, enable_gqa);
        return py::none();
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("causal"),
      py::arg("enable_gqa") = false,
      "sdpa of three plain 4-D arrays with the default scale and no mask, or None; with\n"
      "enable_gqa the key heads may divide the query heads.");
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
