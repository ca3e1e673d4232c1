// The kernels of precision "bfloat16": products whose operands are rounded to
// bfloat16 and whose sums are float32. Operands travel as pairs: a uint32_t
// holds two bfloat16 values, element 2p in its low half and 2p + 1 in its
// high half (the layout of AVX512_BF16's vdpbf16ps). Each instruction set
// fills one table (native vdpbf16ps where the CPU has AVX512_BF16, else the
// same arithmetic emulated with float32 multiply-adds), and the dispatcher
// picks one at import (dispatch/isa.cpp).
#pragma once

#include <cstdint>

#include "kernels/kernel_table.h"

namespace attnx {

struct Bf16KernelTable {
  const char* name;  // recipe, e.g. "bf16_products__avx512bf16_mr12_nr32"
  Isa isa;           // the float32 kernels this table goes with
  bool native;       // vdpbf16ps (else emulated)
  int panel_width;   // columns of C per gemm panel (pack B in panels this wide)

  // C[m][n] = init + sum over pairs p < K2 of A(m, p) . B[p][n], for m < M,
  // n < N, where A(m, p) = a[m * a_row + p * a_col] and B[p] is a row of N
  // pairs, rows ldb pairs apart; C is float32, row-major, rows ldc apart.
  // A pair adds its high products first, then its low ones, each a float32
  // multiply-add of an exact product (vdpbf16ps's order and rounding), and
  // sums run over at most kSumRun elements before they are folded into C as
  // the float32 gemm does (GemmInit::kAddSum), so that every table gives the
  // same bits for operands and sums that are not subnormal.
  void (*gemm)(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t a_row,
               int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
               GemmInit init, const float* init_values);

  // Rounding to bfloat16, to nearest even, as vcvtneps2bf16: a subnormal
  // becomes a zero of its sign, a NaN a quiet NaN of its sign.
  // dst[i] = the bfloat16 bits of src[i], i < n.
  void (*round)(const float* src, int64_t n, uint16_t* dst);
  // x[i] = the bfloat16 nearest x[i] (the same rounding), as a float32.
  void (*round_in_place)(float* x, int64_t n);

  // Pairs from a K x N float32 matrix X(k, n) = src[k * ld_k + n * ld_n],
  // multiplied by `scale` and rounded:
  //   dst[p * ldd + n] = bf16(scale X(2p, n)) | bf16(scale X(2p + 1, n)) << 16
  // for p < (K + 1) / 2, n < N; the high half is 0 where 2p + 1 == K.
  // Either ld_k or ld_n may be 1 (rows of pairs from rows of X, or from its
  // columns: a transposing pack).
  void (*pack_pairs)(const float* src, int64_t ld_k, int64_t ld_n, int64_t K, int64_t N,
                     float scale, uint32_t* dst, int64_t ldd);

  // gemm with a register tile of fewer rows and more vectors (the float
  // gemm_wide's), for a wide B packed in panels of wide_panel_width: fewer
  // broadcasts of A per product. The same sums: the same bits. The emulated
  // tables, whose halves of A and B take registers of their own, have gemm
  // and panel_width here.
  int wide_panel_width;
  void (*gemm_wide)(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t a_row,
                    int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                    GemmInit init, const float* init_values);

  // The row path's products (decoding, sdpa_rows.cpp) over float32 keys and
  // values: the float32 table's scores_listed and accumulate_pv_listed
  // (KernelTable) over rows stored as float32, the same sums, with the
  // elements rounded to bfloat16 as they are loaded, by this table's
  // rounding. (16-bit and int8 elements are taken as stored: the float32
  // table's kernels.)
  void (*scores_rounded)(const float* const* q, int rows, const float* const* k, int64_t n_keys,
                         int64_t listed, int64_t dim, float scale, float* const* dst);
  void (*accumulate_pv_rounded)(const float* const* p, int rows, const float* const* v,
                                int64_t n_keys, int64_t listed, int64_t dim, float* const* acc);

  // The native table's peak: kFmaProbeChains chains of vdpbf16ps held in
  // registers, `iterations` steps each (two products a lane a step), as the
  // float tables' fma_probe; null in the emulated tables.
  float (*dot_probe)(int64_t iterations);

  // The row path's products over keys and values stored as bfloat16 (a
  // bfloat16 cache), read in place as pairs by vdpbf16ps; null in the
  // emulated tables. dst[r][j] = scale * <q[r], k_j> for the query rows q
  // as bfloat16 (rows [n_keys, listed) of k only asked for ahead), and
  // acc[r][:dim] += sum_j p[r][j] v_j for probabilities that are bfloat16
  // values (as float32), taken two keys a pair.
  void (*scores_bf16_rows)(const uint16_t* const* q, int rows, const uint16_t* const* k,
                           int64_t n_keys, int64_t listed, int64_t dim, float scale,
                           float* const* dst);
  void (*accumulate_pv_bf16_rows)(const float* const* p, int rows, const uint16_t* const* v,
                                  int64_t n_keys, int64_t listed, int64_t dim,
                                  float* const* acc);

  // The row path's scores over keys stored as bfloat16 where the products
  // run as float32 multiply-adds (Bf16Products::kFloat): each load of a key
  // row (32 elements on AVX-512, 16 on AVX2) widened at once as its even and
  // odd ones, against query rows split the same way (split_bf16_pairs). The
  // products of the float32 table's kernels, summed in another order. Null
  // where a table has none (those kernels serve).
  void (*scores_bf16_split)(const float* const* q, int rows, const uint16_t* const* k,
                            int64_t n_keys, int64_t listed, int64_t dim, float scale,
                            float* const* dst);
};

// The query row layout of scores_bf16_split: each whole 32 elements as their
// 16 even ones, then their 16 odd ones; the last dim % 32 in order.
// (Internal linkage: the kernels' files, built for other instruction sets,
// include this header too, and no copy may be merged with theirs.)
namespace {
inline void split_bf16_pairs(const float* src, int64_t dim, float* dst) {
  const int64_t whole = dim / 32 * 32;
  for (int64_t i = 0; i < whole; i += 32)
    for (int e = 0; e < 16; ++e) dst[i + e] = src[i + 2 * e], dst[i + 16 + e] = src[i + 2 * e + 1];
  for (int64_t i = whole; i < dim; ++i) dst[i] = src[i];
}
}  // namespace

// How the products of precision "bfloat16" run (decided once, on first use):
// as pairs on vdpbf16ps (the native table's gemm), where this CPU's
// instruction makes more products per second than its float32 multiply-adds
// (by kPairsPayRatio), or else as float32 multiply-adds of the rounded
// operands, on the float kernels: the emulation of the pairs costs two
// multiply-adds a pair and more, and some CPUs run vdpbf16ps slower than
// their multiply-adds (docs/tuning.md). ATTNX_BF16_PRODUCTS=pairs or =float
// sets it (pairs: on the active bfloat16 table, emulated or not).
enum class Bf16Products { kPairs, kFloat };
Bf16Products bf16_products();
constexpr double kPairsPayRatio = 1.25;

const Bf16KernelTable& scalar_bf16_kernels();
#if defined(ATTNX_HAVE_X86_KERNELS)
const Bf16KernelTable& avx2_bf16_kernels();
const Bf16KernelTable& avx512_bf16_kernels();  // emulated on AVX-512F
#endif
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)    // a compiler with -mavx512bf16
const Bf16KernelTable& avx512_native_bf16_kernels();  // vdpbf16ps
#endif

// The table chosen by the dispatcher for precision "bfloat16".
const Bf16KernelTable& active_bf16_kernels();
// The table of a level (kAvx512Bf16: the native one; below, that instruction
// set's emulation), or null where this build has none. Whether the CPU runs
// it is the caller's to check (detect_cpu_isa).
const Bf16KernelTable* bf16_kernels_of(Isa level);

}  // namespace attnx
