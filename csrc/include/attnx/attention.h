// The numeric core of attnx: scaled dot-product attention and the full
// multi-head attention forward, on strided views, free of any Python.
//
// Callers (the bindings) guarantee the layout rules written on each field;
// shapes are checked again in the bindings so that no input crashes.
#pragma once

#include <cstdint>

#include "attnx/strided_view.h"

namespace attnx {

// Masks are additive (0 = attend, -inf = masked, any float is added to the
// score), broadcast to (B, Hq, L, mask_cols) through their strides.
inline constexpr int kMaxMasks = 2;

template <typename T>
struct SdpaArgs {
  StridedView<const T, 4> query;  // (B, Hq, L, E), last dim contiguous
  StridedView<const T, 4> key;    // (B, Hk, S, E), last dim contiguous
  StridedView<const T, 4> value;  // (B, Hk, S, Ev), last dim contiguous; Hq % Hk == 0
  StridedView<const T, 4> masks[kMaxMasks];  // absent when data == nullptr
  // The masks and the causal rule cover keys [0, mask_cols). Keys past it
  // (the bias_k and zero-attention keys multi-head attention appends) are
  // always attended, as torch pads its masks with zeros for them.
  int64_t mask_cols = 0;
  bool causal = false;  // top-left: query i attends key j <= i
  T scale = 1;
  StridedView<T, 4> out;  // (B, Hq, L, Ev), last dim contiguous
  // Optional attention probabilities, C-contiguous (B, Hq, L, S).
  T* weights = nullptr;
};

template <typename T>
void sdpa_forward(const SdpaArgs<T>& args);

template <typename T>
struct MhaArgs {
  int64_t num_heads = 1;
  StridedView<const T, 3> query;  // (N, L, E), last dim contiguous
  StridedView<const T, 3> key;    // (N, S, kdim), last dim contiguous
  StridedView<const T, 3> value;  // (N, S, vdim), last dim contiguous
  RowMajorView<const T> w_q, w_k, w_v;  // (E, E), (E, kdim), (E, vdim)
  const T* b_q = nullptr;  // (E) each, contiguous, optional
  const T* b_k = nullptr;
  const T* b_v = nullptr;
  const T* bias_k = nullptr;  // (E), appended as one more key, optional
  const T* bias_v = nullptr;
  bool add_zero_attn = false;  // append one all-zero key and value
  StridedView<const T, 4> static_k;  // (N, H, S_static, E/H): replaces projected keys
  StridedView<const T, 4> static_v;
  StridedView<const T, 4> masks[kMaxMasks];  // (N, H, L, S_src) additive
  bool causal = false;  // top-left over the S_src source keys
  RowMajorView<const T> w_out;  // (E_out, E)
  const T* b_out = nullptr;     // (E_out)
  StridedView<T, 3> out;  // (N, L, E_out), last dim contiguous
  // Optional, C-contiguous: (N, L, S') averaged over heads or (N, H, L, S').
  T* weights = nullptr;
  bool average_weights = true;
};

template <typename T>
void mha_forward(const MhaArgs<T>& args);

}  // namespace attnx
