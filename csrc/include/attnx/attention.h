// The numeric core of attnx: scaled dot-product attention and the full
// multi-head attention forward, on strided views, free of any Python.
//
// Callers (the bindings) guarantee the layout rules written on each field;
// shapes are checked again in the bindings so that no input crashes.
#pragma once

#include <cmath>
#include <cstdint>

#include "attnx/precision.h"
#include "attnx/strided_view.h"

namespace attnx {

// Masks are additive (0 = attend, -inf = masked, any float is added to the
// score), broadcast to (B, Hq, L, mask_cols) through their strides.
inline constexpr int kMaxMasks = 2;

// How keys and values are stored. A float32 call may read them as 16-bit
// floats, widened to float32 as each block is loaded: a float16 KV cache is
// then read at half the bytes and never copied. Or as int8 rows, each with
// its own float32 scale (element = scale * q), dequantized as loaded.
enum class Storage : uint8_t { kNative, kFloat16, kBFloat16, kInt8 };

// Keys and values kept in a pool of fixed-size blocks (a paged cache): batch
// b's row j lies in row j % block_size of block blocks[b * stride + j /
// block_size]. A StoredView with a block table has the shape (B, H, capacity,
// D), capacity the rows a table reaches, and its dim-0 stride (and its scales' dim-0 stride) steps
// from one block of the pool to the next; the bindings check that every
// entry a batch's key length reaches names a block of the pool.
struct BlockTable {
  const int32_t* blocks = nullptr;  // (B, stride)
  int64_t stride = 0;               // entries from one batch's table to the next
  int64_t block_size = 0;           // rows per block
  bool present() const { return blocks != nullptr; }
};

// Keys or values, (B, H, S, D) with the last dim contiguous: elements of T,
// 16-bit floats or int8 with a scale per row (T = float only); in place, or
// in the blocks of a pool (paged).
template <typename T>
struct StoredView {
  StridedView<const T, 4> native;       // when storage == kNative
  StridedView<const uint16_t, 4> bits;  // kFloat16, kBFloat16
  StridedView<const int8_t, 4> q8;      // kInt8
  StridedView<const float, 3> scales;   // kInt8: (B, H, S), row j's scale
  Storage storage = Storage::kNative;
  BlockTable paged;  // present: rows in a pool's blocks (see BlockTable)

  static StoredView of(const StridedView<const T, 4>& v) {
    StoredView s;
    s.native = v;
    return s;
  }
  int64_t shape(int d) const {
    return storage == Storage::kNative ? native.shape[d]
           : storage == Storage::kInt8 ? q8.shape[d]
                                       : bits.shape[d];
  }
  // In elements of the storage.
  int64_t stride(int d) const {
    return storage == Storage::kNative ? native.stride[d]
           : storage == Storage::kInt8 ? q8.stride[d]
                                       : bits.stride[d];
  }
  int element_size() const {
    return storage == Storage::kNative ? int(sizeof(T)) : storage == Storage::kInt8 ? 1 : 2;
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
// padding: their output is zero (packed: they are not there). Keys at or
// past klen are never read.
struct KeyRange {
  bool causal = false;
  bool bottom_right = false;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  const int64_t* key_lengths = nullptr;    // (B), each in [0, S]; needs mask_cols == S
  const int64_t* query_lengths = nullptr;  // (B), each in [0, L]
  // Packed sequences (varlen attention, the layers' padding-free rows): the
  // views reach batch b through batch_offsets, its rows laid end to end with
  // the next batch's, so its rows i >= qlen and keys j >= klen are another
  // sequence's (or lie past the arrays): never read, never written.
  bool packed = false;

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
  // Soft-capped scores where > 0: s = softcap * tanh(s / softcap) after the
  // scale and before the masks and the key range, so a closed key stays closed.
  T softcap = 0;
  // Whether the soft cap's division is folded into the queries' scale (the
  // kernels' softcap takes s / softcap, saving a multiplication per score):
  // where scale / softcap stays well inside T's normal range, so that no
  // scaled query underflows to 0 (0 * inf is NaN where the reference has an
  // infinite score). A larger cap divides the scores instead.
  bool softcap_folded() const {
    const double folded = std::fabs(double(scale) / double(softcap));
    return softcap > 0 && (folded == 0 || (folded >= 0x1p-64 && folded <= 0x1p64));
  }
  // What the queries are multiplied by: the scale, divided by the soft cap
  // where it is folded.
  T query_scale() const {
    return softcap_folded() ? static_cast<T>(double(scale) / double(softcap)) : scale;
  }
  StridedView<T, 4> out;  // (B, Hq, L, Ev), last dim contiguous
  // Optional attention probabilities, C-contiguous (B, Hq, L, S). With
  // bfloat16 products they are the rounded probabilities P.V multiplied.
  T* weights = nullptr;
  Precision precision = Precision::kNative;  // kBFloat16: T = float only
};

template <typename T>
void sdpa_forward(const SdpaArgs<T>& args);

// The scores of scaled dot-product attention, taken at one stage on their
// way to the probabilities:
//   kQk          scale * Q K^T
//   kSoftcapped  after the soft cap (kQk without one)
//   kMasked      after the masks and the key range: the softmax's input,
//                closed entries -inf, the float masks added
//   kSoftmax     the probabilities; a row with no open key is zeros
// into `scores`, C-contiguous (B, Hq, L, S). The args' out is not written,
// and they hold no key or query lengths.
enum class ScoreStage : uint8_t { kQk, kSoftcapped, kMasked, kSoftmax };

template <typename T>
void sdpa_scores(const SdpaArgs<T>& args, ScoreStage stage, T* scores);

// A weight matrix packed for bfloat16 products (attention/projection.h).
struct Bf16Weights;

// The parameters of multi-head attention, as torch's module holds them.
template <typename T>
struct MhaParams {
  int64_t num_heads = 1;
  RowMajorView<const T> w_q, w_k, w_v;  // (E, E), (E, kdim), (E, vdim)
  const T* b_q = nullptr;  // (E) each, contiguous, optional
  const T* b_k = nullptr;
  const T* b_v = nullptr;
  const T* bias_k = nullptr;  // (E), appended as one more key, optional
  const T* bias_v = nullptr;
  bool add_zero_attn = false;  // append one all-zero key and value
  RowMajorView<const T> w_out;  // (E_out, E)
  const T* b_out = nullptr;     // (E_out)
  // The weights packed for bfloat16 products, kept by the caller from one
  // call to the next; null: packed by each call that needs them.
  const Bf16Weights* bf16_q = nullptr;
  const Bf16Weights* bf16_k = nullptr;
  const Bf16Weights* bf16_v = nullptr;
  const Bf16Weights* bf16_out = nullptr;
  // [w_q; w_k; w_v] packed as one matrix, where they are stacked(): the
  // self-attention's one product (bf16_q, bf16_k and bf16_v may view it).
  const Bf16Weights* bf16_qkv = nullptr;

  // Whether w_q, w_k, w_v (and their biases, if any) lie stacked in memory
  // as the rows of torch's in_proj_weight (3E, E), so that one product
  // projects all three.
  bool stacked() const {
    const int64_t E = w_q.rows;
    const bool weights = w_k.rows == E && w_v.rows == E && w_k.cols == w_q.cols &&
                         w_v.cols == w_q.cols && w_k.row_stride == w_q.row_stride &&
                         w_v.row_stride == w_q.row_stride && w_k.data == w_q.row(E) &&
                         w_v.data == w_q.row(2 * E);
    const bool biases = (!b_q && !b_k && !b_v) || (b_q && b_k == b_q + E && b_v == b_q + 2 * E);
    return weights && biases;
  }
};

// Sequences whose rows lie end to end in one array (the layers' padding-free
// rows): sequence b is rows [starts[b], starts[b] + lengths[b]). Order-
// preserving, so a causal rule over a sequence's rows is the causal rule of
// its real tokens.
struct PackedRows {
  int64_t count = 0;                  // sequences
  const int64_t* starts = nullptr;    // (count), nondecreasing
  const int64_t* lengths = nullptr;   // (count), each >= 0
  int64_t max_length = 0;             // the largest length
  bool present() const { return starts != nullptr; }
};

template <typename T>
struct MhaArgs : MhaParams<T> {
  StridedView<const T, 3> query;  // (N, L, E), last dim contiguous
  StridedView<const T, 3> key;    // (N, S, kdim), last dim contiguous
  StridedView<const T, 3> value;  // (N, S, vdim), last dim contiguous
  StridedView<const T, 4> static_k;  // (N, H, S_static, E/H): replaces projected keys
  StridedView<const T, 4> static_v;
  StridedView<const T, 4> masks[kMaxMasks];  // (N, H, L, S_src) additive
  bool causal = false;        // over the S_src source keys
  bool bottom_right = false;  // causal diagonal: key i + S_src - L (else key i)
  // Optional (N): batch n's keys are its first key_lengths[n] (the rest are
  // never read: a key padding mask of trailing padding); needs S' == S_src.
  const int64_t* key_lengths = nullptr;
  // Packed queries: query and out are (1, total, E), the rows of
  // query_rows.count = N sequences end to end. The keys and values are then
  // either packed likewise (key_rows: (1, total_k, kdim)) or (N, S, kdim).
  // Packed calls take no masks, static keys, appended keys or weights; the
  // causal rule is top-left within each sequence.
  PackedRows query_rows, key_rows;
  StridedView<T, 3> out;  // (N, L, E_out), last dim contiguous
  // Optional, C-contiguous: (N, L, S') averaged over heads or (N, H, L, S').
  T* weights = nullptr;
  bool average_weights = true;
  Precision precision = Precision::kNative;  // kBFloat16: T = float only
};

template <typename T>
void mha_forward(const MhaArgs<T>& args);

// The storage of a KV cache: keys (B, H, max_len, head_dim) and values (B,
// H, max_len, value_dim), C-contiguous, of one element type, and each
// sequence's length. int8 keys and values have a float32 scale per row:
// key_scales and value_scales (B, H, max_len), C-contiguous.
enum class CacheElement : uint8_t { kFloat32, kFloat64, kFloat16, kBFloat16, kInt8 };

struct CacheArrays {
  CacheElement element = CacheElement::kFloat32;
  void* key = nullptr;
  void* value = nullptr;
  float* key_scales = nullptr;    // kInt8 only
  float* value_scales = nullptr;  // kInt8 only
  int64_t batch = 0, heads = 0, max_len = 0, head_dim = 0, value_dim = 0;
  int64_t* lengths = nullptr;  // (batch), each in [0, max_len]
};

// One decoding step of multi-head self-attention: the new tokens' queries,
// keys and values projected as in mha_forward, the keys and values written
// after each sequence's length, the queries attending their sequence's
// cached keys up to themselves (bottom-right causal), the heads projected
// out. Rows are the new tokens in the caller's order: row r is token
// r / B of sequence r % B (batch_first: token r % T of sequence r / T).
// The projections and the output are in T; the attention in float64 for a
// float64 cache, else float32. The lengths grow only once every step has
// succeeded, so that a step that throws leaves the cache as it was.
template <typename T>
struct MhaStepArgs {
  MhaParams<T> params;     // self-attention: no bias_k / bias_v / zero attention
  RowMajorView<const T> rows;  // (B * T, E), contiguous rows
  int64_t batch = 0, tokens = 0;
  bool batch_first = false;
  const int64_t* new_lengths = nullptr;  // (B) valid new tokens, each in [0, T]; null: all T
  CacheArrays cache;  // heads = num_heads, head_dim = value_dim = E / num_heads
  T* out = nullptr;   // (B * T, E_out), C-contiguous, rows as `rows`
  Precision precision = Precision::kNative;  // kBFloat16: T = float only
};

template <typename T>
void mha_step(const MhaStepArgs<T>& args);

}  // namespace attnx
