// The layers of torch's nn.Transformer family, each computed in one call:
// self-attention (and, in decoder layers, cross-attention over a memory) and
// the feed-forward block, each with its residual sum and layer norm.
//
//   post-norm (norm_first false):  x = norm1(x + sa(x))
//                                  x = norm2(x + ca(x, memory))   (decoder)
//                                  x = normk(x + ff(x))
//   pre-norm (norm_first true):    x = x + sa(norm1(x))
//                                  x = x + ca(norm2(x), memory)   (decoder)
//                                  x = x + ff(normk(x))
//   ff(x) = linear2(act(linear1(x)))
//
// Callers (the bindings) guarantee the shapes and layouts written on each
// field.
#pragma once

#include <cstdint>
#include <functional>

#include "attnx/activation.h"
#include "attnx/attention.h"

namespace attnx {

// A layer norm over the last dim: weight and bias (E) contiguous, each
// optional (1 and 0).
template <typename T>
struct LayerNormParams {
  const T* weight = nullptr;
  const T* bias = nullptr;
  T eps = T(1e-5);
};

template <typename T>
struct FeedForwardParams {
  RowMajorView<const T> w1;  // (ff, E)
  const T* b1 = nullptr;     // (ff) or null
  RowMajorView<const T> w2;  // (E, ff)
  const T* b2 = nullptr;     // (E) or null
  Activation activation = Activation::kRelu;
};

template <typename T>
struct TransformerLayerParams {
  MhaParams<T> self_attn;   // self-attention: E in, E out
  MhaParams<T> cross_attn;  // decoder layers: queries E, keys and values the memory's E
  bool has_cross = false;
  FeedForwardParams<T> ff;
  const Bf16Weights* bf16_w1 = nullptr;  // ff.w1 and ff.w2 packed (see MhaParams)
  const Bf16Weights* bf16_w2 = nullptr;
  LayerNormParams<T> norms[3];  // norm1, norm2 (, norm3 in decoder layers)
  bool norm_first = false;
};

// The masks of one attention block: additive (N, H, L, S) views, absent
// where data is null, and the causal (top-left) rule.
template <typename T>
struct BlockMasks {
  StridedView<const T, 4> masks[kMaxMasks];
  bool causal = false;
};

template <typename T>
struct TransformerLayerArgs {
  TransformerLayerParams<T> params;
  StridedView<const T, 3> x;       // (N, L, E), last dim contiguous
  StridedView<const T, 3> memory;  // decoder layers: (N, S, E), last dim contiguous
  BlockMasks<T> self_masks, cross_masks;
  // Padding-free rows: where x_rows is present, x and out are (1, total, E),
  // the real tokens of x_rows.count sequences end to end (no masks then; the
  // causal rules hold within each sequence). The memory is then either
  // packed likewise (memory_rows: (1, total_memory, E)) or (N, S, E).
  PackedRows x_rows, memory_rows;
  // Decoding: the self-attention is one step over this cache (mha_step:
  // bottom-right causal, the new keys and values appended, the lengths grown
  // when the step succeeds) and needs no masks; the cross-attention reads
  // the memory's keys and values as projected once, (N, H, S, E / H).
  const CacheArrays* self_cache = nullptr;
  StridedView<const T, 4> memory_keys, memory_values;
  // A layer norm applied to the layer's output (a stack's final norm).
  const LayerNormParams<T>* final_norm = nullptr;
  // Activation::kNone with this set: called on the calling thread with the
  // hidden rows of the feed-forward block, (rows, ff) contiguous, to be
  // activated in place.
  std::function<void(T* hidden, int64_t rows, int64_t cols)> activate;
  StridedView<T, 3> out;  // (N, L, E), last dim contiguous; may not overlap x
  Precision precision = Precision::kNative;  // of every product; kBFloat16: T = float only
};

template <typename T>
void transformer_layer_forward(const TransformerLayerArgs<T>& args);

}  // namespace attnx
