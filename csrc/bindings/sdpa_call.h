// The canonical call of scaled dot-product attention, as the bindings hand it
// to the core: the options Python has checked, and the checked views.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "attnx/attention.h"
#include "bindings/array_views.h"

namespace attnx::bindings {

using OptArray = std::optional<py::array>;

// The scalar arguments of an attention call, checked by Python
// (attnx._canonical) before they are made: causal alignment, scale (NaN for
// the default 1/sqrt(E)), window extents (< 0 unbounded) and grouped heads.
struct SdpaOptions {
  bool causal = false;
  bool bottom_right = false;
  double scale = std::numeric_limits<double>::quiet_NaN();
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool enable_gqa = false;
};

// What some calls add: per-batch lengths for attention over a KV cache (keys
// [0, key_lengths[b]) of each sequence, whose last query_lengths[b] rows are
// its newest tokens), and a C-contiguous (B, H, L, S) array for the
// attention probabilities.
struct SdpaExtras {
  OptArray key_lengths;
  OptArray query_lengths;
  OptArray weights;
};

// Runs the core on canonical (B, H, L, E) arrays: checks that the views fit
// each other (so that no call, however wrong, reads or writes out of bounds)
// and releases the GIL around the arithmetic.
void run_sdpa(const py::array& query, const py::array& key, const py::array& value,
              const OptArray& attn_mask, const SdpaOptions& options, py::array& out,
              const SdpaExtras& extras = {});

}  // namespace attnx::bindings
