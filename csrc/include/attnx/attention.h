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

// How keys and values are stored. A float32 call may read them as 16-bit
// floats, widened to float32 as each block is loaded: a float16 KV cache is
// then read at half the bytes and never copied.
enum class Storage : uint8_t { kNative, kFloat16, kBFloat16 };

// Keys or values, (B, H, S, D) with the last dim contiguous: elements of T,
// or 16-bit floats (T = float only).
template <typename T>
struct StoredView {
  StridedView<const T, 4> native;       // when storage == kNative
  StridedView<const uint16_t, 4> bits;  // otherwise
  Storage storage = Storage::kNative;

  static StoredView of(const StridedView<const T, 4>& v) {
    StoredView s;
    s.native = v;
    return s;
  }
  int64_t shape(int d) const { return storage == Storage::kNative ? native.shape[d] : bits.shape[d]; }
  int64_t stride(int d) const {
    return storage == Storage::kNative ? native.stride[d] : bits.stride[d];
  }
};

// Which keys a query row may attend, besides what the masks say. Row i of
// batch b may attend key j iff j < klen and, where set, the causal and window
// rules hold around its diagonal key i + d:
//   causal:        j <= i + d
//   window_left:   j >= i + d - window_left
//   window_right:  j <= i + d + window_right
// with d = 0 (top-left) or klen - qlen (bottom-right), klen = key_lengths[b]
// (or mask_cols) and qlen = query_lengths[b] (or L). Rows i >= qlen are
// padding: their output is zero. Keys at or past klen are never read.
struct KeyRange {
  bool causal = false;
  bool bottom_right = false;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  const int64_t* key_lengths = nullptr;    // (B), each in [0, S]; needs mask_cols == S
  const int64_t* query_lengths = nullptr;  // (B), each in [0, L]

  bool banded() const { return causal || window_left >= 0 || window_right >= 0; }
};

template <typename T>
struct SdpaArgs {
  StridedView<const T, 4> query;  // (B, Hq, L, E), last dim contiguous
  StoredView<T> key;    // (B, Hk, S, E)
  StoredView<T> value;  // (B, Hk, S, Ev); Hq % Hk == 0
  StridedView<const T, 4> masks[kMaxMasks];  // absent when data == nullptr
  // The masks and the key range cover keys [0, mask_cols). Keys past it
  // (the bias_k and zero-attention keys multi-head attention appends) are
  // always attended, as torch pads its masks with zeros for them.
  int64_t mask_cols = 0;
  KeyRange range;
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
  bool causal = false;        // over the S_src source keys
  bool bottom_right = false;  // causal diagonal: key i + S_src - L (else key i)
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
