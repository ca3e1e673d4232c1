// MhaPlan: the common call of MultiheadAttention, with the module's
// parameters checked once.
//
// A small call's arithmetic takes about as long as checking and converting
// the 24 arguments of _core.mha in Python and in the binding, so the module
// keeps one of these per set of parameter arrays. It holds references to the
// arrays (their memory, so values written in place are used), and each call
// checks only the three inputs. It keeps its own ndarray views of them, so
// that no one else can reshape or restride what it has checked. A call that is not the common one -- not a
// plain 3-D ndarray of the module's dtype with contiguous rows, flags that
// are not bools, shapes that do not match -- returns None, and the module
// takes its general path, which converts or explains.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "attnx/attention.h"
#include "bindings/array_views.h"

namespace attnx::bindings {
namespace {

using OptArray = std::optional<py::array>;

class MhaPlan {
 public:
  MhaPlan(int64_t num_heads, py::array w_q, py::array w_k, py::array w_v, OptArray b_q,
          OptArray b_k, OptArray b_v, OptArray bias_k, OptArray bias_v, bool add_zero_attn,
          py::array w_out, OptArray b_out, bool batch_first)
      : num_heads_(num_heads),
        w_q_(own_view(w_q)),
        w_k_(own_view(w_k)),
        w_v_(own_view(w_v)),
        w_out_(own_view(w_out)),
        b_q_(own_view(b_q)),
        b_k_(own_view(b_k)),
        b_v_(own_view(b_v)),
        bias_k_(own_view(bias_k)),
        bias_v_(own_view(bias_v)),
        b_out_(own_view(b_out)),
        add_zero_attn_(add_zero_attn),
        batch_first_(batch_first) {
    if (w_q_.dtype().equal(py::dtype::of<float>()))
      is_double_ = false;
    else if (w_q_.dtype().equal(py::dtype::of<double>()))
      is_double_ = true;
    else
      throw py::type_error("q_proj_weight: expected float32 or float64");
    if (is_double_)
      check_parameters<double>();
    else
      check_parameters<float>();
  }

  // (out, weights or None), or None where the call is not the common one.
  py::object call(const py::handle& query, const py::handle& key, const py::handle& value,
                  const py::handle& need_weights, const py::handle& average_weights,
                  bool causal, bool bottom_right) const {
    // The flags must be the bools themselves (as the general path wants).
    if (need_weights.ptr() != Py_True && need_weights.ptr() != Py_False) return py::none();
    const bool with_weights = need_weights.ptr() == Py_True;
    if (with_weights && average_weights.ptr() != Py_True && average_weights.ptr() != Py_False)
      return py::none();
    const bool average = average_weights.ptr() == Py_True;
    return is_double_ ? call_typed<double>(query, key, value, with_weights, average, causal,
                                           bottom_right)
                      : call_typed<float>(query, key, value, with_weights, average, causal,
                                          bottom_right);
  }

 private:
  template <typename T>
  void check_parameters() {
    const RowMajorView<const T> wq = matrix_view<T>(w_q_, "q_proj_weight");
    const RowMajorView<const T> wk = matrix_view<T>(w_k_, "k_proj_weight");
    const RowMajorView<const T> wv = matrix_view<T>(w_v_, "v_proj_weight");
    const RowMajorView<const T> wo = matrix_view<T>(w_out_, "out_proj_weight");
    // A matrix's rows may be any distance apart (even 0, broadcast).
    row_stride_q_ = wq.row_stride, row_stride_k_ = wk.row_stride, row_stride_v_ = wv.row_stride;
    row_stride_out_ = wo.row_stride;
    const int64_t E = wq.rows;
    if (num_heads_ < 1 || E % num_heads_ != 0)
      throw py::value_error("embed_dim (" + std::to_string(E) +
                            ") must be divisible by num_heads (" + std::to_string(num_heads_) +
                            ")");
    if (wq.cols != E) throw py::value_error("q_proj_weight: expected a square matrix");
    if (wk.rows != E || wv.rows != E)
      throw py::value_error("k_proj_weight and v_proj_weight: expected embed_dim rows");
    if (wo.rows != E || wo.cols != E)
      throw py::value_error("out_proj_weight: expected shape (embed_dim, embed_dim)");
    vector_data<T>(b_q_, "q bias", E);
    vector_data<T>(b_k_, "k bias", E);
    vector_data<T>(b_v_, "v bias", E);
    vector_data<T>(bias_k_, "bias_k", E);
    vector_data<T>(bias_v_, "bias_v", E);
    vector_data<T>(b_out_, "out_proj_bias", E);
    if (bool(bias_k_) != bool(bias_v_))
      throw py::value_error("bias_k and bias_v must be given together");
  }

  // A plain 3-D ndarray of dtype T with contiguous, aligned rows, seen as
  // (N, L, dim); nullopt for anything else.
  template <typename T>
  std::optional<StridedView<const T, 3>> plain_input(const py::handle& h) const {
    if (Py_TYPE(h.ptr()) != ndarray_type()) return std::nullopt;
    const auto a = py::reinterpret_borrow<py::array>(h);
    const py::ssize_t item = sizeof(T);
    if (a.ndim() != 3 || !a.dtype().equal(py::dtype::of<T>()) || a.strides(2) != item ||
        a.strides(0) % item || a.strides(1) % item ||
        reinterpret_cast<std::uintptr_t>(a.data()) % alignof(T))
      return std::nullopt;
    StridedView<const T, 3> v;
    v.data = static_cast<const T*>(a.data());
    const int outer = batch_first_ ? 0 : 1;  // (L, N, dim) is read as (N, L, dim)
    v.shape[0] = a.shape(outer), v.stride[0] = view_stride<T>(a, outer);
    v.shape[1] = a.shape(1 - outer), v.stride[1] = view_stride<T>(a, 1 - outer);
    v.shape[2] = a.shape(2), v.stride[2] = 1;
    return v;
  }

  template <typename T>
  py::object call_typed(const py::handle& query, const py::handle& key, const py::handle& value,
                        bool with_weights, bool average, bool causal, bool bottom_right) const {
    // (Self-attention passes one array three times: it is checked once.)
    const auto q = plain_input<T>(query);
    const auto k = key.ptr() == query.ptr() ? q : plain_input<T>(key);
    const auto v = value.ptr() == key.ptr() ? k : plain_input<T>(value);
    if (!q || !k || !v) return py::none();
    const int64_t E = w_q_.shape(0), H = num_heads_;
    const int64_t N = q->shape[0], L = q->shape[1], S = k->shape[1];
    if (q->shape[2] != E || k->shape[2] != w_k_.shape(1) || v->shape[2] != w_v_.shape(1) ||
        k->shape[0] != N || v->shape[0] != N || v->shape[1] != S)
      return py::none();

    MhaArgs<T> a;
    a.query = *q, a.key = *k, a.value = *v;
    a.num_heads = H;
    a.w_q = RowMajorView<const T>{data_of<T>(w_q_), E, E, row_stride_q_};
    a.w_k = RowMajorView<const T>{data_of<T>(w_k_), E, k->shape[2], row_stride_k_};
    a.w_v = RowMajorView<const T>{data_of<T>(w_v_), E, v->shape[2], row_stride_v_};
    a.w_out = RowMajorView<const T>{data_of<T>(w_out_), E, E, row_stride_out_};
    a.b_q = data_of<T>(b_q_), a.b_k = data_of<T>(b_k_), a.b_v = data_of<T>(b_v_);
    a.bias_k = data_of<T>(bias_k_), a.bias_v = data_of<T>(bias_v_);
    a.b_out = data_of<T>(b_out_);
    a.add_zero_attn = add_zero_attn_;
    a.causal = causal;
    a.bottom_right = bottom_right;

    py::array_t<T> out(batch_first_ ? std::vector<py::ssize_t>{N, L, E}
                                    : std::vector<py::ssize_t>{L, N, E});
    a.out.data = out.mutable_data();
    a.out.shape[0] = N, a.out.shape[1] = L, a.out.shape[2] = E;
    a.out.stride[0] = batch_first_ ? L * E : E;
    a.out.stride[1] = batch_first_ ? E : N * E;
    a.out.stride[2] = 1;

    py::object weights = py::none();
    if (with_weights) {
      const int64_t Sp = S + (a.bias_k ? 1 : 0) + (add_zero_attn_ ? 1 : 0);
      py::array_t<T> w(average ? std::vector<py::ssize_t>{N, L, Sp}
                               : std::vector<py::ssize_t>{N, H, L, Sp});
      a.weights = w.mutable_data();
      a.average_weights = average;
      weights = std::move(w);
    }
    {
      py::gil_scoped_release release;
      mha_forward(a);
    }
    return py::make_tuple(std::move(out), std::move(weights));
  }

  template <typename T>
  static const T* data_of(const py::array& a) {
    return static_cast<const T*>(a.data());
  }

  template <typename T>
  static const T* data_of(const OptArray& a) {
    return a ? data_of<T>(*a) : nullptr;
  }

  // A new ndarray over the same memory, which only this plan references:
  // its shape and strides stay the ones checked.
  static py::array own_view(const py::array& a) { return a.attr("view")(); }

  static OptArray own_view(const OptArray& a) {
    return a ? OptArray(own_view(*a)) : std::nullopt;
  }

  static PyTypeObject* ndarray_type() {
    static PyTypeObject* type = reinterpret_cast<PyTypeObject*>(
        py::module_::import("numpy").attr("ndarray").ptr());  // numpy stays imported
    return type;
  }

  int64_t num_heads_;
  py::array w_q_, w_k_, w_v_, w_out_;
  OptArray b_q_, b_k_, b_v_, bias_k_, bias_v_, b_out_;
  int64_t row_stride_q_ = 0, row_stride_k_ = 0, row_stride_v_ = 0, row_stride_out_ = 0;
  bool add_zero_attn_, batch_first_;
  bool is_double_ = false;
};

}  // namespace

void register_mha_plan(py::module_& m) {
  py::class_<MhaPlan>(m, "MhaPlan",
                      "MultiheadAttention's parameters, checked once, for its common call.")
      .def(py::init<int64_t, py::array, py::array, py::array, OptArray, OptArray, OptArray,
                    OptArray, OptArray, bool, py::array, OptArray, bool>(),
           py::arg("num_heads"), py::arg("w_q"), py::arg("w_k"), py::arg("w_v"), py::arg("b_q"),
           py::arg("b_k"), py::arg("b_v"), py::arg("bias_k"), py::arg("bias_v"),
           py::arg("add_zero_attn"), py::arg("w_out"), py::arg("b_out"), py::arg("batch_first"))
      .def("__call__", &MhaPlan::call, py::arg("query"), py::arg("key"), py::arg("value"),
           py::arg("need_weights"), py::arg("average_weights"), py::arg("causal"),
           py::arg("bottom_right"),
           "(out, weights or None) of three plain 3-D arrays of the parameters' dtype, else "
           "None.");
}

}  // namespace attnx::bindings
