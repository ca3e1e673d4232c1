// The binding of scaled dot-product attention and of attention over a KV
// cache.
//
// _core.sdpa takes the caller's arguments as they are. Arrays already in the
// canonical form -- three 4-D ndarrays of one float dtype whose batch and
// head dims agree, rows contiguous, no mask, no out -- go to the core
// directly; anything else is first handed to attnx._canonical.sdpa_call,
// where Python applies torch's rules (conversions, ranks, broadcasting, GQA,
// masks, out=) and explains what it cannot accept. Either way the core runs
// once, through run_sdpa.
//
// Releasing the GIL is safe: the core touches no Python object, and the
// py::array arguments keep every buffer alive until the call returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/narrowing.h"
#include "attnx/attention.h"
#include "bindings/array_views.h"
#include "bindings/precision_option.h"
#include "bindings/sdpa_arguments.h"

namespace attnx::bindings {

namespace {

// What some calls add: per-batch lengths for attention over a KV cache (keys
// [0, key_lengths[b]) of each sequence, whose last query_lengths[b] rows are
// its newest tokens), a C-contiguous (B, H, L, S) array for the attention
// probabilities, and one for the scores at the options' stage.
struct SdpaExtras {
  OptArray key_lengths;
  OptArray query_lengths;
  OptArray weights;
  OptArray scores;
  OptArray key_scales;    // int8 keys: (B, Hk, S) float32, a scale per row
  OptArray value_scales;  // int8 values: the same
};

void run_sdpa(const py::array& query, const py::array& key, const py::array& value,
              const OptArray& attn_mask, const SdpaOptions& options, py::array& out,
              const SdpaExtras& extras = {});

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

template <typename T>
void run_sdpa_typed(const py::array& query, const py::array& key, const py::array& value,
                    const OptArray& attn_mask, const SdpaOptions& o, py::array& out,
                    const SdpaExtras& extras) {
  SdpaArgs<T> a;
  a.query = const_view<T, 4>(query, "query");
  a.key = stored_view<T>(key, "key", extras.key_scales);
  a.value = stored_view<T>(value, "value", extras.value_scales);
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
  apply_options(o, S, a);
  a.range.key_lengths = lengths_data(extras.key_lengths, "key_lengths", B, S);
  a.range.query_lengths = lengths_data(extras.query_lengths, "query_lengths", B, L);
  a.out = mutable_view<T, 4>(out, "out");
  require_shape(a.out, "out", {B, Hq, L, Ev});
  OptArray weights = extras.weights;
  a.weights = contiguous_output<T>(weights, "weights", {B, Hq, L, S});
  OptArray scores = extras.scores;
  T* scores_data = contiguous_output<T>(scores, "scores", {B, Hq, L, S});
  if (scores_data && (o.scores < 0 || o.scores > int(ScoreStage::kSoftmax) ||
                      a.range.key_lengths || a.range.query_lengths))
    throw py::value_error("scores: a stage of ScoreStage, and no key or query lengths");
  py::gil_scoped_release release;
  sdpa_forward(a);
  if (scores_data) sdpa_scores(a, static_cast<ScoreStage>(o.scores), scores_data);
}

// Whether q, k and v are already what attnx._canonical.sdpa_call would hand
// the core unchanged: 4-D ndarrays of dtype T, aligned, rows contiguous,
// batch and head dims agreeing (key heads dividing the query's with
// enable_gqa), not empty.
template <typename T>
bool canonical_inputs(const py::array& q, const py::array& k, const py::array& v,
                      bool enable_gqa) {
  const py::ssize_t item = sizeof(T);
  for (const py::array* a : {&q, &k, &v}) {
    if (a->ndim() != 4 || !is_dtype(*a, py::dtype::of<T>())) return false;
    if (a->size() == 0 || a->strides(3) != item || a->strides(0) % item ||
        a->strides(1) % item || a->strides(2) % item ||
        reinterpret_cast<std::uintptr_t>(a->data()) % alignof(T))
      return false;
  }
  const py::ssize_t Hq = q.shape(1), Hk = k.shape(1);
  const bool heads_match = Hk == Hq || (enable_gqa && Hq % Hk == 0);
  return k.shape(0) == q.shape(0) && heads_match && k.shape(3) == q.shape(3) &&
         v.shape(0) == q.shape(0) && v.shape(1) == Hk && v.shape(2) == k.shape(2);
}

// The core on inputs canonical_inputs accepted: their views need no other check.
template <typename T>
py::object sdpa_canonical(const py::array& q, const py::array& k, const py::array& v,
                          const SdpaOptions& o) {
  py::array out = py::array_t<T>({q.shape(0), q.shape(1), q.shape(2), v.shape(3)});
  SdpaArgs<T> a;
  a.query = const_view<T, 4>(q, "query");
  a.key = StoredView<T>::of(const_view<T, 4>(k, "key"));
  a.value = StoredView<T>::of(const_view<T, 4>(v, "value"));
  apply_options(o, k.shape(2), a);
  a.out = mutable_view<T, 4>(out, "out");
  {
    py::gil_scoped_release release;
    sdpa_forward(a);
  }
  return std::move(out);
}

// attnx._canonical.sdpa_call, imported on first use (numpy and attnx stay
// imported while this module is).
const py::object& python_sdpa_call() {
  static const py::object* call =
      new py::object(py::module_::import("attnx._canonical").attr("sdpa_call"));
  return *call;
}

py::object sdpa(const py::handle& query, const py::handle& key, const py::handle& value,
                const py::handle& attn_mask, const py::object& options, const py::handle& out) {
  const SdpaOptions& o = options.cast<const SdpaOptions&>();
  if (attn_mask.is_none() && out.is_none() && o.scores < 0 && py::isinstance<py::array>(query) &&
      py::isinstance<py::array>(key) && py::isinstance<py::array>(value)) {
    const auto q = py::reinterpret_borrow<py::array>(query);
    const auto k = py::reinterpret_borrow<py::array>(key);
    const auto v = py::reinterpret_borrow<py::array>(value);
    if (canonical_inputs<float>(q, k, v, o.enable_gqa)) return sdpa_canonical<float>(q, k, v, o);
    if (canonical_inputs<double>(q, k, v, o.enable_gqa))
      return sdpa_canonical<double>(q, k, v, o);
  }
  // (q, k, v, mask or None, target or None, computed, result, scores): the
  // core writes `target`, a (B, H, L, Ev) view of `computed`; a
  // half-precision result is then rounded from it. `scores` is None, or
  // (target, computed, result) of the scores, (B, H, L, S) and the same.
  const py::tuple call = python_sdpa_call()(query, key, value, attn_mask, options, out);
  py::object result = call[6];
  const bool with_scores = !call[7].is_none();
  if (!call[4].is_none()) {
    py::array target = call[4].cast<py::array>();
    const OptArray mask =
        call[3].is_none() ? OptArray() : OptArray(call[3].cast<py::array>());
    SdpaExtras extras;
    if (with_scores) extras.scores = call[7].cast<py::tuple>()[0].cast<py::array>();
    run_sdpa(call[0].cast<py::array>(), call[1].cast<py::array>(), call[2].cast<py::array>(),
             mask, o, target, extras);
    const py::object computed = call[5];
    if (!computed.is(result)) result[py::ellipsis()] = computed;
  }
  if (!with_scores) return result;
  const py::tuple scores = call[7].cast<py::tuple>();
  py::object scores_result = scores[2];
  const py::object scores_computed = scores[1];
  if (!scores_computed.is(scores_result)) scores_result[py::ellipsis()] = scores_computed;
  return py::make_tuple(result, scores_result);
}

// Runs the core on canonical (B, H, L, E) arrays: checks that the views fit
// each other (so that no call, however wrong, reads or writes out of bounds)
// and releases the GIL around the arithmetic.
void run_sdpa(const py::array& query, const py::array& key, const py::array& value,
              const OptArray& attn_mask, const SdpaOptions& options, py::array& out,
              const SdpaExtras& extras) {
  if (is_dtype(query, py::dtype::of<float>()))
    run_sdpa_typed<float>(query, key, value, attn_mask, options, out, extras);
  else if (is_dtype(query, py::dtype::of<double>()))
    run_sdpa_typed<double>(query, key, value, attn_mask, options, out, extras);
  else
    throw py::type_error("query: expected float32 or float64");
}

// Packed keys or values: of T, or float16/bfloat16 for a float32 call.
template <typename T>
StoredView<T> packed_stored_view(const py::array& a, const char* name,
                                 const std::vector<int64_t>& lengths,
                                 std::vector<int64_t>& offsets) {
  if constexpr (std::is_same_v<T, float>) {
    if (const Storage half = half_storage(a); half != Storage::kNative) {
      check_layout(a, name, 3, true, false, 2);
      StridedView<const uint16_t, 3> bits;
      bits.data = static_cast<const uint16_t*>(a.data());
      for (int d = 0; d < 3; ++d) {
        bits.shape[d] = a.shape(d);
        bits.stride[d] = a.shape(d) > 1 ? a.strides(d) / 2 : 0;
      }
      StoredView<T> v;
      v.storage = half;
      v.bits = packed_view(bits, lengths, offsets);
      return v;
    }
  }
  return StoredView<T>::of(packed_view(const_view<T, 3>(a, name), lengths, offsets));
}

template <typename T>
void run_varlen_typed(const py::array& query, const py::array& key, const py::array& value,
                      const py::array& cu_seqlens_q, const py::array& cu_seqlens_k,
                      const SdpaOptions& o, py::array& out) {
  const StridedView<const T, 3> q = const_view<T, 3>(query, "query");
  const std::vector<int64_t> q_lengths =
      sequence_lengths(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "query");
  if (key.ndim() != 3 || value.ndim() != 3)
    throw py::value_error("key and value: expected (total_k, Hk, E) and (total_k, Hk, Ev), got " +
                          shape_string(key) + " and " + shape_string(value));
  const std::vector<int64_t> k_lengths =
      sequence_lengths(cu_seqlens_k, "cu_seqlens_k", key.shape(0), "key");
  if (k_lengths.size() != q_lengths.size())
    throw py::value_error("cu_seqlens_q and cu_seqlens_k: " + std::to_string(q_lengths.size()) +
                          " and " + std::to_string(k_lengths.size()) +
                          " sequences; both must have batch + 1 offsets");
  const int64_t Hq = q.shape[1], E = q.shape[2], Hk = key.shape(1);
  if (key.shape(2) != E || value.shape(0) != key.shape(0) || value.shape(1) != Hk)
    throw py::value_error("key " + shape_string(key) + " and value " + shape_string(value) +
                          " must be (total_k, Hk, E) and (total_k, Hk, Ev) for query " +
                          shape_string(query) + " (E = " + std::to_string(E) + ")");
  if (Hq > 0 && (Hk == 0 || Hq % Hk != 0))
    throw py::value_error("query heads (" + std::to_string(Hq) +
                          ") must be a multiple of key heads (" + std::to_string(Hk) + ")");
  std::vector<int64_t> q_offsets, k_offsets, v_offsets, out_offsets;
  SdpaArgs<T> a;
  a.query = packed_view(q, q_lengths, q_offsets);
  a.key = packed_stored_view<T>(key, "key", k_lengths, k_offsets);
  a.value = packed_stored_view<T>(value, "value", k_lengths, v_offsets);
  const int64_t Ev = a.value.shape(3);
  a.out = packed_view(mutable_view<T, 3>(out, "out"), q_lengths, out_offsets);
  if (out.shape(0) != q.shape[0] || out.shape(1) != Hq || out.shape(2) != Ev)
    throw py::value_error("out: expected (" + std::to_string(q.shape[0]) + ", " +
                          std::to_string(Hq) + ", " + std::to_string(Ev) + "), got " +
                          shape_string(out));
  apply_options(o, a.key.shape(2), a);
  a.range.query_lengths = q_lengths.data();
  a.range.key_lengths = k_lengths.data();
  a.range.packed = true;
  py::gil_scoped_release release;
  sdpa_forward(a);
}

void run_varlen(const py::array& query, const py::array& key, const py::array& value,
                const py::array& cu_seqlens_q, const py::array& cu_seqlens_k,
                const py::object& options, py::array& out) {
  const SdpaOptions& o = options.cast<const SdpaOptions&>();
  if (o.scores >= 0) throw py::value_error("varlen attention returns no scores");
  if (is_dtype(query, py::dtype::of<float>()))
    run_varlen_typed<float>(query, key, value, cu_seqlens_q, cu_seqlens_k, o, out);
  else if (is_dtype(query, py::dtype::of<double>()))
    run_varlen_typed<double>(query, key, value, cu_seqlens_q, cu_seqlens_k, o, out);
  else
    throw py::type_error("query: expected float32 or float64");
}

}  // namespace

void register_sdpa_testing(py::module_& testing) {
  testing.def(
      "run_sdpa",
      [](const py::array& query, const py::array& key, const py::array& value,
         const OptArray& attn_mask, const py::object& options, py::array& out,
         const OptArray& weights) {
        run_sdpa(query, key, value, attn_mask, options.cast<const SdpaOptions&>(), out,
                 SdpaExtras{std::nullopt, std::nullopt, weights});
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask"),
      py::arg("options"), py::arg("out"), py::arg("weights"),
      "The core on canonical (B, H, L, E) arrays, with the probabilities written to\n"
      "`weights` (B, H, L, S) where given: the views' own checks, and the weights paths.");
}

void register_sdpa(py::module_& m) {
  py::class_<SdpaOptions>(m, "SdpaOptions",
                          "The checked scalar arguments of an attention call.")
      .def(py::init([](bool causal, bool bottom_right, double scale, int64_t window_left,
                       int64_t window_right, bool enable_gqa, double softcap, int scores,
                       int precision) {
             return SdpaOptions{causal,       bottom_right, scale,   window_left,
                                window_right, enable_gqa,   softcap, scores, precision};
           }),
           py::arg("causal") = false, py::arg("bottom_right") = false,
           py::arg("scale") = std::numeric_limits<double>::quiet_NaN(),
           py::arg("window_left") = -1, py::arg("window_right") = -1,
           py::arg("enable_gqa") = false, py::arg("softcap") = 0.0, py::arg("scores") = -1,
           py::arg("precision") = 0)
      .def_readonly("causal", &SdpaOptions::causal)
      .def_readonly("bottom_right", &SdpaOptions::bottom_right)
      .def_readonly("scale", &SdpaOptions::scale)
      .def_readonly("window_left", &SdpaOptions::window_left)
      .def_readonly("window_right", &SdpaOptions::window_right)
      .def_readonly("enable_gqa", &SdpaOptions::enable_gqa)
      .def_readonly("softcap", &SdpaOptions::softcap)
      .def_readonly("scores", &SdpaOptions::scores)
      .def_readonly("precision", &SdpaOptions::precision);
  m.def("sdpa", &sdpa, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask"),
        py::arg("options"), py::arg("out"),
        "Scaled dot-product attention: the arguments as the caller gave them, the options\n"
        "checked. Canonical inputs run as they are; others go through attnx._canonical.");
  m.def(
      "cached_attention",
      [](const py::array& query, const py::array& key, const py::array& value,
         const py::array& key_lengths, const py::array& query_lengths,
         const py::object& options, py::array& out, const OptArray& key_scales,
         const OptArray& value_scales) {
        run_sdpa(query, key, value, std::nullopt, options.cast<const SdpaOptions&>(), out,
                 SdpaExtras{key_lengths, query_lengths, std::nullopt, std::nullopt, key_scales,
                            value_scales});
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("key_lengths"),
      py::arg("query_lengths"), py::arg("options"), py::arg("out"),
      py::arg("key_scales") = py::none(), py::arg("value_scales") = py::none(),
      "Attention of canonical (B, Hq, T, E) queries over a cache's (B, Hk, S, E) keys and\n"
      "values: row t of batch b is the newest but (query_lengths[b] - 1 - t) token of its\n"
      "sequence, which attends keys j < key_lengths[b] (bottom-right causal with the options'\n"
      "window); rows t >= query_lengths[b] are zeros. int8 keys and values (float32 query)\n"
      "take their (B, Hk, S) float32 scales, one per row.");
  m.def("varlen_attention", &run_varlen, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("options"), py::arg("out"),
        "Attention of packed sequences: query (total_q, Hq, E), key (total_k, Hk, E) and value\n"
        "(total_k, Hk, Ev), rows of the compute dtype (or float16/bfloat16 keys and values of a\n"
        "float32 call); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of the queries\n"
        "and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of the keys (int64), the options applied per\n"
        "sequence, into out (total_q, Hq, Ev), C-contiguous.");
  m.def(
      "quantize_int8",
      [](const py::array& src, py::array& dst, py::array& scales) {
        // src (N, D) float32 or float64, rows contiguous; dst (N, D) int8 and scales (N)
        // float32, C-contiguous and writable: each row quantized as an int8 cache stores it.
        const bool is_double = is_dtype(src, py::dtype::of<double>());
        if (!is_double) check_array<float>(src, "src", 2, true, false);
        else check_layout(src, "src", 2, true, false, 8);
        const StridedView<int8_t, 2> q = mutable_view<int8_t, 2>(dst, "dst");
        const StridedView<float, 1> s = mutable_view<float, 1>(scales, "scales");
        const int64_t N = src.shape(0), D = src.shape(1);
        if (q.shape[0] != N || q.shape[1] != D || s.shape[0] != N)
          throw py::value_error("quantize_int8: src " + shape_string(src) + ", dst " +
                                shape_string(dst) + " and scales " + shape_string(scales) +
                                " do not agree");
        const int64_t ld = N > 1 ? src.strides(0) / (is_double ? 8 : 4) : 0;
        const void* data = src.data();
        py::gil_scoped_release release;  // plain buffers, kept alive by the arguments
        for (int64_t r = 0; r < N; ++r)
          s.data[r * s.stride[0]] =
              is_double ? quantize_int8(static_cast<const double*>(data) + r * ld, D,
                                        q.data + r * q.stride[0])
                        : quantize_int8(static_cast<const float*>(data) + r * ld, D,
                                        q.data + r * q.stride[0]);
      },
      py::arg("src"), py::arg("dst"), py::arg("scales"),
      "Rows of src (N, D), float32 or float64, quantized into dst (N, D) int8 and scales (N)\n"
      "float32, as an int8 KVCache stores them.");
}

}  // namespace attnx::bindings
