// The kernels of precision "int8": integer products of int8 operands with
// int32 sums, for int8 key and value caches. A query row is quantized once
// per call (quantize_int8, as a cache row is), a row's probabilities once per block of keys
// (inside accumulate_pv). The sums are exact, and every table takes the same
// float32 steps around them in the same order, so every table gives the same
// bits. Each instruction set fills one table (vpdpbusd where the CPU has
// AVX512_VNNI, else portable loops compiled with that instruction set's
// flags), and the dispatcher picks one at import (dispatch/isa.cpp).
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
};

const Int8KernelTable& scalar_int8_kernels();
#if defined(ATTNX_HAVE_X86_KERNELS)
const Int8KernelTable& avx2_int8_kernels();
const Int8KernelTable& avx512_int8_kernels();
#endif
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)  // built with -mavx512vnni too
const Int8KernelTable& avx512_vnni_int8_kernels();
#endif

// The table of the active level (the avx512_bf16 level, whose CPUs have
// AVX512_VNNI too: vpdpbusd).
const Int8KernelTable& active_int8_kernels();
// The table of a level, or null where this build has none. Whether the CPU
// runs it is the caller's to check (detect_cpu_isa).
const Int8KernelTable* int8_kernels_of(Isa level);

}  // namespace attnx
