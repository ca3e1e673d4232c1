// The bindings of transformer layers: their checked parameters
// (_core.TransformerLayerWeights) and one layer's forward pass or decoding
// step (_core.transformer_layer). attnx._layers makes the canonical
// arguments: the masks as additive (N, H, L, S) views, the inputs in the
// weights' dtype.
//
// Releasing the GIL is safe: the core touches no Python object (a Python
// activation is called with the GIL taken back), and the py::array arguments
// keep every buffer alive until the call returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnx/transformer.h"
#include "bindings/array_views.h"
#include "bindings/mha_weights.h"

namespace attnx::bindings {
namespace {

// The parameters of one encoder or decoder layer, checked once. The
// attention blocks are MhaWeights (kept alive here); the linear layers and
// norms are views of the caller's arrays, whose values written in place are
// seen by the next call.
class TransformerLayerWeights {
 public:
  TransformerLayerWeights(py::object self_attn, py::object cross_attn, const py::tuple& linear1,
                          const py::tuple& linear2, const py::tuple& norms, bool norm_first,
                          py::object activation)
      : self_attn_(std::move(self_attn)),
        cross_attn_(std::move(cross_attn)),
        norm_first_(norm_first),
        activation_(std::move(activation)) {
    const MhaWeights& sa = self_attn_.cast<const MhaWeights&>();
    const int64_t E = sa.embed_dim();
    if (sa.kdim() != E || sa.vdim() != E || sa.out_dim() != E || sa.bias_kv() ||
        sa.add_zero_attn())
      throw py::value_error("self_attn: expected self-attention of width d_model = " +
                            std::to_string(E) + " without bias_k/bias_v or zero attention");
    if (!cross_attn_.is_none()) {
      const MhaWeights& ca = cross_attn_.cast<const MhaWeights&>();
      if (ca.embed_dim() != E || ca.kdim() != E || ca.vdim() != E || ca.out_dim() != E ||
          ca.bias_kv() || ca.add_zero_attn() || ca.is_double() != sa.is_double())
        throw py::value_error("multihead_attn: expected attention of width d_model = " +
                              std::to_string(E) + " in self_attn's dtype");
    }
    if (linear1.size() != 2 || linear2.size() != 2)
      throw py::value_error("linear1, linear2: expected (weight, bias or None)");
    w1_ = own_view(linear1[0], "linear1.weight"), b1_ = optional_own_view(linear1[1], "linear1.bias");
    w2_ = own_view(linear2[0], "linear2.weight"), b2_ = optional_own_view(linear2[1], "linear2.bias");
    norm_count_ = static_cast<int>(norms.size());
    if (norm_count_ != (cross_attn_.is_none() ? 2 : 3))
      throw py::value_error("norms: expected 2 (encoder layers) or 3 (decoder layers)");
    for (int i = 0; i < norm_count_; ++i) {
      const auto norm = norms[i].cast<py::tuple>();
      if (norm.size() != 3)
        throw py::value_error("norms: expected (weight or None, bias or None, eps)");
      norm_w_[i] = optional_own_view(norm[0], "norm weight");
      norm_b_[i] = optional_own_view(norm[1], "norm bias");
      eps_[i] = norm[2].cast<double>();
      if (!(eps_[i] >= 0)) throw py::value_error("layer norm eps must be >= 0");
    }
    if (py::isinstance<py::str>(activation_)) {
      const std::string name = activation_.cast<std::string>();
      if (name == "relu")
        kind_ = Activation::kRelu;
      else if (name == "gelu")
        kind_ = Activation::kGelu;
      else
        throw py::value_error("activation: expected \"relu\", \"gelu\" or a callable, got \"" +
                              name + "\"");
    } else if (PyCallable_Check(activation_.ptr())) {
      kind_ = Activation::kNone;
    } else {
      throw py::type_error("activation: expected \"relu\", \"gelu\" or a callable");
    }
    if (sa.is_double())
      check<double>(E);
    else
      check<float>(E);
  }

  const MhaWeights& self_attn() const { return self_attn_.cast<const MhaWeights&>(); }
  bool decoder() const { return !cross_attn_.is_none(); }
  bool is_double() const { return self_attn().is_double(); }
  int64_t d_model() const { return self_attn().embed_dim(); }
  int64_t num_heads() const { return self_attn().num_heads(); }
  int64_t dim_feedforward() const { return w1_.shape(0); }
  bool custom_activation() const { return kind_ == Activation::kNone; }
  const py::object& activation() const { return activation_; }

  // The parameters for products of `precision` (see MhaWeights::params:
  // the feed-forward weights, too, are packed once for bfloat16).
  template <typename T>
  TransformerLayerParams<T> params(Precision precision) const {
    TransformerLayerParams<T> p;
    p.self_attn = self_attn().params<T>(precision);
    if (decoder()) p.cross_attn = cross_attn_.cast<const MhaWeights&>().params<T>(precision);
    p.has_cross = decoder();
    p.ff.w1 = matrix_view<T>(w1_, "linear1.weight");
    p.ff.w2 = matrix_view<T>(w2_, "linear2.weight");
    p.ff.b1 = data_of<T>(b1_), p.ff.b2 = data_of<T>(b2_);
    p.ff.activation = kind_;
    for (int i = 0; i < norm_count_; ++i) {
      p.norms[i].weight = data_of<T>(norm_w_[i]);
      p.norms[i].bias = data_of<T>(norm_b_[i]);
      p.norms[i].eps = static_cast<T>(eps_[i]);
    }
    p.norm_first = norm_first_;
    if constexpr (std::is_same_v<T, float>) {
      if (precision == Precision::kBFloat16) {
        p.bf16_w1 = packed_once(bf16_[0], p.ff.w1);
        p.bf16_w2 = packed_once(bf16_[1], p.ff.w2);
      }
    }
    return p;
  }

 private:
  template <typename T>
  void check(int64_t E) {
    const RowMajorView<const T> w1 = matrix_view<T>(w1_, "linear1.weight");
    const RowMajorView<const T> w2 = matrix_view<T>(w2_, "linear2.weight");
    if (w1.cols != E || w2.rows != E || w2.cols != w1.rows)
      throw py::value_error("linear1.weight " + shape_string(w1_) + " and linear2.weight " +
                            shape_string(w2_) + ": expected (dim_feedforward, " +
                            std::to_string(E) + ") and (" + std::to_string(E) +
                            ", dim_feedforward)");
    vector_data<T>(b1_, "linear1.bias", w1.rows);
    vector_data<T>(b2_, "linear2.bias", E);
    for (int i = 0; i < norm_count_; ++i) {
      vector_data<T>(norm_w_[i], "norm weight", E);
      vector_data<T>(norm_b_[i], "norm bias", E);
    }
  }

  template <typename T>
  static const T* data_of(const OptArray& a) {
    return a ? static_cast<const T*>(a->data()) : nullptr;
  }

  py::object self_attn_, cross_attn_;
  py::array w1_, w2_;
  OptArray b1_, b2_;
  OptArray norm_w_[3], norm_b_[3];
  int norm_count_ = 0;
  double eps_[3] = {};
  bool norm_first_;
  py::object activation_;
  Activation kind_ = Activation::kRelu;
  mutable std::shared_ptr<const Bf16Weights> bf16_[2];  // linear1, linear2, packed
};

// A 3-D array of T seen as (N, L, E): as it is with batch_first, else
// (L, N, E) with its first two dims swapped.
template <typename T>
StridedView<const T, 3> batch_view(const py::array& a, const char* name, bool batch_first) {
  StridedView<const T, 3> v = const_view<T, 3>(a, name);
  if (!batch_first) {
    std::swap(v.shape[0], v.shape[1]);
    std::swap(v.stride[0], v.stride[1]);
  }
  return v;
}

// The (attn_mask, key_padding_mask) pair of one block, None or each None or
// an additive (N, H, L, S) view.
template <typename T>
BlockMasks<T> block_masks(const py::object& pair, bool causal, const char* name, int64_t N,
                          int64_t H, int64_t L, int64_t S, OptArray (&keep)[kMaxMasks]) {
  BlockMasks<T> m;
  m.causal = causal;
  if (pair.is_none()) return m;
  const auto masks = pair.cast<py::tuple>();
  if (masks.size() != kMaxMasks)
    throw py::value_error(std::string(name) + ": expected (attn_mask, key_padding_mask)");
  for (int k = 0; k < kMaxMasks; ++k) {
    if (masks[k].is_none()) continue;
    keep[k] = masks[k].cast<py::array>();
    m.masks[k] = const_view<T, 4>(*keep[k], name, false);
    require_shape(m.masks[k], name, {N, H, L, S});
  }
  return m;
}

// The scalar arguments of a layer call and its stack's final norm, checked
// once in Python (attnx._layers) and kept for the calls of a stack.
class TransformerLayerOptions {
 public:
  TransformerLayerOptions(bool batch_first, bool self_causal, bool cross_causal, int precision,
                          const py::object& final_norm)
      : batch_first(batch_first),
        self_causal(self_causal),
        cross_causal(cross_causal),
        precision(precision) {
    checked_precision(precision, false);  // 0 or 1; float64 is checked with the weights
    if (!final_norm.is_none()) {
      const auto f = final_norm.cast<py::tuple>();
      if (f.size() != 3) throw py::value_error("final_norm: expected (weight, bias, eps)");
      for (int i = 0; i < 2; ++i)
        if (!f[i].is_none()) norm[i] = f[i].cast<py::array>();
      eps = f[2].cast<double>();
      if (!(eps >= 0)) throw py::value_error("norm.eps must be >= 0");
      has_norm = true;
    }
  }

  bool batch_first, self_causal, cross_causal;
  int precision;
  bool has_norm = false;
  OptArray norm[2];
  double eps = 0;
};

// Sequence lengths (int64, 1-D) as PackedRows over `total` rows: the starts
// are their running sums.
PackedRows packed_rows(const py::object& lengths, const char* name, int64_t total,
                       py::array_t<int64_t>& keep, std::vector<int64_t>& starts) {
  keep = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(lengths);
  if (!keep || keep.ndim() != 1)
    throw py::value_error(std::string(name) + ": expected a 1-D array of int64 lengths");
  PackedRows p;
  p.count = keep.shape(0);
  p.lengths = keep.data();
  starts.assign(size_t(p.count), 0);
  int64_t sum = 0;
  for (int64_t b = 0; b < p.count; ++b) {
    if (p.lengths[b] < 0 || p.lengths[b] > total - sum)
      throw py::value_error(std::string(name) + ": lengths must be >= 0 and sum to the rows, " +
                            std::to_string(total));
    starts[size_t(b)] = sum;
    sum += p.lengths[b];
    p.max_length = std::max(p.max_length, p.lengths[b]);
  }
  if (sum != total)
    throw py::value_error(std::string(name) + ": lengths sum to " + std::to_string(sum) +
                          ", expected the rows, " + std::to_string(total));
  p.starts = starts.data();
  return p;
}

// Contiguous-row (rows, E) array as the (1, rows, E) view of packed rows.
template <typename T>
StridedView<const T, 3> packed_view(const py::array& a, const char* name) {
  const StridedView<const T, 2> v = const_view<T, 2>(a, name);
  StridedView<const T, 3> r;
  r.data = v.data;
  r.shape[0] = 1, r.shape[1] = v.shape[0], r.shape[2] = v.shape[1];
  r.stride[0] = v.shape[0] * v.stride[0], r.stride[1] = v.stride[0], r.stride[2] = 1;
  return r;
}

template <typename T>
py::array transformer_layer_typed(const TransformerLayerWeights& w, const py::array& x,
                                  const py::object& memory, const py::object& self_masks,
                                  const py::object& cross_masks,
                                  const TransformerLayerOptions& o, const py::object& lengths,
                                  const py::object& step) {
  TransformerLayerArgs<T> a;
  a.precision = checked_precision(o.precision, std::is_same_v<T, double>);
  a.params = w.params<T>(a.precision);
  const bool batch_first = o.batch_first;
  const int64_t E = w.d_model(), H = w.num_heads();

  // Padding-free rows: x (total, E) and the sequences' lengths.
  py::array_t<int64_t> kept_lengths[2];
  std::vector<int64_t> starts[2];
  py::object memory_lengths = py::none();
  const bool packed = !lengths.is_none();
  if (packed) {
    const auto pair = lengths.cast<py::tuple>();
    if (pair.size() != 2)
      throw py::value_error("lengths: expected (x lengths, memory lengths or None)");
    if (!self_masks.is_none() || !cross_masks.is_none() || !step.is_none())
      throw py::value_error("lengths: packed rows take no masks and no decoding step");
    a.x = packed_view<T>(x, "x");
    a.x_rows = packed_rows(pair[0], "x lengths", a.x.shape[1], kept_lengths[0], starts[0]);
    memory_lengths = pair[1];
  } else {
    a.x = batch_view<T>(x, "x", batch_first);
  }
  const int64_t N = packed ? a.x_rows.count : a.x.shape[0];
  const int64_t L = packed ? a.x_rows.max_length : a.x.shape[1];
  if (a.x.shape[2] != E)
    throw py::value_error("x: " + std::to_string(a.x.shape[2]) + " features, expected d_model = " +
                          std::to_string(E));
  py::array memory_array;
  int64_t S = 0;
  if (w.decoder()) {
    if (memory.is_none()) throw py::value_error("memory: a decoder layer needs one");
    memory_array = memory.cast<py::array>();
    if (!memory_lengths.is_none()) {
      a.memory = packed_view<T>(memory_array, "memory");
      a.memory_rows = packed_rows(memory_lengths, "memory lengths", a.memory.shape[1],
                                  kept_lengths[1], starts[1]);
      if (a.memory_rows.count != N)
        throw py::value_error("memory lengths: " + std::to_string(a.memory_rows.count) +
                              " sequences, expected " + std::to_string(N));
      if (a.memory.shape[2] != E)
        throw py::value_error("memory: shape " + shape_string(memory_array) +
                              " does not match d_model " + std::to_string(E));
      S = a.memory_rows.max_length;
    } else {
      a.memory = batch_view<T>(memory_array, "memory", batch_first);
      S = a.memory.shape[1];
      if (a.memory.shape[0] != N || a.memory.shape[2] != E)
        throw py::value_error("memory: shape " + shape_string(memory_array) +
                              " does not match x " + shape_string(x));
    }
  } else if (!memory.is_none() || !memory_lengths.is_none()) {
    throw py::value_error("memory: an encoder layer takes none");
  }
  OptArray kept[2][kMaxMasks];
  CacheArrays cache_arrays_;
  py::array memory_kv_arrays[2];
  if (!step.is_none()) {
    const auto pair = step.cast<py::tuple>();
    if (pair.size() != 2) throw py::value_error("step: expected (cache, memory_kv)");
    const py::object cache = pair[0], memory_kv = pair[1];
    cache_arrays_ = cache_arrays(cache);
    const CacheArrays& c = cache_arrays_;
    if (c.heads != H || c.head_dim != E / H || c.value_dim != E / H || c.batch != N)
      throw py::value_error("cache: expected " + std::to_string(N) + " sequences of " +
                            std::to_string(H) + " heads of " + std::to_string(E / H));
    for (int64_t b = 0; b < N; ++b)
      if (c.lengths[b] + L > c.max_len)
        throw py::value_error("cache: a sequence would grow past max_len");
    if (!self_masks.is_none() || o.self_causal)
      throw py::value_error("self_masks: a decoding step takes none (it is causal)");
    a.self_cache = &cache_arrays_;
    if (w.decoder()) {
      if (memory_kv.is_none()) throw py::value_error("memory_kv: a decoding step needs them");
      const auto kv = memory_kv.cast<py::tuple>();
      if (kv.size() != 2) throw py::value_error("memory_kv: expected (keys, values)");
      for (int i = 0; i < 2; ++i) memory_kv_arrays[i] = kv[i].cast<py::array>();
      a.memory_keys = const_view<T, 4>(memory_kv_arrays[0], "memory keys");
      a.memory_values = const_view<T, 4>(memory_kv_arrays[1], "memory values");
      require_shape(a.memory_keys, "memory keys", {N, H, S, E / H});
      require_shape(a.memory_values, "memory values", {N, H, S, E / H});
    } else if (!memory_kv.is_none()) {
      throw py::value_error("memory_kv: an encoder layer takes none");
    }
  }
  a.self_masks = block_masks<T>(self_masks, o.self_causal, "self-attention mask", N, H, L, L,
                                kept[0]);
  if (w.decoder())
    a.cross_masks =
        block_masks<T>(cross_masks, o.cross_causal, "memory mask", N, H, L, S, kept[1]);
  else if (!cross_masks.is_none() || o.cross_causal)
    throw py::value_error("cross_masks: an encoder layer takes none");
  if (packed && o.cross_causal)
    throw py::value_error("cross_causal: packed rows take no causal rule over the memory");

  LayerNormParams<T> final_params;
  if (o.has_norm) {
    final_params.weight = vector_data<T>(o.norm[0], "norm.weight", E);
    final_params.bias = vector_data<T>(o.norm[1], "norm.bias", E);
    final_params.eps = static_cast<T>(o.eps);
    a.final_norm = &final_params;
  }

  const int64_t total = a.x.shape[1];
  py::array_t<T> out(packed        ? std::vector<py::ssize_t>{total, E}
                     : batch_first ? std::vector<py::ssize_t>{N, L, E}
                                   : std::vector<py::ssize_t>{L, N, E});
  a.out.data = out.mutable_data();
  a.out.shape[0] = packed ? 1 : N, a.out.shape[1] = packed ? total : L, a.out.shape[2] = E;
  a.out.stride[0] = packed ? total * E : batch_first ? L * E : E;
  a.out.stride[1] = packed || batch_first ? E : N * E;
  a.out.stride[2] = 1;

  if (w.custom_activation()) {
    // The hidden rows go to the Python callable as an array of their own;
    // its result, of the same shape, comes back in their place.
    const py::object& fn = w.activation();
    a.activate = [&fn](T* hidden, int64_t rows, int64_t cols) {
      py::gil_scoped_acquire gil;
      py::array_t<T> h({rows, cols});
      std::memcpy(h.mutable_data(), hidden, size_t(rows * cols) * sizeof(T));
      const py::object result = fn(h);
      const auto r = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(result);
      if (!r || r.ndim() != 2 || r.shape(0) != rows || r.shape(1) != cols)
        throw py::value_error("activation: the callable must return an array of the shape it "
                              "was given, (" + std::to_string(rows) + ", " +
                              std::to_string(cols) + ")");
      std::memcpy(hidden, r.data(), size_t(rows * cols) * sizeof(T));
    };
  }
  {
    py::gil_scoped_release release;
    transformer_layer_forward(a);
  }
  return std::move(out);
}

}  // namespace

void register_transformer(py::module_& m) {
  py::class_<TransformerLayerWeights>(
      m, "TransformerLayerWeights",
      "The parameters of a transformer encoder or decoder layer, checked once.")
      .def(py::init<py::object, py::object, const py::tuple&, const py::tuple&, const py::tuple&,
                    bool, py::object>(),
           py::arg("self_attn"), py::arg("cross_attn"), py::arg("linear1"), py::arg("linear2"),
           py::arg("norms"), py::arg("norm_first"), py::arg("activation"))
      .def_property_readonly("d_model", &TransformerLayerWeights::d_model)
      .def_property_readonly("num_heads", &TransformerLayerWeights::num_heads)
      .def_property_readonly("dim_feedforward", &TransformerLayerWeights::dim_feedforward)
      .def_property_readonly("decoder", &TransformerLayerWeights::decoder)
      .def_property_readonly("is_double", &TransformerLayerWeights::is_double);
  py::class_<TransformerLayerOptions>(
      m, "TransformerLayerOptions",
      "The scalar arguments of transformer_layer and a stack's final norm, checked once.")
      .def(py::init<bool, bool, bool, int, const py::object&>(), py::arg("batch_first"),
           py::arg("self_causal"), py::arg("cross_causal"), py::arg("precision") = 0,
           py::arg("final_norm") = py::none())
      .def_readonly("batch_first", &TransformerLayerOptions::batch_first)
      .def_readonly("self_causal", &TransformerLayerOptions::self_causal)
      .def_readonly("cross_causal", &TransformerLayerOptions::cross_causal)
      .def_readonly("precision", &TransformerLayerOptions::precision);
  m.def(
      "transformer_layer",
      [](const TransformerLayerWeights& w, const py::array& x, const py::object& memory,
         const py::object& self_masks, const py::object& cross_masks,
         const TransformerLayerOptions& options, const py::object& lengths,
         const py::object& step) -> py::array {
        return w.is_double() ? transformer_layer_typed<double>(w, x, memory, self_masks,
                                                               cross_masks, options, lengths, step)
                             : transformer_layer_typed<float>(w, x, memory, self_masks,
                                                              cross_masks, options, lengths, step);
      },
      py::arg("weights"), py::arg("x"), py::arg("memory"), py::arg("self_masks"),
      py::arg("cross_masks"), py::arg("options"), py::arg("lengths") = py::none(),
      py::arg("step") = py::none(),
      "One transformer layer: x (N, L, E), or (L, N, E) unless options.batch_first, in the\n"
      "weights' dtype; memory likewise for decoder layers; the masks of each block None or\n"
      "(attn_mask, key_padding_mask), each None or additive (N, H, L, S); options a\n"
      "TransformerLayerOptions. With lengths = (x lengths, memory lengths or None), int64\n"
      "(N): x is (total, E), the real tokens of N sequences end to end (padding-free rows),\n"
      "the memory packed likewise where its lengths are given; no masks then. With step =\n"
      "(KVCache, memory_kv), one decoding step of the self-attention over the cache (lengths\n"
      "grown on success), memory_kv = the memory's projected (keys, values), (N, H, S, E / H).\n"
      "Returns the layer's output in x's layout.");
}

}  // namespace attnx::bindings
