// Narrowing of float32 / float64 values to 16-bit storage (IEEE binary16 and bfloat16), as
// NumPy writes them: `cache[...] = x` for a float16 cache (NumPy's own conversion) or a
// bfloat16 one (ml_dtypes). Every result is bit-for-bit NumPy's (checked with NumPy 2.4 and
// ml_dtypes 0.6 on x86-64, where NumPy converts in software, not with F16C):
//
//   float16, from float32 or float64: rounded once, to nearest even; magnitudes from the
//     half-way point above the largest finite value (65520) up become +-inf; subnormals and
//     signed zeros kept. A NaN keeps its sign and the top 10 bits of its significand (quiet
//     bit included, so a signalling NaN stays signalling, where F16C would make it quiet);
//     where those bits are all zero the lowest one is set, so that it stays a NaN
//     (0x7f800001 -> 0x7c01).
//   bfloat16, from float32: rounded to nearest even (the float32's top half); a NaN becomes
//     the quiet NaN 0x7fc0 with its sign (0xffc0), its payload dropped.
//   bfloat16, from float64: rounded to float32 first, then to bfloat16, as ml_dtypes does
//     (static_cast<float>): twice, so a float64 just above a bfloat16 half-way point may round
//     down where a single rounding would round up (1 + 2^-8 + 2^-30 -> 1.0).
//
// The float16 conversions and the float32 -> bfloat16 one are integer arithmetic on the bits,
// independent of the floating-point environment, like NumPy's and ml_dtypes'. The float64 ->
// float32 step of bfloat16 is the CPU's conversion, under the thread's rounding mode and
// flush-to-zero setting, as in ml_dtypes.
#pragma once

#include <cstdint>

namespace attnx {

// dst[i] = the binary16 bits of src[i], i in [0, n); n >= 0.
void narrow_to_float16(const float* src, int64_t n, uint16_t* dst);
void narrow_to_float16(const double* src, int64_t n, uint16_t* dst);
// dst[i] = the bfloat16 bits of src[i], i in [0, n); n >= 0.
void narrow_to_bfloat16(const float* src, int64_t n, uint16_t* dst);
void narrow_to_bfloat16(const double* src, int64_t n, uint16_t* dst);

// One row of an int8 cache, quantized symmetrically in one pass over x = float32(src[i]),
// i in [0, n): scale = max |x| / 127 (a float32 division), dst[i] = x / scale rounded to
// nearest even and clipped to [-127, 127]; the scale is returned. A row whose values are all
// zero, or so small that the scale is 0, gives scale 0 and zeros. A row holding a NaN or an
// infinity gives scale NaN and zeros: each of its elements then reads as NaN (0 * NaN), so
// that a non-finite input reaches the rows that attend it, as in a float cache.
float quantize_int8(const float* src, int64_t n, int8_t* dst);
float quantize_int8(const double* src, int64_t n, int8_t* dst);

}  // namespace attnx
