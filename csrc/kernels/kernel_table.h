// The micro-kernels the attention drivers are built from. Every instruction
// set fills one table of the same function-pointer type (kernels/<isa>/), and
// the dispatcher picks one table per dtype at import (dispatch/isa.cpp).
#pragma once

#include <cstdint>

#include "attnx/activation.h"
#include "attnx/runtime.h"

namespace attnx {

// How gemm initialises C before adding A.B.
enum class GemmInit {
  kZero,        // C = A.B
  kAccumulate,  // C += A.B
  kScaleRows,   // C = diag(init) C + A.B     (init: M values)
  kBiasColumns, // C = 1 init^T + A.B         (init: N values)
  kBiasRows,    // C = init 1^T + A.B         (init: M values)
  kAddSum       // C += A.B, with A.B summed from zero and then added to C (a
                // sum over K in blocks: each block's rounding error grows
                // with its own length, not with the whole sum's)
};

// Cache lines that a kernel requests one per step of its main loop, from
// each of a few ranges, so that the misses of memory needed soon after it
// overlap its arithmetic. Asked for all at once, many lines stall the core
// as soon as its few outstanding misses are in use. A range covers rows
// `ld_bytes` apart, line k at first + (k / row_lines) * ld_bytes +
// (k % row_lines) * 64, and the kernel requests k = begin, begin + 1, ...
// up to end. A request never faults, wherever it points; addresses are
// integers, so that no pointer is formed outside an array.
struct LineRange {
  uintptr_t first = 0;          // line 0's address
  int64_t ld_bytes = 0;         // between rows
  int64_t row_lines = 1;        // lines per row
  int64_t begin = 0, end = 0;   // the lines to request

  int64_t size() const { return end - begin; }
};
struct LineRequests {
  LineRange ranges[2];
};

// What block_state found in a block of a mask (bits; both for an empty block).
constexpr int kBlockAllZero = 1;    // every entry is 0 (or -0): adds nothing to a score
constexpr int kBlockAllClosed = 2;  // every entry is -inf: closes every key

// The rows of x that dot_rows takes through w at once.
constexpr int kDotRowsMax = 4;

// Independent vector chains of fma_probe: enough to hide a 4-cycle
// multiply-add latency at two issues per cycle.
constexpr int kFmaProbeChains = 12;

template <typename T>
struct KernelTable {
  const char* name;  // recipe, e.g. "f32_attention__avx512f_mr12_nr32"
  Isa isa;
  int vector_width;      // lanes of one vector
  int query_tile;        // queries per flash tile: the lanes of softmax_tile
  int panel_width;       // columns per gemm panel (pack B in panels this wide)
  int wide_panel_width;  // the same for gemm_wide
  int row_group;         // query rows the row kernels take through each key at once

  // C[m][n] = init + sum_k A(m, k) * B[k][n] for m < M, n < N, where
  // A(m, k) = a[m * a_row + k * a_col] (any layout: it is read by broadcasts)
  // and B is row-major with row stride ldb. C is row-major with row stride ldc.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const T* a, int64_t a_row, int64_t a_col,
               const T* b, int64_t ldb, T* c, int64_t ldc, GemmInit init, const T* init_values);

  // One online-softmax step over a score tile s of `rows` keys x query_tile
  // queries (row-major, row stride query_tile), for the first `lanes` query
  // lanes (a multiple of the vector width; the rest are left as they are),
  // per query lane q:
  //   m' = max(m, max_j s[j][q]); s[j][q] = exp(s[j][q] - m');
  //   alpha[q] = exp(m - m'); l = alpha l + sum_j s[j][q]; m = m'
  // with the rules of attention/softmax_rules.h for -inf and NaN. Per key
  // row, it requests the next line of each range of `ahead`, while any is left.
  void (*softmax_tile)(T* s, int64_t rows, int lanes, T* m, T* l, T* alpha,
                       const LineRequests& ahead);
  // The masks' sums on a score tile laid out as softmax_tile's (keys x
  // lanes, row stride ld): s[j][q] += sums[j][q], or -inf where the sum is
  // -inf (a closed key, whatever its score), for j < keys and q < lanes (a
  // multiple of the vector width); closed[q] = the keys closed to lane q.
  void (*add_mask_sums)(T* s, const T* sums, int64_t keys, int64_t ld, int lanes, T* closed);

  // Row kernels, for few queries and for the weights path. With `stream`,
  // the rows are taken to come from memory, read once: they are prefetched a
  // few keys ahead of the reads.
  // Both take `rows` query rows through the keys together, each key or
  // value row read once for a few of them; a row's results are the same to
  // the bit whatever rows it comes with.
  // dst[r][j] = scale * <q[r], k_j> for r < rows, j < n_keys; key rows are
  // ldk apart.
  void (*scores)(const T* const* q, int rows, const T* k, int64_t ldk, int64_t n_keys,
                 int64_t dim, T scale, T* const* dst, bool stream);
  // acc[r][:dim] += sum_j p[r][j] * v_j over j < n_keys, for r < rows.
  void (*accumulate_pv)(const T* const* p, int rows, const T* v, int64_t ldv, int64_t n_keys,
                        int64_t dim, T* const* acc, bool stream);
  // x[j] = exp(x[j] - shift) in place; returns the sum of the new values.
  T (*exp_shift_sum)(T* x, int64_t n, T shift);
  // The largest of x[0..n), NaN ignored (attention/softmax_rules.h); -inf
  // where there is none.
  T (*row_max)(const T* x, int64_t n);
  // y[j] = alpha * x[j]; y may be x.
  void (*scale)(const T* x, int64_t n, T alpha, T* y);
  // x[r * ld + j] *= factors[j] for r < rows, j < cols (a multiple of the
  // vector width): a factor per column, as scale's per row.
  void (*scale_columns)(T* x, int64_t rows, int64_t ld, int64_t cols, const T* factors);
  // Soft-capped scores, from the scores divided by the cap: x[r * ld + j] =
  // cap * tanh(x[r * ld + j]) for r < rows, j < cols (any count), cap > 0.
  // NaN stays NaN, +-inf becomes +-cap.
  void (*softcap)(T* x, int64_t rows, int64_t ld, int64_t cols, T cap);
  // kBlockAllZero and / or kBlockAllClosed as they hold for the rows x cols
  // entries x[r * ld + c] (NaN is neither); 0 as soon as neither can.
  int (*block_state)(const T* x, int64_t ld, int64_t rows, int64_t cols);
  // Whether the rows x cols entries x[r * ld + c] hold no NaN or infinity.
  bool (*all_finite)(const T* x, int64_t ld, int64_t rows, int64_t cols);
  // y[r][j] = <x[r], w_j> for r < rows, j < n, with w's rows ldw apart and
  // dim elements each: the projection of a few rows, each row of w read once
  // for up to kDotRowsMax rows of x (and prefetched: it comes from memory).
  void (*dot_rows)(const T* const* x, int rows, const T* w, int64_t ldw, int64_t n, int64_t dim,
                   T* const* y);
  // dst[c * lanes + r] = scale * src[r * ld + c] for r < rows, c < cols, and
  // 0 for rows <= r < lanes; lanes is a multiple of the vector width.
  void (*pack_transposed)(const T* src, int64_t ld, int64_t rows, int64_t cols, T scale, T* dst,
                          int64_t lanes);
  // gemm with a register tile of half the rows and twice the width.
  void (*gemm_wide)(int64_t M, int64_t N, int64_t K, const T* a, int64_t a_row, int64_t a_col,
                    const T* b, int64_t ldb, T* c, int64_t ldc, GemmInit init,
                    const T* init_values);
  // kFmaProbeChains chains of vector multiply-adds held in registers,
  // `iterations` steps each, touching no memory: this instruction set's
  // arithmetic peak. Returns the chains' sum, so that the work stays.
  T (*fma_probe)(int64_t iterations);

  // Widening of 16-bit storage, in the float tables only (null in the double ones):
  // dst[i] = src[i] as float32, exactly: subnormals, infinities and NaN (quiet) included.
  // A NaN keeps its sign and payload and comes out quiet, so every ISA gives the same bits.
  // src and dst need no alignment beyond their element's; nothing past src[n-1] is read
  // and nothing past dst[n-1] is written.
  void (*widen_float16)(const uint16_t* src, int64_t n, float* dst);   // IEEE binary16
  void (*widen_bfloat16)(const uint16_t* src, int64_t n, float* dst);  // bfloat16 (top half of a float32)
  // dst[i] = scale * src[i]: an int8 row with its scale, as the int8 row kernels read it.
  void (*widen_int8)(const int8_t* src, int64_t n, T scale, T* dst);
  // scores and accumulate_pv with keys / values read straight from 16-bit
  // storage, widened in registers ([0] float16, [1] bfloat16; float tables only).
  void (*scores_16bit[2])(const T* const* q, int rows, const uint16_t* k, int64_t ldk,
                          int64_t n_keys, int64_t dim, T scale, T* const* dst, bool stream);
  void (*accumulate_pv_16bit[2])(const T* const* p, int rows, const uint16_t* v, int64_t ldv,
                                 int64_t n_keys, int64_t dim, T* const* acc, bool stream);
  // The same from int8 rows with a float32 scale per row (element j, i =
  // scales[j] * x[j][i]; float tables only): dst[r][j] = scale * (scales[j] *
  // <q[r], k_j>), and acc[r] += sum_j (p[r][j] * scales[j]) * v_j, the int8
  // values converted exactly in registers.
  void (*scores_int8)(const T* const* q, int rows, const int8_t* k, int64_t ldk,
                      const float* scales, int64_t n_keys, int64_t dim, T scale, T* const* dst,
                      bool stream);
  void (*accumulate_pv_int8)(const T* const* p, int rows, const int8_t* v, int64_t ldv,
                             const float* scales, int64_t n_keys, int64_t dim, T* const* acc,
                             bool stream);

  // Transformer layers.
  // x[r * ld + j] = kind(x[r * ld + j]) for r < rows, j < cols (any count).
  void (*activate)(T* x, int64_t rows, int64_t ld, int64_t cols, Activation kind);
  // One row of n values: s = x + y (x alone where y is null); sum_out = s
  // where given; out = (s - mean) / sqrt(var + eps) * weight + bias where
  // given, mean and (biased) variance over the row, weight and bias optional.
  // out may be x or y, and sum_out x.
  void (*add_layer_norm)(const T* x, const T* y, int64_t n, const T* weight, const T* bias,
                         T eps, T* sum_out, T* out);

  // scores and accumulate_pv (streamed) over rows listed one pointer each:
  // key or value j is rows[j], stored as T (stored = 0) or, in the float
  // tables, float16 (1), bfloat16 (2) or int8 with scales[j] (3); the rows
  // [n_keys, listed) are only asked for ahead. A paged cache's rows lie in
  // blocks: listed, a block of them is one call, read and asked for ahead
  // as a contiguous one is. The same bits as the strided kernels over the
  // same rows.
  void (*scores_listed)(const T* const* q, int rows, const void* const* k, const float* scales,
                        int stored, int64_t n_keys, int64_t listed, int64_t dim, T scale,
                        T* const* dst);
  void (*accumulate_pv_listed)(const T* const* p, int rows, const void* const* v,
                               const float* scales, int stored, int64_t n_keys, int64_t listed,
                               int64_t dim, T* const* acc);
};

const KernelTable<float>& scalar_kernels_f32();
const KernelTable<double>& scalar_kernels_f64();
#if defined(ATTNX_HAVE_X86_KERNELS)
const KernelTable<float>& avx2_kernels_f32();
const KernelTable<double>& avx2_kernels_f64();
const KernelTable<float>& avx512_kernels_f32();
const KernelTable<double>& avx512_kernels_f64();
#endif

// The tables chosen by the dispatcher.
const KernelTable<float>& active_kernels(float);
const KernelTable<double>& active_kernels(double);

}  // namespace attnx
