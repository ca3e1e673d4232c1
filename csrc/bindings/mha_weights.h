// What the bindings of multi-head attention share with those of transformer
// layers: the views of parameter arrays, the checked parameters of
// multi-head attention (_core.MhaWeights) and the storage of a KVCache.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/projection.h"
#include "attnx/attention.h"
#include "bindings/array_views.h"
#include "bindings/precision_option.h"

namespace attnx::bindings {

// A new ndarray over the memory of the numpy.ndarray `h` (TypeError naming
// `name` for anything else), which only the parameters holding it
// reference: its shape and strides stay the ones checked.
inline py::array own_view(const py::handle& h, const char* name) {
  if (!py::isinstance<py::array>(h))
    throw py::type_error(std::string(name) + ": expected a numpy.ndarray, got " +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))));
  return py::reinterpret_borrow<py::array>(h).attr("view")();
}
// A matrix packed for bfloat16 products on first use and kept (see
// MhaWeights::params).
inline const Bf16Weights* packed_once(std::shared_ptr<const Bf16Weights>& packed,
                                      const RowMajorView<const float>& w) {
  if (!packed) packed = std::make_shared<const Bf16Weights>(pack_bf16_weights(w));
  return packed.get();
}

// own_view, or nothing for None.
inline OptArray optional_own_view(const py::handle& h, const char* name) {
  return h.is_none() ? OptArray() : OptArray(own_view(h, name));
}

// The head dim E / H, where the heads split the embedding evenly: the one
// place this rule is checked (the modules' constructors ask it too, through
// _core.head_dim, before they have weights).
inline int64_t checked_head_dim(int64_t E, int64_t H) {
  if (E < 1)
    throw py::value_error("embed_dim must be at least 1 (a multiple of num_heads = " +
                          std::to_string(H) + "), got " + std::to_string(E));
  if (H < 1 || E % H != 0)
    throw py::value_error("embed_dim (" + std::to_string(E) + ") must be divisible by num_heads (" +
                          std::to_string(H) + ")");
  return E / H;
}

// The parameters of multi-head attention, checked once: float32 or float64
// arrays of the shapes torch's module has. It keeps its own ndarray views of
// them (sharing their memory, so values written in place are used), which
// no one else can reshape or restride. `dtype` is the dtype results are
// returned in (a half-precision module's, whose parameters are given here in
// float32).
class MhaWeights {
 public:
  MhaWeights(int64_t num_heads, const py::tuple& projections, const py::object& in_biases,
             const py::tuple& out_projection, const py::object& bias_kv, bool add_zero_attn,
             py::dtype dtype)
      : num_heads_(num_heads), add_zero_attn_(add_zero_attn), dtype_(std::move(dtype)) {
    static const char* names[4] = {"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                   "out_proj_weight"};
    if (projections.size() != 3 || out_projection.size() != 2)
      throw py::value_error("MhaWeights: projections must be (w_q, w_k, w_v), out_projection "
                            "(w_out, b_out)");
    for (int i = 0; i < 3; ++i) w_[i] = own_view(projections[i], names[i]);
    w_[3] = own_view(out_projection[0], names[3]);
    b_[3] = optional_own_view(out_projection[1], "out_proj_bias");
    if (!in_biases.is_none()) {
      const auto biases = in_biases.cast<py::tuple>();
      if (biases.size() != 3) throw py::value_error("MhaWeights: in_biases must be (b_q, b_k, b_v)");
      for (int i = 0; i < 3; ++i) b_[i] = optional_own_view(biases[i], "in_proj_bias");
    }
    if (!bias_kv.is_none()) {
      const auto pair = bias_kv.cast<py::tuple>();
      if (pair.size() != 2) throw py::value_error("MhaWeights: bias_kv must be (bias_k, bias_v)");
      bias_kv_[0] = optional_own_view(pair[0], "bias_k");
      bias_kv_[1] = optional_own_view(pair[1], "bias_v");
    }
    // The compute dtype: float64 for float64 results, else float32.
    is_double_ = dtype_.equal(py::dtype::of<double>());
    result_is_compute_ = is_double_ || dtype_.equal(py::dtype::of<float>());
    if (is_double_)
      check<double>(names);
    else
      check<float>(names);
  }

  bool is_double() const { return is_double_; }
  bool result_is_compute() const { return result_is_compute_; }
  const py::dtype& dtype() const { return dtype_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t embed_dim() const { return w_[0].shape(0); }
  int64_t out_dim() const { return w_[3].shape(0); }
  int64_t kdim() const { return w_[1].shape(1); }
  int64_t vdim() const { return w_[2].shape(1); }
  bool bias_kv() const { return bool(bias_kv_[0]); }
  bool add_zero_attn() const { return add_zero_attn_; }

  // The parameters, for products of `precision`. Those of bfloat16 read the
  // weights as packed by the first call that asked for them, and kept: a
  // value written into a weight array in place afterwards is not seen by
  // them (a new MhaWeights is made when a parameter is assigned or loaded).
  // Called with the GIL held, so that one thread packs.
  //
  // Stacked weights (MhaParams::stacked) are packed as one matrix, of which
  // w_q, w_k and w_v are views, where each of them begins a panel.
  template <typename T>
  MhaParams<T> params(Precision precision = Precision::kNative) const {
    MhaParams<T> p;
    p.num_heads = num_heads_;
    p.w_q = matrix(0, T()), p.w_k = matrix(1, T()), p.w_v = matrix(2, T());
    p.w_out = matrix(3, T());
    p.b_q = data_of<T>(b_[0]), p.b_k = data_of<T>(b_[1]), p.b_v = data_of<T>(b_[2]);
    p.b_out = data_of<T>(b_[3]);
    p.bias_k = data_of<T>(bias_kv_[0]), p.bias_v = data_of<T>(bias_kv_[1]);
    p.add_zero_attn = add_zero_attn_;
    if constexpr (std::is_same_v<T, float>) {
      if (precision == Precision::kBFloat16) {
        const Bf16Weights** in[3] = {&p.bf16_q, &p.bf16_k, &p.bf16_v};
        if (p.stacked() && !qkv_apart_) {
          // Packed once as one matrix, with the views made then (a call
          // running without the GIL may be reading them); where a view
          // cannot begin a panel, the three are packed apart instead, so
          // that no weight is packed twice.
          if (!bf16_qkv_) {
            RowMajorView<const float> w_qkv = p.w_q;
            w_qkv.rows = 3 * p.w_q.rows;
            const Bf16Weights* qkv = packed_once(bf16_qkv_, w_qkv);
            for (int i = 0; i < 3; ++i)
              qkv_apart_ = !bf16_weight_rows(*qkv, i * p.w_q.rows, p.w_q.rows, qkv_rows_[i]) ||
                           qkv_apart_;
            if (qkv_apart_) bf16_qkv_.reset();
          }
          if (!qkv_apart_) {
            p.bf16_qkv = bf16_qkv_.get();
            for (int i = 0; i < 3; ++i) *in[i] = &qkv_rows_[i];
          }
        }
        for (int i = 0; i < 3; ++i)
          if (!*in[i]) *in[i] = packed_once(bf16_[i], matrix(i, T()));
        p.bf16_out = packed_once(bf16_[3], matrix(3, T()));
      }
    }
    return p;
  }

 private:
  template <typename T>
  void check(const char* const names[4]) {
    for (int i = 0; i < 4; ++i) row_stride_[i] = matrix_view<T>(w_[i], names[i]).row_stride;
    const int64_t E = embed_dim();
    if (w_[0].shape(1) != E)
      throw py::value_error("q_proj_weight: expected a square (E, E) matrix, got shape " +
                            shape_string(w_[0]));
    for (int i = 1; i < 3; ++i)
      if (w_[i].shape(0) != E)
        throw py::value_error(std::string(names[i]) + ": expected E = " + std::to_string(E) +
                              " rows, got shape " + shape_string(w_[i]));
    if (w_[3].shape(1) != E)
      throw py::value_error("out_proj_weight: expected E = " + std::to_string(E) +
                            " columns, got shape " + shape_string(w_[3]));
    checked_head_dim(E, num_heads_);
    static const char* bias_names[3] = {"q bias", "k bias", "v bias"};
    for (int i = 0; i < 3; ++i) vector_data<T>(b_[i], bias_names[i], E);
    vector_data<T>(b_[3], "out_proj_bias", out_dim());
    vector_data<T>(bias_kv_[0], "bias_k", E);
    vector_data<T>(bias_kv_[1], "bias_v", E);
    if (bool(bias_kv_[0]) != bool(bias_kv_[1]))
      throw py::value_error("bias_k and bias_v must be given together");
  }

  template <typename T>
  RowMajorView<const T> matrix(int i, T) const {
    return RowMajorView<const T>{static_cast<const T*>(w_[i].data()), w_[i].shape(0),
                                 w_[i].shape(1), row_stride_[i]};
  }

  template <typename T>
  static const T* data_of(const OptArray& a) {
    return a ? static_cast<const T*>(a->data()) : nullptr;
  }

  int64_t num_heads_;
  py::array w_[4];  // w_q, w_k, w_v, w_out
  OptArray b_[4];   // b_q, b_k, b_v, b_out
  OptArray bias_kv_[2];
  int64_t row_stride_[4] = {};
  mutable std::shared_ptr<const Bf16Weights> bf16_[4];  // w_q, w_k, w_v, w_out, packed
  mutable std::shared_ptr<const Bf16Weights> bf16_qkv_;  // [w_q; w_k; w_v], where stacked
  mutable Bf16Weights qkv_rows_[3];                      // views of bf16_qkv_'s rows
  mutable bool qkv_apart_ = false;                       // stacked, but packed apart
  bool add_zero_attn_;
  py::dtype dtype_;
  bool is_double_ = false;
  bool result_is_compute_ = true;
};

// CacheArrays of a KVCache's storage (key, value, lengths), as KVCache.storage() gives them,
// and for an int8 cache its scales, as KVCache.scales() gives them.
inline CacheArrays cache_arrays(const py::object& cache) {
  const py::tuple storage = cache.attr("storage")();
  py::array key = storage[0].cast<py::array>(), value = storage[1].cast<py::array>();
  py::array lengths = storage[2].cast<py::array>();
  CacheArrays c;
  const py::dtype dt = key.dtype();
  if (dt.equal(py::dtype::of<float>()))
    c.element = CacheElement::kFloat32;
  else if (dt.equal(py::dtype::of<double>()))
    c.element = CacheElement::kFloat64;
  else if (dt.kind() == 'f' && dt.itemsize() == 2)
    c.element = CacheElement::kFloat16;
  else if (dt.itemsize() == 2 && std::string(py::str(dt)) == "bfloat16")
    c.element = CacheElement::kBFloat16;
  else if (dt.equal(py::dtype::of<int8_t>()))
    c.element = CacheElement::kInt8;
  else
    throw py::type_error("cache: unsupported storage dtype " + std::string(py::str(dt)));
  for (const py::array* a : {&key, &value}) {
    if (a->ndim() != 4 || !(a->flags() & py::array::c_style) || !a->writeable() ||
        !a->dtype().equal(dt))
      throw py::value_error("cache: keys and values must be writable C-contiguous 4-D arrays");
  }
  c.key = key.mutable_data(), c.value = value.mutable_data();
  c.batch = key.shape(0), c.heads = key.shape(1), c.max_len = key.shape(2);
  c.head_dim = key.shape(3), c.value_dim = value.shape(3);
  if (value.shape(0) != c.batch || value.shape(1) != c.heads || value.shape(2) != c.max_len)
    throw py::value_error("cache: keys and values do not agree");
  check_array<int64_t>(lengths, "cache lengths", 1, true, true);
  if (lengths.shape(0) != c.batch) throw py::value_error("cache lengths: wrong shape");
  c.lengths = static_cast<int64_t*>(lengths.mutable_data());
  if (c.element == CacheElement::kInt8) {
    const py::tuple scales = cache.attr("scales")();
    float* data[2];
    for (int i = 0; i < 2; ++i) {
      py::array s = scales[i].cast<py::array>();
      check_array<float>(s, "cache scales", 3, true, true);
      if (!(s.flags() & py::array::c_style) || s.shape(0) != c.batch || s.shape(1) != c.heads ||
          s.shape(2) != c.max_len)
        throw py::value_error("cache scales: expected C-contiguous (batch, heads, max_len), got " +
                              shape_string(s));
      data[i] = static_cast<float*>(s.mutable_data());
    }
    c.key_scales = data[0], c.value_scales = data[1];
  }
  return c;
}

}  // namespace attnx::bindings
