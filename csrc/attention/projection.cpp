// The linear layers of multi-head attention and of transformer layers:
// y = act(x . w^T + bias).
//
//   pack w^T in panels as wide as gemm_wide's tile   (in x wide each, zero-padded)
//   (for few rows, y^T = w . x^T instead, packing the small x^T: the steps
//   transpose_input, linear_transposed, transpose_output; for up to four,
//   dot products of each row with the rows of w)
//   parallel for each (batch, block of rows, panel):
//     y[rows, panel] = bias[panel]
//     for each block of k_block rows of `in` (L2-sized):
//       y[rows, panel] += x[rows, block] . panel[block]     (the kernel's gemm_wide)
//
// Packing makes each panel's rows contiguous, so the register-blocked gemm
// streams it while broadcasting x. Every output value is accumulated over
// `in` in the same order whatever the thread count.
#include <algorithm>
#include <type_traits>

#include "attention/cache_line_array.h"
#include "attention/projection.h"
#include "dispatch/parallel.h"
#include "kernels/bf16_table.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

// Rows of w per task where x has few rows; a multiple of every MR.
constexpr int64_t kRowBlock = 96;
// Rows of x per task where it has many (a multiple of every MR): each task
// brings a packed panel from the last-level cache into L2 once for all its
// row tiles, so blocks of 192 rows bring each panel in half as often as
// blocks of 96 (measurements: docs/tuning.md).
constexpr int64_t kManyRowBlock = 192;
// Beyond the few rows that linear_copies_input counts, y^T = w . x^T (w
// not packed) is still faster where w is large (at least
// kTransposedMinWeightBytes) and the rows few (at most w's bytes /
// kTransposedBytesPerRow, and kTransposedRowsMax): packing a large w is a
// pass over memory that few rows do not amortise. For smaller weights, or
// more rows, packing w pays for itself (measurements: docs/tuning.md).
// (Both forms give the same bits: the same sums in one order.)
constexpr int64_t kTransposedRowsMax = 256;
constexpr double kTransposedMinWeightBytes = 1 << 20;
constexpr double kTransposedBytesPerRow = 8192;
// Bytes of a packed panel's block of rows that the gemm keeps in L2 (half
// of the smallest L2 of the CPUs served, 512 KiB), and the fewest rows.
// Blocks sized for L1 (16 KiB) were slower with AVX-512: its 64-wide panel
// left each tile 64 values of a row of x, too short a stream for the
// prefetcher; AVX2 panels (16 wide) were as fast either way (measurements:
// docs/tuning.md).
constexpr int64_t kPanelBlockBytes = 256 * 1024;
constexpr int64_t kMinKBlock = 64;
// The transposes of the y^T = w . x^T form go in blocks of kTransposeBlock
// columns of their source, one task each, where they are large enough to
// share out: an element transposed costs about as much time as
// kTransposeWork multiply-adds. Done on the calling thread alone, they had
// left the other thread waiting for a noticeable part of a layer's time
// (measurements: docs/tuning.md).
constexpr int64_t kTransposeBlock = 64;
constexpr double kTransposeWork = 32;

// The distance between consecutive rows (n, l) of v in row-major order when
// they are evenly spaced, else -1 (a single row: 0).
template <typename U>
int64_t even_row_spacing(const StridedView<U, 3>& v) {
  const int64_t N = v.shape[0], L = v.shape[1];
  if (N * L <= 1) return 0;
  if (L == 1) return v.stride[0];
  if (N == 1 || v.stride[0] == L * v.stride[1]) return v.stride[1];
  return -1;
}

// `count` rows cut into `blocks` blocks (a multiple of `shares`), shared out
// as consecutive blocks to `shares` threads (the shares parallel_for
// starts from): each thread's share covers the same
// number of rows to the row, and within a share the blocks start at
// multiples of kBlockAlign rows from its start (whole register tiles of 6
// or 12 rows). Shares cut at multiples of 12 overall had left one of two
// threads waiting: 1024 rows as 504 and 520; 1024 rows of w in blocks of 96
// as 576 and 448 (measurements: docs/tuning.md).
struct EvenBlocks {
  static constexpr int64_t kBlockAlign = 12;
  int64_t count, blocks, shares;

  EvenBlocks(int64_t count_, int64_t block_rows, int64_t shares_) : count(count_), shares(shares_) {
    blocks = (count + block_rows - 1) / block_rows;
    blocks = (blocks + shares - 1) / shares * shares;
  }
  // The first row of `block`; begin(blocks) is count.
  int64_t begin(int64_t block) const {
    const int64_t per_share = blocks / shares;
    const int64_t share = block / per_share, i = block % per_share;
    const int64_t first = share * count / shares;
    const int64_t length = (share + 1) * count / shares - first;
    return first + i * length / per_share / kBlockAlign * kBlockAlign;
  }
};

// The rows (n, l) of x and y as `sequences` runs of `count` rows, each
// evenly spaced in x and in y: all N * L rows as one run where both arrays
// space them evenly (in the order (n, l)), else one run per n.
struct RowSequence {
  int64_t sequences = 0, count = 0;
  int64_t x_spacing = 0, y_spacing = 0;

  // Row r of run `sequence` of v (x or y).
  template <typename U>
  U* row(const StridedView<U, 3>& v, int64_t sequence, int64_t r) const {
    const int64_t L = v.shape[1];
    return sequences > 1 ? v.at(sequence, r) : v.at(r / L, r % L);
  }
};

template <typename T>
RowSequence row_sequence(const StridedView<const T, 3>& x, const StridedView<T, 3>& y) {
  const int64_t N = x.shape[0], L = x.shape[1];
  const int64_t xs = even_row_spacing(x), ys = even_row_spacing(y);
  if (!x.batch_offsets && !y.batch_offsets && xs >= 0 && ys >= 0) return RowSequence{1, N * L, xs, ys};
  return RowSequence{N, L, x.stride[1], y.stride[1]};
}

// `rows` rows of `cols` float32 values, row r read at row(r), rounded to
// bfloat16 values into a copy (rows cols apart): the operands of float32
// products (Bf16Products::kFloat).
template <typename Row>
CacheLineArray<float> rounded_copy(int64_t rows, int64_t cols, const Row& row) {
  const Bf16KernelTable& kt16 = active_bf16_kernels();
  CacheLineArray<float> copy = cache_line_array<float>(size_t(std::max<int64_t>(1, rows * cols)));
  parallel_for(rows, threads_for(kTransposeWork * double(rows) * double(cols)), [&](int64_t r) {
    float* dst = copy.get() + r * cols;
    std::copy_n(row(r), cols, dst);
    kt16.round_in_place(dst, cols);
  });
  return copy;
}

// y = act(x . w^T + bias) with bfloat16 products: x's rows rounded into
// rows of pairs, w packed (or `packed`), then the tiles of the bfloat16
// table's gemm over blocks of rows and panels, as the float32 form's.
void linear_bf16(const StridedView<const float, 3>& x, const RowMajorView<const float>& w,
                 const float* bias, const StridedView<float, 3>& y, Activation act,
                 const Bf16Weights* packed) {
  const KernelTable<float>& kt = active_kernels(float());
  const Bf16KernelTable& kt16 = active_bf16_kernels();
  Bf16Weights own;
  if (!packed) own = pack_bf16_weights(w), packed = &own;
  const int64_t N = x.shape[0], L = x.shape[1], in = x.shape[2], out = w.rows;
  const int64_t rows = N * L, pairs = packed->pairs, width = packed->width;
  const int nthreads = threads_for(double(rows) * double(in) * double(out));

  if (packed->float_products()) {
    // float32 products: x's rows rounded into a copy, then the float32 form
    // on the rounded operands.
    const CacheLineArray<float> x_rounded =
        rounded_copy(rows, in, [&](int64_t r) { return x.at(r / L, r % L); });
    StridedView<const float, 3> xr;
    xr.data = x_rounded.get();
    xr.shape[0] = N, xr.shape[1] = L, xr.shape[2] = in;
    xr.stride[0] = L * in, xr.stride[1] = in, xr.stride[2] = 1;
    linear_forward(xr, packed->rounded_rows(), bias, y, act);
    return;
  }

  // x's rows as pairs, zero past `in`.
  const CacheLineArray<uint32_t> x_pairs = cache_line_array<uint32_t>(size_t(rows * pairs));
  parallel_for(rows, threads_for(kTransposeWork * double(rows) * double(in)),
               [&](int64_t r) {
                 uint16_t* dst = reinterpret_cast<uint16_t*>(x_pairs.get() + r * pairs);
                 kt16.round(x.at(r / L, r % L), in, dst);
                 if (in % 2) dst[in] = 0;
               });

  // y's rows as runs evenly spaced (see RowSequence): x's pairs are.
  const int64_t ys = even_row_spacing(y);
  const RowSequence rows_of = ys >= 0 && !y.batch_offsets
                                  ? RowSequence{1, rows, pairs, ys}
                                  : RowSequence{N, L, pairs, y.stride[1]};
  const int64_t panels = (out + width - 1) / width;
  const int64_t k_block = std::min(
      pairs,
      std::max<int64_t>(kMinKBlock / 2, kPanelBlockBytes / int64_t(width * 4) / 8 * 8));
  const EvenBlocks blocks(rows_of.count, kManyRowBlock, rows_of.sequences == 1 ? nthreads : 1);
  const int64_t row_blocks = blocks.blocks;
  parallel_for(rows_of.sequences * row_blocks * panels, nthreads,
               [&](int64_t t) {
                 const int64_t p = t % panels, sb = t / panels;
                 const int64_t sequence = sb / row_blocks, block = sb % row_blocks;
                 const int64_t r0 = blocks.begin(block), n = blocks.begin(block + 1) - r0;
                 if (n <= 0) return;
                 const int64_t cols = std::min(width, out - p * width);
                 const uint32_t* x_rows = x_pairs.get() + (sequence * rows_of.count + r0) * pairs;
                 float* y_tile = rows_of.row(y, sequence, r0) + p * width;
                 for (int64_t k0 = 0; k0 < pairs; k0 += k_block) {
                   const GemmInit init = k0 > 0 ? GemmInit::kAddSum
                                         : bias ? GemmInit::kBiasColumns
                                                : GemmInit::kZero;
                   kt16.gemm_wide(n, cols, std::min(k_block, pairs - k0), x_rows + k0, pairs, 1,
                             packed->panel(p) + k0 * width, width, y_tile, rows_of.y_spacing,
                             init, bias ? bias + p * width : nullptr);
                 }
                 if (act != Activation::kNone)
                   kt.activate(y_tile, n, rows_of.y_spacing, cols, act);
               });
}

}  // namespace

Bf16Weights pack_bf16_weights(const RowMajorView<const float>& w) {
  const Bf16KernelTable& kt16 = active_bf16_kernels();
  Bf16Weights packed;
  packed.rows = w.rows, packed.cols = w.cols;
  if (bf16_products() == Bf16Products::kFloat) {
    packed.rounded = rounded_copy(w.rows, w.cols, [&](int64_t r) { return w.row(r); });
    packed.rounded_begin = packed.rounded.get();
    return packed;
  }
  packed.width = kt16.wide_panel_width;
  packed.pairs = (w.cols + 1) / 2;
  const int64_t panels = (w.rows + packed.width - 1) / packed.width;
  packed.data = cache_line_array<uint32_t>(size_t(std::max<int64_t>(1, panels * packed.pairs * packed.width)));
  packed.panels_begin = packed.data.get();
  parallel_for(panels, threads_for(double(w.rows) * double(w.cols) * 8),
               [&](int64_t p) {
                 uint32_t* dst = packed.data.get() + p * packed.pairs * packed.width;
                 const int64_t cols = std::min(packed.width, w.rows - p * packed.width);
                 if (cols < packed.width) std::fill_n(dst, packed.pairs * packed.width, 0u);
                 kt16.pack_pairs(w.row(p * packed.width), 1, w.row_stride, w.cols, cols, 1.0f,
                                 dst, packed.width);
               });
  return packed;
}

bool bf16_weight_rows(const Bf16Weights& w, int64_t r0, int64_t n, Bf16Weights& view) {
  view.rows = n, view.cols = w.cols, view.width = w.width, view.pairs = w.pairs;
  if (w.float_products()) {
    view.rounded_begin = w.rounded_begin + r0 * w.cols;
    return true;
  }
  if (r0 % w.width != 0) return false;
  view.panels_begin = w.panel(r0 / w.width);
  return true;
}

template <typename T>
bool linear_copies_input(int64_t rows) {
  return rows <= active_kernels(T()).panel_width;
}

template <typename T>
bool linear_transposes(int64_t rows, int64_t out, int64_t in) {
  const double w_bytes = double(out) * double(in) * sizeof(T);
  const bool transposed_pays = w_bytes >= kTransposedMinWeightBytes &&
                               rows <= kTransposedRowsMax &&
                               double(rows) * kTransposedBytesPerRow <= w_bytes;
  return rows > kDotRowsMax && (linear_copies_input<T>(rows) || transposed_pays);
}

template <typename T>
int64_t transposed_lanes(int64_t rows) {
  const int64_t w = active_kernels(T()).vector_width;
  return (rows + w - 1) / w * w;
}

template <typename T>
void transpose_input(const StridedView<const T, 3>& x, int64_t lanes, T* xt) {
  const KernelTable<T>& kt = active_kernels(T());
  const int64_t L = x.shape[1], rows = x.shape[0] * L, in = x.shape[2];
  const int64_t spacing = even_row_spacing(x);
  if (spacing >= 0) {
    // W x W blocks at a time in registers, in blocks of columns of x (rows
    // of xt), one task each.
    const int64_t blocks = (in + kTransposeBlock - 1) / kTransposeBlock;
    parallel_for(blocks, threads_for(kTransposeWork * double(rows) * double(in)),
                 [&](int64_t block) {
                   const int64_t c0 = block * kTransposeBlock;
                   kt.pack_transposed(x.data + c0, spacing, rows,
                                      std::min(kTransposeBlock, in - c0), T(1), xt + c0 * lanes,
                                      lanes);
                 });
    return;
  }
  std::fill_n(xt, in * lanes, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x.at(r / L, r % L);
    for (int64_t i = 0; i < in; ++i) xt[i * lanes + r] = xr[i];
  }
}

template <typename T>
void linear_transposed(const RowMajorView<const T>& w, const T* bias, const T* xt, int64_t lanes,
                       T* yt, Activation act) {
  // Blocks of kRowBlock rows of w (and of y^T), one task each: with few
  // rows of x, reading w is most of the work, and every thread reads its
  // share. The bias starts each row of y^T.
  const KernelTable<T>& kt = active_kernels(T());
  const int nthreads = threads_for(double(w.rows) * double(w.cols) * double(lanes));
  const EvenBlocks blocks(w.rows, kRowBlock, nthreads);
  // As many lanes as gemm_wide's panel: its wider tile loads less per
  // multiply-add (the sums go in the same order either way).
  const auto gemm = lanes >= kt.wide_panel_width ? kt.gemm_wide : kt.gemm;
  parallel_for(blocks.blocks, nthreads, [&](int64_t block) {
    const int64_t m0 = blocks.begin(block), rows = blocks.begin(block + 1) - m0;
    if (rows <= 0) return;
    gemm(rows, lanes, w.cols, w.row(m0), w.row_stride, 1, xt, lanes, yt + m0 * lanes, lanes,
         bias ? GemmInit::kBiasRows : GemmInit::kZero, bias ? bias + m0 : nullptr);
    if (act != Activation::kNone) kt.activate(yt + m0 * lanes, rows, lanes, lanes, act);
  });
}

template <typename T>
void transpose_output(const T* yt, int64_t lanes, const StridedView<T, 3>& y) {
  const KernelTable<T>& kt = active_kernels(T());
  const int64_t L = y.shape[1], rows = y.shape[0] * L, out = y.shape[2];
  if (out % kt.vector_width == 0 && (rows == 1 || even_row_spacing(y) == out)) {
    // Rows of whole vectors laid end to end: straight into y, in blocks of
    // its rows (columns of yt), one task each.
    const int64_t blocks = (rows + kTransposeBlock - 1) / kTransposeBlock;
    parallel_for(blocks, threads_for(kTransposeWork * double(rows) * double(out)),
                 [&](int64_t block) {
                   const int64_t r0 = block * kTransposeBlock;
                   kt.pack_transposed(yt + r0, lanes, out, std::min(kTransposeBlock, rows - r0),
                                      T(1), y.data + r0 * out, out);
                 });
    return;
  }
  const int64_t out_lanes = transposed_lanes<T>(out);
  const CacheLineArray<T> y_rows = cache_line_array<T>(size_t(rows * out_lanes));
  kt.pack_transposed(yt, lanes, out, rows, T(1), y_rows.get(), out_lanes);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(y_rows.get() + r * out_lanes, out, y.at(r / L, r % L));
}

template <typename T>
void linear_forward(const StridedView<const T, 3>& x, const RowMajorView<const T>& w,
                    const T* bias, const StridedView<T, 3>& y, Activation act,
                    Precision precision, const Bf16Weights* packed) {
  const int64_t N = x.shape[0], L = x.shape[1], in = x.shape[2], out = w.rows;
  if (N == 0 || L == 0 || out == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    if (precision == Precision::kBFloat16) return linear_bf16(x, w, bias, y, act, packed);
  }
  const KernelTable<T>& kt = active_kernels(T());
  if (N * L <= kDotRowsMax) {
    // A few rows: dot products with the rows of w, read where they lie
    // once for all of them, in blocks of kRowBlock rows of w, one task each.
    const int rows = static_cast<int>(N * L);
    const T* x_rows[kDotRowsMax];
    for (int r = 0; r < rows; ++r) x_rows[r] = x.at(r / L, r % L);
    // The multiply-adds and the elements of w read (see
    // kStreamedElementWork): counted by multiply-adds alone, a one-token
    // layer's projections, reading megabytes of weights, had run on one
    // thread (measurements: docs/tuning.md).
    const int nthreads =
        threads_for((double(rows) + kStreamedElementWork) * double(in) * double(out));
    const EvenBlocks blocks(out, kRowBlock, nthreads);
    parallel_for(blocks.blocks, nthreads, [&](int64_t block) {
      const int64_t m0 = blocks.begin(block), n = blocks.begin(block + 1) - m0;
      if (n <= 0) return;
      T* y_rows[kDotRowsMax];
      for (int r = 0; r < rows; ++r) y_rows[r] = y.at(r / L, r % L) + m0;
      kt.dot_rows(x_rows, rows, w.row(m0), w.row_stride, n, in, y_rows);
      for (int r = 0; r < rows; ++r) {
        if (bias)
          for (int64_t m = 0; m < n; ++m) y_rows[r][m] += bias[m0 + m];
        if (act != Activation::kNone) kt.activate(y_rows[r], 1, n, n, act);
      }
    });
    return;
  }
  if (linear_transposes<T>(N * L, out, in)) {
    // Few rows (or not many, and a large w): y^T = w . x^T, packing the
    // small x^T (in x lanes) rather than w, then transposing the result back.
    const int64_t lanes = transposed_lanes<T>(N * L);
    const CacheLineArray<T> scratch = cache_line_array<T>(size_t((in + out) * lanes));
    T* xt = scratch.get();
    T* yt = xt + in * lanes;
    transpose_input(x, lanes, xt);
    linear_transposed(w, bias, xt, lanes, yt, act);
    transpose_output(yt, lanes, y);
    return;
  }
  // Many rows: panels as wide as gemm_wide's register tile, packed from w by
  // W x W transposes in registers.
  const int64_t wide = kt.wide_panel_width;
  const int64_t panels = (out + wide - 1) / wide;
  const CacheLineArray<T> panels_of_w = cache_line_array<T>(size_t(panels * in * wide));
  parallel_for(panels, threads_for(double(in) * double(out) * 8),
               [&](int64_t p) {
                 kt.pack_transposed(w.row(p * wide), w.row_stride, std::min(wide, out - p * wide),
                                    in, T(1), panels_of_w.get() + p * in * wide, wide);
               });

  // The sum over `in` goes in blocks of k_block rows of a panel (about
  // kPanelBlockBytes), so that the block stays in L2 while every row tile of
  // the task streams past it; each block adds to what the one before stored.
  // The accumulators are T throughout, so the result is the same to the bit
  // as one pass over `in`.
  const int64_t k_block = std::min(
      in, std::max<int64_t>(kMinKBlock, kPanelBlockBytes / int64_t(wide * sizeof(T)) / 16 * 16));
  // Where the rows of x and of y are evenly spaced in one order, a block of
  // rows may span several (n). Each run of rows is cut into blocks of about
  // kManyRowBlock rows; a single run into even shares of the threads (blocks
  // of 192 and a last one of 64 had left one of two cores 12% more rows).
  const RowSequence rows_of = row_sequence(x, y);
  const int nthreads = threads_for(double(N) * double(L) * double(in) * double(out));
  const EvenBlocks blocks(rows_of.count, kManyRowBlock, rows_of.sequences == 1 ? nthreads : 1);
  const int64_t row_blocks = blocks.blocks;
  const auto block_start = [&](int64_t block) { return blocks.begin(block); };
  const int64_t tasks = rows_of.sequences * row_blocks * panels;
  // Each thread's share is its rows (parallel_for): a thread done with its
  // own takes the end of another's, which a static schedule left to a core
  // that another process had slowed (measurements: docs/tuning.md).
  parallel_for(tasks, nthreads, [&](int64_t t) {
    const int64_t p = t % panels, sb = t / panels;
    const int64_t sequence = sb / row_blocks, block = sb % row_blocks;
    const int64_t r0 = block_start(block), rows = block_start(block + 1) - r0;
    if (rows <= 0) return;
    const int64_t cols = std::min(wide, out - p * wide);
    const T* panel = panels_of_w.get() + p * in * wide;
    const T* x_rows = rows_of.row(x, sequence, r0);
    T* y_tile = rows_of.row(y, sequence, r0) + p * wide;
    for (int64_t k0 = 0; k0 < in; k0 += k_block) {
      const GemmInit init = k0 > 0 ? GemmInit::kAddSum
                            : bias ? GemmInit::kBiasColumns
                                   : GemmInit::kZero;
      kt.gemm_wide(rows, cols, std::min(k_block, in - k0), x_rows + k0, rows_of.x_spacing, 1,
                   panel + k0 * wide, wide, y_tile, rows_of.y_spacing, init,
                   bias ? bias + p * wide : nullptr);
    }
    if (act != Activation::kNone) kt.activate(y_tile, rows, rows_of.y_spacing, cols, act);
  });
}

template bool linear_copies_input<float>(int64_t);
template bool linear_copies_input<double>(int64_t);
template bool linear_transposes<float>(int64_t, int64_t, int64_t);
template bool linear_transposes<double>(int64_t, int64_t, int64_t);
template int64_t transposed_lanes<float>(int64_t);
template int64_t transposed_lanes<double>(int64_t);
template void transpose_input<float>(const StridedView<const float, 3>&, int64_t, float*);
template void transpose_input<double>(const StridedView<const double, 3>&, int64_t, double*);
template void linear_transposed<float>(const RowMajorView<const float>&, const float*,
                                       const float*, int64_t, float*, Activation);
template void linear_transposed<double>(const RowMajorView<const double>&, const double*,
                                        const double*, int64_t, double*, Activation);
template void transpose_output<float>(const float*, int64_t, const StridedView<float, 3>&);
template void transpose_output<double>(const double*, int64_t, const StridedView<double, 3>&);
template void linear_forward<float>(const StridedView<const float, 3>&,
                                    const RowMajorView<const float>&, const float*,
                                    const StridedView<float, 3>&, Activation, Precision,
                                    const Bf16Weights*);
template void linear_forward<double>(const StridedView<const double, 3>&,
                                     const RowMajorView<const double>&, const double*,
                                     const StridedView<double, 3>&, Activation, Precision,
                                     const Bf16Weights*);

}  // namespace attnx
