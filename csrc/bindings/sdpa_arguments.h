// What the bindings of the attention calls share: their checked options,
// and the views of packed sequences and of 16-bit storage.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attnx/attention.h"
#include "bindings/array_views.h"
#include "bindings/precision_option.h"

namespace attnx::bindings {

namespace py = pybind11;

// The scalar arguments of an attention call, checked by Python
// (attnx._canonical) before they are made: causal alignment, scale (NaN for
// the default 1/sqrt(E)), window extents (< 0 unbounded), grouped heads, the
// soft cap (0: none) and the stage of the scores returned (< 0: none; else a
// ScoreStage).
struct SdpaOptions {
  bool causal = false;
  bool bottom_right = false;
  double scale = std::numeric_limits<double>::quiet_NaN();
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool enable_gqa = false;
  double softcap = 0;
  int scores = -1;
  int precision = 0;  // 0 native, 1 bfloat16, 2 int8
};

// kFloat16 or kBFloat16 for an array of native 16-bit floats, else kNative.
inline Storage half_storage(const py::array& a) {
  const py::dtype dt = a.dtype();
  const bool float16 = dt.kind() == 'f' && dt.itemsize() == 2;
  // ml_dtypes' bfloat16 is a 2-byte type of its own, known by its name.
  const bool bfloat16 = dt.itemsize() == 2 && std::string(py::str(dt)) == "bfloat16";
  if (!(float16 || bfloat16) || !dt.attr("isnative").cast<bool>()) return Storage::kNative;
  return float16 ? Storage::kFloat16 : Storage::kBFloat16;
}

// Keys or values: an array of T, or, for a float32 call, of float16 or
// bfloat16 (read in place and widened as they are loaded), or of int8 with
// a float32 scale per row in `scales` (B, H, S), rows contiguous.
template <typename T>
StoredView<T> stored_view(const py::array& a, const char* name, const OptArray& scales) {
  const py::dtype dt = a.dtype();
  if constexpr (std::is_same_v<T, float>) {
    if (dt.equal(py::dtype::of<int8_t>())) {
      const std::string scales_name = std::string(name) + " scales";
      if (!scales) throw py::type_error(std::string(name) + ": int8 needs a scale per row");
      StoredView<T> v;
      v.storage = Storage::kInt8;
      v.q8 = const_view<int8_t, 4>(a, name);
      v.scales = const_view<float, 3>(*scales, scales_name.c_str());
      require_shape(v.scales, scales_name.c_str(), {v.q8.shape[0], v.q8.shape[1], v.q8.shape[2]});
      if (v.q8.shape[2] > 1 && v.scales.stride[2] != 1)
        throw py::value_error(scales_name + ": the last dimension must be contiguous");
      return v;
    }
    if (const Storage half = half_storage(a); half != Storage::kNative) {
      check_layout(a, name, 4, true, false, 2);
      StoredView<T> v;
      v.storage = half;
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

// A window extent: < 0 unbounded; extents past `limit` mean the same as it.
inline int64_t window_extent(int64_t w, int64_t limit) { return w < 0 ? -1 : std::min(w, limit); }

// The options' key range and scale on args whose query is set, over S keys:
// the scale by default 1/sqrt(E) (1 for E = 0).
template <typename T>
void apply_options(const SdpaOptions& o, int64_t S, SdpaArgs<T>& a) {
  const int64_t L = a.query.shape[2], E = a.query.shape[3];
  const double scale =
      std::isnan(o.scale) ? (E > 0 ? 1.0 / std::sqrt(static_cast<double>(E)) : 1.0) : o.scale;
  if (!std::isfinite(scale)) throw py::value_error("scale must be finite");
  if (!(o.softcap >= 0) || !std::isfinite(o.softcap))
    throw py::value_error("softcap must be finite and > 0 (0 here: none)");
  a.mask_cols = S;
  a.range.causal = o.causal;
  a.range.bottom_right = o.bottom_right;
  a.range.window_left = window_extent(o.window_left, S + L);
  a.range.window_right = window_extent(o.window_right, S + L);
  a.scale = static_cast<T>(scale);
  // A cap past T's largest finite value is T's largest, not an infinite c
  // (whose c * tanh(s / c) is NaN): a finite score keeps its value, an
  // infinite one becomes the largest, as in the reference's wider range.
  a.softcap = static_cast<T>(std::min(o.softcap, double(std::numeric_limits<T>::max())));
  a.precision = checked_precision(o.precision, std::is_same_v<T, double>, true);
}

// Sequence b of packed rows: rows cu[b] .. cu[b + 1] - 1 of `rows` rows.
// The rules of cu_seqlens (flash-attn's): int64, (B + 1), from 0, never
// decreasing, to the row count; `name` is the argument's.
inline std::vector<int64_t> sequence_lengths(const py::array& cu, const char* name, int64_t rows,
                                      const char* rows_of) {
  const StridedView<const int64_t, 1> v = const_view<int64_t, 1>(cu, name);
  const std::string n(name);
  if (v.shape[0] < 1)
    throw py::value_error(n + ": expected (batch + 1) offsets starting at 0, got an empty array");
  if (v.data[0] != 0)
    throw py::value_error(n + ": must start at 0, got " + std::to_string(v.data[0]));
  std::vector<int64_t> lengths(size_t(v.shape[0] - 1));
  // Compared before subtracting: from 0 and never decreasing, every offset is >= 0 and each
  // difference fits (an offset of INT64_MIN after 200 would overflow it).
  for (int64_t b = 0; b + 1 < v.shape[0]; ++b) {
    if (v.data[b + 1] < v.data[b])
      throw py::value_error(n + ": must not decrease, got " + std::to_string(v.data[b]) +
                            " then " + std::to_string(v.data[b + 1]) + " at index " +
                            std::to_string(b + 1));
    lengths[size_t(b)] = v.data[b + 1] - v.data[b];
  }
  if (v.data[v.shape[0] - 1] != rows)
    throw py::value_error(n + ": must end at " + std::to_string(rows) + ", the " + rows_of +
                          "'s rows, got " + std::to_string(v.data[v.shape[0] - 1]));
  return lengths;
}

// A (total, H, D) view of packed rows seen as (B, H, max_len, D): batch b's
// rows start at row cu[b] (batch_offsets, in elements, into `offsets`).
template <typename X>
StridedView<X, 4> packed_view(const StridedView<X, 3>& v, const std::vector<int64_t>& lengths,
                              std::vector<int64_t>& offsets) {
  StridedView<X, 4> p;
  p.data = v.data;
  p.shape[0] = int64_t(lengths.size());
  p.shape[1] = v.shape[1];
  p.shape[2] = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  p.shape[3] = v.shape[2];
  p.stride[0] = 1;  // not broadcast: each batch its own rows, through the offsets
  p.stride[1] = v.stride[1], p.stride[2] = v.stride[0], p.stride[3] = v.stride[2];
  offsets.assign(lengths.size(), 0);
  for (size_t b = 1; b < lengths.size(); ++b)
    offsets[b] = offsets[b - 1] + lengths[b - 1] * v.stride[0];
  p.batch_offsets = offsets.data();
  return p;
}

}  // namespace attnx::bindings
