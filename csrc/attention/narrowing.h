// Rounding float32 and float64 values to the 16-bit storage formats of a KV
// cache, as NumPy (float16) and ml_dtypes (bfloat16) round them.
#pragma once

#include <cstdint>

namespace attnx {

void narrow_to_float16(const float* src, int64_t n, uint16_t* dst);
void narrow_to_float16(const double* src, int64_t n, uint16_t* dst);
void narrow_to_bfloat16(const float* src, int64_t n, uint16_t* dst);
void narrow_to_bfloat16(const double* src, int64_t n, uint16_t* dst);

}  // namespace attnx
