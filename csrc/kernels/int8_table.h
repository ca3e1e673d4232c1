// The kernels of precision "int8": integer products of int8 operands with
// int32 sums, for int8 key and value caches. A query row is quantized once
// per call (quantize_int8, as a cache row is), a row's probabilities once
// per block of keys (inside accumulate_pv). The sums are exact, and every
// table takes the same float32 steps around them in the same order, so every
// table gives the same bits: vpdpbusd where the CPU has AVX512_VNNI,
// vpmaddubsw where it has AVX2 (simd/int8_avx2.h), else the scalar float32
// row kernels, on which the sums are exact too (simd/int8_kernels.h); the
// dispatcher picks one (dispatch/isa.cpp).
#pragma once

#include <cstdint>

#include "attnx/runtime.h"

namespace attnx {

// The keys one accumulate_pv call may take at most (a block of the row
// path): their quantized probabilities stay on the stack.
constexpr int64_t kInt8MaxBlock = 512;

struct Int8KernelTable {
  const char* name;  // recipe, e.g. "int8_products__avx512vnni"
  Isa isa;           // the float32 kernels this table goes with

  // dst[r][j] = (q_scales[r] * k_scales[j]) * float(sum_i q[r][i] * k_j[i])
  // for r < rows, j < n_keys: the int8 query rows q[r] (dim elements each,
  // in [-127, 127]) against the int8 key rows k[j], listed one pointer each;
  // rows [n_keys, listed) are only asked for ahead.
  void (*scores)(const int8_t* const* q, const float* q_scales, int rows, const int8_t* const* k,
                 const float* k_scales, int64_t n_keys, int64_t listed, int64_t dim,
                 float* const* dst);

  // acc[r][:dim] += P.V over the n_keys (<= kInt8MaxBlock) value rows v[j]
  // with their scales, for r < rows, with the probabilities quantized for
  // this block: per row r, w_j = p[r][j] * v_scales[j]; top = the largest w_j
  // (NaN ignored); where top > 0, p8_j = round-half-even(clamp(w_j * (127 /
  // top), 0, 127)) (w_j / top * 127 where 127 / top overflows; a NaN w_j
  // gives 0) and, per element d, acc[r][d] = fma(float(sum_j p8_j v_j[d]),
  // top / 127, acc[r][d]); a NaN w_j makes the row's acc NaN (as p * v would
  // in float32), and a row whose top is 0 takes nothing. Rows [n_keys,
  // listed) are only asked for ahead.
  void (*accumulate_pv)(const float* const* p, int rows, const int8_t* const* v,
                        const float* v_scales, int64_t n_keys, int64_t listed, int64_t dim,
                        float* const* acc);

  // quantize_int8 (attention/narrowing.h) of n float32 values on this
  // level's vectors, in the plain loops' steps (the same bits); null where
  // a table has none (the plain loops serve, vectorized by the compiler).
  float (*quantize)(const float* src, int64_t n, int8_t* dst);
};

const Int8KernelTable& scalar_int8_kernels();
// The same arithmetic as plain loops (any row length), which the tables on
// the float32 kernels take where those would not be exact.
const Int8KernelTable& portable_int8_kernels();
#if defined(ATTNX_HAVE_X86_KERNELS)
const Int8KernelTable& avx2_int8_kernels();
#endif
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)  // built with -mavx512vnni too
// Runs on AVX512_VNNI alone: it uses no AVX512_BF16 instruction.
const Int8KernelTable& avx512_vnni_int8_kernels();
#endif
// Whether this CPU has AVX512_VNNI (and the AVX-512 level).
bool cpu_has_avx512_vnni();

// The table of a level on this CPU: vpdpbusd at the AVX-512 levels where the
// CPU has AVX512_VNNI (Cascade Lake and Ice Lake have it without
// AVX512_BF16), else AVX2's vpmaddubsw (at the AVX-512 levels too), the
// scalar float32 kernels' at the scalar level; null where this build has
// none.
const Int8KernelTable* int8_kernels_of(Isa level);
// The table of the active level.
const Int8KernelTable& active_int8_kernels();

}  // namespace attnx
