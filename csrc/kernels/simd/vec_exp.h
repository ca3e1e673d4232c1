// The vector exponentials of the SIMD vector types (vec_avx2.h,
// vec_avx512.h), written once over the primitives each type provides:
//
//   set1, mul, sub, fmadd, fnmadd(a, b, c) = c - a b (one rounding)
//   max(a, b), min(a, b)    vmaxps / vminps: b where either is NaN
//   Mask, not_less(x, c)    the lanes where x >= c or either is NaN
//   round_nearest(x)        the nearest integer, ties to even
//   split_nearest(x, n, r)  n = round_nearest(x) and r = x - n (exact)
//   scale_where(keep, p, n) p 2^n (integral n, one rounding) in the lanes of
//                           keep, +0 in the others
//   scale(p, n)             p 2^n in every lane (where exp2 is used)
//   kZeroesByMask           whether a lane that a mask zeroes costs nothing
//                           (exp2_nonpositive's choice, below)
//   pow2(n)                 2^n from exponent bits (where kZeroesByMask is
//                           false): integral n from the least normal
//                           exponent less one, which gives +0, up to 0
//
// Each type's exp, exp2 and exp2_nonpositive call these templates: one
// algorithm for every SIMD kernel, its operations in one order (each fused
// multiply-add as written, never a multiply and an add), and exp2_nonpositive
// in one of two forms, by kZeroesByMask. The portable vector type
// (vec_portable.h) calls the C library's exp and exp2 lane by lane instead.
#pragma once

#include <cstddef>

#include "kernels/simd/exp_constants.h"

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

// c[0] + r (c[1] + r (... + r c[N-1])): Horner's rule in fused multiply-adds.
template <class Vec, size_t N>
typename Vec::V vector_polynomial(const typename Vec::T (&c)[N], typename Vec::V r) {
  typename Vec::V p = Vec::set1(c[N - 1]);
  for (int k = static_cast<int>(N) - 2; k >= 0; --k) p = Vec::fmadd(p, r, Vec::set1(c[k]));
  return p;
}

// e^x (see ExpConstants). Below kUnderflow (exp(-inf) among them) the result
// is an exact 0 by the mask, so that no scaling underflows; above, x is
// clamped so that 2^n stays within what scale_where takes, and an x past
// ln(max) scales to +inf like exp. NaN passes through the compare
// (unordered) and max and min (their second operand).
template <class Vec>
typename Vec::V vector_exp(typename Vec::V x) {
  using C = ExpConstants<typename Vec::T>;
  const typename Vec::Mask normal = Vec::not_less(x, Vec::set1(C::kUnderflow));
  x = Vec::max(Vec::set1(C::kUnderflow), x);
  x = Vec::min(Vec::set1(C::kClampAbove), x);
  const typename Vec::V n = Vec::round_nearest(Vec::mul(x, Vec::set1(C::kLog2e)));
  typename Vec::V r = Vec::fnmadd(n, Vec::set1(C::kLn2Hi), x);
  r = Vec::fnmadd(n, Vec::set1(C::kLn2Lo), r);
  return Vec::scale_where(normal, vector_polynomial<Vec>(C::kTaylor, r), n);
}

// 2^x (see Exp2Constants), x clamped so that n stays within what scale takes.
template <class Vec>
typename Vec::V vector_exp2(typename Vec::V x) {
  using C = Exp2Constants<typename Vec::T>;
  x = Vec::min(Vec::set1(C::kClampAbove), Vec::max(Vec::set1(C::kClampBelow), x));
  typename Vec::V n, r;
  Vec::split_nearest(x, n, r);
  return Vec::scale(vector_polynomial<Vec>(C::kPoly, r), n);
}

// 2^x for x <= 0 or NaN (which passes through): the online softmax's
// x = s - max. Results about 2^kMinExponent (the least normal number) and
// below may be 0: next to the row's largest term, 1, they weigh under
// 2^kMinExponent. Elsewhere equal to exp2.
//
// Where a mask zeroes lanes for free (kZeroesByMask), x < kMinExponent (a
// closed key's -inf among them) gives an exact 0 through a zeroing mask, and
// every other lane is at least 2^kMinExponent (n >= kMinExponent, and r >= 0
// where n = kMinExponent): no kept lane underflows. A scaling whose result
// underflows (to a subnormal or to 0) takes a microcode assist of hundreds
// of cycles on Intel cores, which the first key block of every query tile
// paid for its rescale factor (e^-inf) and every vector of a closed key for
// its probability; a lane the mask zeroes takes none, so those need no
// clamp. Nor is there a clamp above: scale_where needs none for x <= 0, and
// it would be one operation of about fifteen (measurements: docs/tuning.md).
//
// Elsewhere one clamp and one scale by exponent bits replace exp2's two of
// each: x <= kMinExponent - 1 (-inf included) gives n = kMinExponent - 1,
// whose 2^n from exponent bits is +0, and so do results below
// 2^(kMinExponent - 1/2).
template <class Vec>
typename Vec::V vector_exp2_nonpositive(typename Vec::V x) {
  using T = typename Vec::T;
  using C = Exp2Constants<T>;
  typename Vec::V n, r;
  if constexpr (Vec::kZeroesByMask) {
    const typename Vec::Mask normal = Vec::not_less(x, Vec::set1(T(C::kMinExponent)));  // NaN too
    Vec::split_nearest(x, n, r);
    return Vec::scale_where(normal, vector_polynomial<Vec>(C::kPoly, r), n);
  } else {
    x = Vec::max(Vec::set1(T(C::kMinExponent - 1)), x);  // a NaN x is kept
    Vec::split_nearest(x, n, r);
    return Vec::mul(vector_polynomial<Vec>(C::kPoly, r), Vec::pow2(n));
  }
}

}  // namespace
}  // namespace attnx::simd
