// One decoding step of multi-head self-attention (see MhaStepArgs):
//
//   [Q K V] = rows . [w_q; w_k; w_v]^T + b      (B * T, 3E), as mha_forward
//   K, V -> the cache, after each sequence's length (in its element type)
//   A = sdpa(Q, cached K, V; bottom-right causal, per-sequence lengths)
//   out = A . w_out^T + b_out                    (heads concatenated)
//
// The attention runs in the cache's compute type (float64 for a float64
// cache, else float32), so that the cache is read in place; queries and the
// attention's output are converted where the projections' type differs.
#include <algorithm>
#include <atomic>
#include <new>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention/mha_shared.h"
#include "attention/narrowing.h"
#include "attention/step_faults.h"
#include "attnx/attention.h"

namespace attnx {
namespace {

using mha::Buffer;

std::atomic<int> g_failing_stage{0};

// Throws std::bad_alloc where a test asked the step to fail at `stage`.
void injected_fault(StepStage stage) {
  int expected = static_cast<int>(stage);
  if (g_failing_stage.load(std::memory_order_relaxed) == expected &&
      g_failing_stage.compare_exchange_strong(expected, 0))
    throw std::bad_alloc();
}

// n values of T into the cache's element type at dst (int8: quantized, its
// scale into *scale).
template <typename T>
void store_row(const T* src, int64_t n, CacheElement element, void* dst, float* scale) {
  switch (element) {
    case CacheElement::kInt8:
      *scale = quantize_int8(src, n, static_cast<int8_t*>(dst));
      break;
    case CacheElement::kFloat32:
      std::copy_n(src, n, static_cast<float*>(dst));
      break;
    case CacheElement::kFloat64:
      std::copy_n(src, n, static_cast<double*>(dst));
      break;
    case CacheElement::kFloat16:
      narrow_to_float16(src, n, static_cast<uint16_t*>(dst));
      break;
    case CacheElement::kBFloat16:
      narrow_to_bfloat16(src, n, static_cast<uint16_t*>(dst));
      break;
  }
}

size_t element_size(CacheElement element) {
  switch (element) {
    case CacheElement::kFloat64: return 8;
    case CacheElement::kFloat32: return 4;
    case CacheElement::kInt8: return 1;
    default: return 2;
  }
}

// (B, H, T, hd) view of the rows of a (B * T, row) buffer at column offset,
// with rows in the caller's order (see MhaStepArgs).
template <typename U>
StridedView<U, 4> step_heads(U* data, int64_t B, int64_t T, int64_t H, int64_t hd, int64_t row,
                             int64_t offset, bool batch_first) {
  StridedView<U, 4> v;
  v.data = data + offset;
  v.shape[0] = B, v.shape[1] = H, v.shape[2] = T, v.shape[3] = hd;
  v.stride[0] = batch_first ? T * row : row;
  v.stride[1] = hd;
  v.stride[2] = batch_first ? row : B * row;
  v.stride[3] = 1;
  return v;
}

// The cache as sdpa reads it, in the attention's type A.
template <typename A>
StoredView<A> cache_view(const CacheArrays& c, void* data, const float* scales, int64_t dim) {
  StoredView<A> v;
  const int64_t shape[4] = {c.batch, c.heads, c.max_len, dim};
  const int64_t stride[4] = {c.heads * c.max_len * dim, c.max_len * dim, dim, 1};
  const auto fill = [&](auto& view) {
    for (int d = 0; d < 4; ++d) {
      view.shape[d] = shape[d];
      view.stride[d] = shape[d] > 1 ? stride[d] : 0;
    }
  };
  switch (c.element) {
    case CacheElement::kFloat16:
    case CacheElement::kBFloat16:
      v.storage = c.element == CacheElement::kFloat16 ? Storage::kFloat16 : Storage::kBFloat16;
      v.bits.data = static_cast<const uint16_t*>(data);
      fill(v.bits);
      break;
    case CacheElement::kInt8:
      v.storage = Storage::kInt8;
      v.q8.data = static_cast<const int8_t*>(data);
      fill(v.q8);
      v.scales.data = scales;
      for (int d = 0; d < 3; ++d) {
        v.scales.shape[d] = shape[d];
        v.scales.stride[d] = shape[d] > 1 ? stride[d] / dim : 0;
      }
      break;
    default:
      v.native.data = static_cast<const A*>(data);
      fill(v.native);
      break;
  }
  return v;
}

// Attention of the new tokens' queries over the cache, in type A, into the
// (B * T, E) rows of `attn` (type T).
template <typename T, typename A>
void attend(const MhaStepArgs<T>& a, const T* qkv, const int64_t* key_lengths,
            const int64_t* query_lengths, T* attn) {
  const int64_t B = a.batch, Tn = a.tokens, E = a.params.w_q.rows, H = a.params.num_heads;
  const int64_t hd = E / H, N = B * Tn;
  Buffer<A> converted;
  const A* q_rows;
  A* out_rows;
  if constexpr (std::is_same_v<T, A>) {
    q_rows = qkv;
    out_rows = attn;
  } else {
    converted = Buffer<A>(size_t(2 * N * E));  // the queries, then the output
    A* q = converted.data();
    for (int64_t r = 0; r < N; ++r)
      for (int64_t e = 0; e < E; ++e) q[r * E + e] = static_cast<A>(qkv[r * 3 * E + e]);
    q_rows = q;
    out_rows = q + N * E;
  }
  SdpaArgs<A> s;
  const int64_t q_row = std::is_same_v<T, A> ? 3 * E : E;
  s.query = step_heads<const A>(q_rows, B, Tn, H, hd, q_row, 0, a.batch_first);
  s.key = cache_view<A>(a.cache, a.cache.key, a.cache.key_scales, hd);
  s.value = cache_view<A>(a.cache, a.cache.value, a.cache.value_scales, hd);
  s.mask_cols = a.cache.max_len;
  s.range.causal = true;
  s.range.bottom_right = true;
  s.range.key_lengths = key_lengths;
  s.range.query_lengths = query_lengths;
  s.scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(hd)));
  s.out = step_heads<A>(out_rows, B, Tn, H, hd, E, 0, a.batch_first);
  if constexpr (std::is_same_v<A, float>) s.precision = a.precision;
  sdpa_forward(s);
  if constexpr (!std::is_same_v<T, A>)
    for (int64_t x = 0; x < N * E; ++x) attn[x] = static_cast<T>(out_rows[x]);
}

}  // namespace

template <typename T>
void mha_step(const MhaStepArgs<T>& a) {
  const MhaParams<T>& p = a.params;
  const int64_t B = a.batch, Tn = a.tokens, E = p.w_q.rows, H = p.num_heads, hd = E / H;
  const int64_t N = B * Tn, E_out = p.w_out.rows;
  if (N == 0) return;

  // 1. Project the new tokens: q, k and v side by side in each row.
  Buffer<T> qkv(size_t(N * 3 * E));
  StridedView<const T, 3> rows;
  rows.shape[0] = 1, rows.shape[1] = N, rows.shape[2] = E;
  rows.stride[0] = 0, rows.stride[1] = a.rows.row_stride, rows.stride[2] = 1;
  rows.data = a.rows.data;
  mha::project_self(p, rows, qkv.data(), a.precision);

  // 2. The new keys and values after each sequence's length. The lengths
  // themselves change only at the end.
  std::vector<int64_t> query_lengths(size_t(B), Tn);
  std::vector<int64_t> key_lengths(static_cast<size_t>(B), 0);
  const size_t item = element_size(a.cache.element);
  for (int64_t b = 0; b < B; ++b) {
    if (a.new_lengths) query_lengths[size_t(b)] = a.new_lengths[b];
    const int64_t start = a.cache.lengths[b], n = query_lengths[size_t(b)];
    key_lengths[size_t(b)] = start + n;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = a.batch_first ? b * Tn + t : t * B + b;
        const int64_t row = (b * H + h) * a.cache.max_len + start + t, slot = row * hd;
        const bool q8 = a.cache.element == CacheElement::kInt8;
        store_row(qkv.data() + r * 3 * E + E + h * hd, hd, a.cache.element,
                  static_cast<char*>(a.cache.key) + slot * item,
                  q8 ? a.cache.key_scales + row : nullptr);
        store_row(qkv.data() + r * 3 * E + 2 * E + h * hd, hd, a.cache.element,
                  static_cast<char*>(a.cache.value) + slot * item,
                  q8 ? a.cache.value_scales + row : nullptr);
      }
  }

  // 3. Attend over the cache, heads concatenated in each row.
  injected_fault(StepStage::kAttention);
  Buffer<T> attn(size_t(N * E));
  if (a.cache.element == CacheElement::kFloat64)
    attend<T, double>(a, qkv.data(), key_lengths.data(), query_lengths.data(), attn.data());
  else
    attend<T, float>(a, qkv.data(), key_lengths.data(), query_lengths.data(), attn.data());

  // 4. Project out.
  injected_fault(StepStage::kOutputProjection);
  StridedView<T, 3> out = mha::rows_view(a.out, 1, N, E_out);
  linear_forward(mha::as_const(mha::rows_view(attn.data(), 1, N, E)), p.w_out, p.b_out, out,
                 Activation::kNone, a.precision, p.bf16_out);
  std::copy(key_lengths.begin(), key_lengths.end(), a.cache.lengths);
}

void fail_next_step_at(StepStage stage) { g_failing_stage.store(static_cast<int>(stage)); }

template void mha_step<float>(const MhaStepArgs<float>&);
template void mha_step<double>(const MhaStepArgs<double>&);

}  // namespace attnx
