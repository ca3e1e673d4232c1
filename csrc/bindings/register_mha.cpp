// The bindings of multi-head attention: its checked parameters
// (_core.MhaWeights), the forward pass (_core.mha), the decoding step
// (_core.mha_step) and the linear layer (_core.linear).
//
// _core.mha takes the caller's inputs as they are. Inputs already in the
// canonical form -- plain 3-D ndarrays of the parameters' dtype with
// contiguous rows, in the layout the options name, and no masks or static
// keys -- go to the core directly; anything else is first handed to
// attnx._canonical.mha_call, where Python applies torch's rules. Either way
// the core runs once.
//
// Releasing the GIL is safe: the core touches no Python object, and the
// py::array arguments keep every buffer alive until the call returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention/projection.h"
#include "attention/step_faults.h"
#include "attnx/attention.h"
#include "bindings/array_views.h"
#include "bindings/mha_weights.h"

namespace attnx::bindings {
namespace {

// The flags of a call, checked by Python (attnx._canonical).
struct MhaOptions {
  bool causal = false;
  bool bottom_right = false;
  bool need_weights = true;
  bool average_weights = true;
  bool batch_first = false;
  int precision = 0;  // 0 native, 1 bfloat16
};

PyTypeObject* ndarray_type() {
  static PyTypeObject* type = reinterpret_cast<PyTypeObject*>(
      py::module_::import("numpy").attr("ndarray").ptr());  // numpy stays imported
  return type;
}

// A plain 3-D ndarray of dtype T with contiguous, aligned rows, seen as
// (N, L, dim) (a (L, N, dim) array unless batch_first); nullopt otherwise.
template <typename T>
std::optional<StridedView<const T, 3>> plain_input(const py::handle& h, bool batch_first) {
  if (Py_TYPE(h.ptr()) != ndarray_type()) return std::nullopt;
  const auto a = py::reinterpret_borrow<py::array>(h);
  const py::ssize_t item = sizeof(T);
  if (a.ndim() != 3 || !is_dtype(a, py::dtype::of<T>()) || a.strides(2) != item ||
      a.strides(0) % item || a.strides(1) % item ||
      reinterpret_cast<std::uintptr_t>(a.data()) % alignof(T))
    return std::nullopt;
  StridedView<const T, 3> v;
  v.data = static_cast<const T*>(a.data());
  const int outer = batch_first ? 0 : 1;
  v.shape[0] = a.shape(outer), v.stride[0] = view_stride<T>(a, outer);
  v.shape[1] = a.shape(1 - outer), v.stride[1] = view_stride<T>(a, 1 - outer);
  v.shape[2] = a.shape(2), v.stride[2] = 1;
  return v;
}

// The core on checked views; (out, weights or None) in the layout of the options.
template <typename T>
py::tuple run_mha(MhaArgs<T>& a, const MhaWeights& w, const MhaOptions& o) {
  const int64_t N = a.query.shape[0], L = a.query.shape[1], E_out = w.out_dim();
  const int64_t H = a.num_heads;
  py::array_t<T> out(o.batch_first ? std::vector<py::ssize_t>{N, L, E_out}
                                   : std::vector<py::ssize_t>{L, N, E_out});
  a.out.data = out.mutable_data();
  a.out.shape[0] = N, a.out.shape[1] = L, a.out.shape[2] = E_out;
  a.out.stride[0] = o.batch_first ? L * E_out : E_out;
  a.out.stride[1] = o.batch_first ? E_out : N * E_out;
  a.out.stride[2] = 1;
  a.causal = o.causal;
  a.bottom_right = o.bottom_right;
  a.precision = checked_precision(o.precision, std::is_same_v<T, double>);
  static_cast<MhaParams<T>&>(a) = w.params<T>(a.precision);
  py::object weights = py::none();
  if (o.need_weights) {
    const int64_t S_src = a.static_k.present() ? a.static_k.shape[2] : a.key.shape[1];
    const int64_t Sp = S_src + (w.bias_kv() ? 1 : 0) + (w.add_zero_attn() ? 1 : 0);
    py::array_t<T> probabilities(o.average_weights ? std::vector<py::ssize_t>{N, L, Sp}
                                                   : std::vector<py::ssize_t>{N, H, L, Sp});
    a.weights = probabilities.mutable_data();
    a.average_weights = o.average_weights;
    weights = std::move(probabilities);
  }
  {
    py::gil_scoped_release release;
    mha_forward(a);
  }
  return py::make_tuple(std::move(out), std::move(weights));
}

// The forward pass of inputs already canonical (see plain_input); None otherwise.
template <typename T>
py::object mha_plain(const MhaWeights& w, const py::handle& query, const py::handle& key,
                     const py::handle& value, const MhaOptions& o) {
  // (Self-attention passes one array three times: it is checked once.)
  const auto q = plain_input<T>(query, o.batch_first);
  const auto k = key.ptr() == query.ptr() ? q : plain_input<T>(key, o.batch_first);
  const auto v = value.ptr() == key.ptr() ? k : plain_input<T>(value, o.batch_first);
  if (!q || !k || !v) return py::none();
  const int64_t N = q->shape[0], S = k->shape[1];
  if (q->shape[2] != w.embed_dim() || k->shape[2] != w.kdim() || v->shape[2] != w.vdim() ||
      k->shape[0] != N || v->shape[0] != N || v->shape[1] != S)
    return py::none();
  MhaArgs<T> a;
  static_cast<MhaParams<T>&>(a) = w.params<T>();
  a.query = *q, a.key = *k, a.value = *v;
  return run_mha(a, w, o);
}

// The forward pass of the canonical arrays attnx._canonical.mha_call made:
// (query, key, value) as (N, L, dim) views, (attn_mask, key_padding_mask)
// and (static_k, static_v) as (N, H, L, S) / (N, H, S, hd) arrays or None.
//
// key_lengths: None or int64 (N), each batch's keys its first key_lengths[n]
// (a key padding mask of trailing padding, given as lengths so that the
// padded keys are never read), then with no key_padding_mask array.
template <typename T>
py::tuple mha_canonical(const MhaWeights& w, const py::tuple& call, const MhaOptions& o,
                        const py::handle& key_lengths) {
  MhaArgs<T> a;
  static_cast<MhaParams<T>&>(a) = w.params<T>();
  a.query = const_view<T, 3>(call[0].cast<py::array>(), "query");
  a.key = const_view<T, 3>(call[1].cast<py::array>(), "key");
  a.value = const_view<T, 3>(call[2].cast<py::array>(), "value");
  const int64_t N = a.query.shape[0], L = a.query.shape[1], S = a.key.shape[1];
  const int64_t E = w.embed_dim(), H = a.num_heads, hd = E / H;
  require_shape(a.query, "query", {N, L, E});
  require_shape(a.key, "key", {N, S});
  require_shape(a.value, "value", {N, S});
  if (a.key.shape[2] != w.kdim() || a.value.shape[2] != w.vdim())
    throw py::value_error("key and value: widths " + std::to_string(a.key.shape[2]) + " and " +
                          std::to_string(a.value.shape[2]) + ", but k_proj_weight and " +
                          "v_proj_weight take " + std::to_string(w.kdim()) + " and " +
                          std::to_string(w.vdim()));
  const auto optional = [](const py::handle& h) {
    return h.is_none() ? OptArray() : OptArray(h.cast<py::array>());
  };
  const OptArray static_k = optional(call[5]), static_v = optional(call[6]);
  a.static_k = optional_view<T, 4>(static_k, "static_k");
  a.static_v = optional_view<T, 4>(static_v, "static_v");
  if (a.static_k.present()) require_shape(a.static_k, "static_k", {N, H, a.static_k.shape[2], hd});
  if (a.static_v.present()) require_shape(a.static_v, "static_v", {N, H, a.static_v.shape[2], hd});
  if ((a.static_k.present() && a.bias_k) || (a.static_v.present() && a.bias_v))
    throw py::value_error("bias_k/bias_v cannot be added to static_k/static_v");
  const int64_t S_k = a.static_k.present() ? a.static_k.shape[2] : S;
  const int64_t S_v = a.static_v.present() ? a.static_v.shape[2] : S;
  if (S_k != S_v)
    throw py::value_error("keys and values have different lengths: " + std::to_string(S_k) +
                          " and " + std::to_string(S_v) + " (check static_k/static_v)");
  const OptArray masks[kMaxMasks] = {optional(call[3]), optional(call[4])};
  for (int m = 0; m < kMaxMasks; ++m) {
    a.masks[m] = optional_view<T, 4>(masks[m], m ? "key_padding_mask" : "attn_mask", false);
    if (a.masks[m].present()) require_shape(a.masks[m], "mask", {N, H, L, S_k});
  }
  py::array_t<int64_t> lengths;
  if (!key_lengths.is_none()) {
    lengths = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(key_lengths);
    if (!lengths || lengths.ndim() != 1 || lengths.shape(0) != N)
      throw py::value_error("key_lengths: expected int64 (N) = (" + std::to_string(N) + ")");
    if (a.masks[1].present() || w.bias_kv() || w.add_zero_attn())
      throw py::value_error("key_lengths: not with a key_padding_mask, bias_k/bias_v or "
                            "add_zero_attn");
    for (int64_t n = 0; n < N; ++n)
      if (lengths.data()[n] < 0 || lengths.data()[n] > S_k)
        throw py::value_error("key_lengths: outside [0, S]");
    a.key_lengths = lengths.data();
  }
  return run_mha(a, w, o);
}

// attnx._canonical.mha_call, imported on first use.
const py::object& python_mha_call() {
  static const py::object* call =
      new py::object(py::module_::import("attnx._canonical").attr("mha_call"));
  return *call;
}

py::object mha(const py::object& weights, const py::handle& query, const py::handle& key,
               const py::handle& value, const py::handle& extras, const py::object& options) {
  const MhaWeights& w = weights.cast<const MhaWeights&>();
  const MhaOptions& o = options.cast<const MhaOptions&>();
  if (extras.is_none() && w.result_is_compute()) {
    py::object result = w.is_double() ? mha_plain<double>(w, query, key, value, o)
                                      : mha_plain<float>(w, query, key, value, o);
    if (!result.is_none()) return result;
  }
  // (query, key, value, attn_mask, key_padding_mask, static_k, static_v, finish,
  // key_lengths): the canonical arrays, and what turns the core's (out, weights) into the
  // result.
  const py::tuple call =
      python_mha_call()(weights, query, key, value, extras, options);
  const py::tuple computed = w.is_double() ? mha_canonical<double>(w, call, o, call[8])
                                           : mha_canonical<float>(w, call, o, call[8]);
  return call[7](computed[0], computed[1]);
}

template <typename T>
py::array mha_step_typed(const MhaWeights& w, const py::array& rows, const py::object& cache,
                         const OptArray& lengths, const MhaOptions& o) {
  MhaStepArgs<T> a;
  a.precision = checked_precision(o.precision, std::is_same_v<T, double>);
  a.params = w.params<T>(a.precision);
  if (a.params.bias_k || a.params.add_zero_attn || w.kdim() != w.embed_dim() ||
      w.vdim() != w.embed_dim())
    throw py::value_error("mha_step: self-attention parameters only");
  a.rows = matrix_view<T>(rows, "query");
  const int64_t E = w.embed_dim(), H = a.params.num_heads;
  if (a.rows.cols != E) throw py::value_error("query: rows must have embed_dim elements");
  a.cache = cache_arrays(cache);
  const int64_t B = a.cache.batch;
  if (a.cache.heads != H || a.cache.head_dim != E / H || a.cache.value_dim != E / H)
    throw py::value_error("cache: must have num_heads heads of head_dim E / num_heads");
  if (B == 0 || a.rows.rows % B != 0)
    throw py::value_error("query: rows must be a whole number of tokens per sequence");
  a.batch = B, a.tokens = a.rows.rows / B, a.batch_first = o.batch_first;
  if (lengths) {
    a.new_lengths = vector_data<int64_t>(lengths, "lengths", B);
    for (int64_t b = 0; b < B; ++b)
      if (a.new_lengths[b] < 0 || a.new_lengths[b] > a.tokens)
        throw py::value_error("lengths: outside [0, T]");
  }
  for (int64_t b = 0; b < B; ++b)
    if (a.cache.lengths[b] + (a.new_lengths ? a.new_lengths[b] : a.tokens) > a.cache.max_len)
      throw py::value_error("cache: a sequence would grow past max_len");
  py::array_t<T> out({a.rows.rows, w.out_dim()});
  a.out = out.mutable_data();
  {
    py::gil_scoped_release release;
    mha_step(a);
  }
  return std::move(out);
}

// out = x . w^T + b.
template <typename T>
void linear_typed(const py::array& x, const py::array& w, const OptArray& b, py::array& out,
                  int precision) {
  const Precision p = checked_precision(precision, std::is_same_v<T, double>);
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
  linear_forward(x3, wv, bias, o3, Activation::kNone, p);
}

}  // namespace

void register_mha_testing(py::module_& testing) {
  testing.def(
      "run_mha",
      [](const MhaWeights& w, const py::tuple& call, const py::object& options) {
        if (call.size() != 7 && call.size() != 8)
          throw py::value_error("run_mha: call must be (query, key, value, attn_mask, "
                                "key_padding_mask, static_k, static_v[, key_lengths])");
        const MhaOptions& o = options.cast<const MhaOptions&>();
        const py::object lengths = call.size() == 8 ? py::object(call[7]) : py::none();
        return w.is_double() ? mha_canonical<double>(w, call, o, lengths)
                             : mha_canonical<float>(w, call, o, lengths);
      },
      py::arg("weights"), py::arg("call"), py::arg("options"),
      "The core's forward pass on canonical (N, L, dim) operands, (N, H, L, S) masks,\n"
      "(N, H, S, hd) static keys and values and optional int64 (N) key lengths: (out,\n"
      "weights or None).");
  testing.def(
      "fail_next_step",
      [](const std::string& stage) {
        if (stage == "attention")
          fail_next_step_at(StepStage::kAttention);
        else if (stage == "output projection")
          fail_next_step_at(StepStage::kOutputProjection);
        else
          throw py::value_error("fail_next_step: stage must be 'attention' or 'output projection'");
      },
      py::arg("stage"),
      "The next decoding step to reach `stage` raises MemoryError there, after it has written\n"
      "its keys and values.");
}

void register_mha(py::module_& m) {
  py::class_<MhaOptions>(m, "MhaOptions", "The checked flags of a multi-head attention call.")
      .def(py::init([](bool causal, bool bottom_right, bool need_weights, bool average_weights,
                       bool batch_first, int precision) {
             return MhaOptions{causal,          bottom_right, need_weights,
                               average_weights, batch_first,  precision};
           }),
           py::arg("causal"), py::arg("bottom_right"), py::arg("need_weights"),
           py::arg("average_weights"), py::arg("batch_first"), py::arg("precision") = 0)
      .def_readonly("causal", &MhaOptions::causal)
      .def_readonly("bottom_right", &MhaOptions::bottom_right)
      .def_readonly("need_weights", &MhaOptions::need_weights)
      .def_readonly("average_weights", &MhaOptions::average_weights)
      .def_readonly("batch_first", &MhaOptions::batch_first)
      .def_readonly("precision", &MhaOptions::precision);
  py::class_<MhaWeights>(m, "MhaWeights",
                         "The parameters of multi-head attention, checked once.")
      .def(py::init<int64_t, const py::tuple&, const py::object&, const py::tuple&,
                    const py::object&, bool, py::dtype>(),
           py::arg("num_heads"), py::arg("projections"), py::arg("in_biases"),
           py::arg("out_projection"), py::arg("bias_kv"), py::arg("add_zero_attn"),
           py::arg("dtype"))
      .def_property_readonly("dtype", &MhaWeights::dtype)
      .def_property_readonly("num_heads", &MhaWeights::num_heads)
      .def_property_readonly("embed_dim", &MhaWeights::embed_dim)
      .def_property_readonly("out_dim", &MhaWeights::out_dim)
      .def_property_readonly("kdim", &MhaWeights::kdim)
      .def_property_readonly("vdim", &MhaWeights::vdim)
      .def_property_readonly("bias_kv", &MhaWeights::bias_kv)
      .def_property_readonly("add_zero_attn", &MhaWeights::add_zero_attn);
  m.def("head_dim", &checked_head_dim, py::arg("embed_dim"), py::arg("num_heads"),
        "embed_dim // num_heads; ValueError unless num_heads divides embed_dim >= 1.");
  m.def("mha", &mha, py::arg("weights"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("extras"), py::arg("options"),
        "Multi-head attention forward: (out, weights or None). extras: None, or\n"
        "(attn_mask, key_padding_mask, static_k, static_v) as the caller gave them.");
  m.def(
      "mha_step",
      [](const MhaWeights& w, const py::array& rows, const py::object& cache,
         const OptArray& lengths, const py::object& options) {
        const MhaOptions& o = options.cast<const MhaOptions&>();
        if (is_dtype(rows, py::dtype::of<double>()) != w.is_double())
          throw py::type_error("query: expected the weights' dtype");
        return w.is_double() ? mha_step_typed<double>(w, rows, cache, lengths, o)
                             : mha_step_typed<float>(w, rows, cache, lengths, o);
      },
      py::arg("weights"), py::arg("rows"), py::arg("cache"), py::arg("lengths"),
      py::arg("options"),
      "One decoding step over a KVCache: rows (B * T, E) of new tokens in the caller's\n"
      "order; returns the (B * T, E_out) output rows. The cache's lengths grow on success.");
  m.def(
      "linear",
      [](const py::array& x, const py::array& w, const OptArray& b, py::array& out,
         int precision) {
        if (is_dtype(x, py::dtype::of<float>()))
          linear_typed<float>(x, w, b, out, precision);
        else if (is_dtype(x, py::dtype::of<double>()))
          linear_typed<double>(x, w, b, out, precision);
        else
          throw py::type_error("x: expected float32 or float64");
      },
      py::arg("x"), py::arg("w"), py::arg("b"), py::arg("out"), py::arg("precision") = 0,
      "out = x . w^T + b for x (N, K), w (M, K), b (M,) or None, out (N, M).");
}

}  // namespace attnx::bindings
