// GELU, x Phi(x), of the SIMD vector types, for the feed-forward block of
// transformer layers (torch's exact "gelu": 0.5 x (1 + erf(x / sqrt 2))),
// written once over the primitives each type provides (set1, sub, mul,
// fmadd, fnmadd, max, min, div, exp; see vec_exp.h).
//
// With a = |x| and h = Phi(-a) = erfc(a / sqrt 2) / 2 (at most 1/2),
// x Phi(x) = max(x, 0) - a h: x (1 - h) for x >= 0 and x h below. It holds
// its relative accuracy where Phi(x) is tiny, which 1 + erf(x / sqrt 2)
// loses, and needs no blend. erfc(z) = t exp(-z^2 + P(t)) with
// t = 1 / (1 + z / 2) and P of degree 9 (docs/tuning.md: the fit and its
// error): one division, one exponential, 13 multiply-adds.
//
// a is clamped to the largest finite value, so that +inf gives +inf rather
// than inf * 0; -inf gives NaN, as 0.5 x (1 + erf(x / sqrt 2)) does (an
// infinity is not silently zeroed): min(x, 0) * 0 is added, which is 0 for
// every other x. A NaN passes through max and min (their second operand)
// and stays NaN.
//
// double (and the portable type): the C library's erfc lane by lane, by the
// same formula.
#pragma once

#include <cmath>
#include <limits>

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

struct GeluConstantsF32 {
  // P(t) - ln 2: erfc(z) / 2 = t exp(-z^2 + P(t) - ln 2). P is a least-squares
  // fit of log(erfc(z) / t) + z^2 on z in [0, 10], reweighted towards its
  // largest errors (at most 4.6e-8).
  static constexpr float kP[10] = {
      -1.265441487882257f - 0.6931471805599453f, 0.9984939540479033f,
      0.3878836398877983f,   0.028451983155335245f, 0.01986448815712887f,
      -0.11606618633626806f, -0.6522359578726774f,  1.1232276109670165f,
      -0.6664494997153262f,  0.1422715015341061f};
  // t = 1 / (1 + a / (2 sqrt 2)), z = a / sqrt 2.
  static constexpr float kHalfOverSqrt2 = 0.35355339059327373f;
};

template <class Vec>
typename Vec::V vector_gelu_f32(typename Vec::V x) {
  using C = GeluConstantsF32;
  using V = typename Vec::V;
  const V zero = Vec::zero();
  const V a = Vec::min(Vec::set1(std::numeric_limits<float>::max()), Vec::max(Vec::sub(zero, x), x));
  const V t = Vec::div(Vec::set1(1.0f), Vec::fmadd(a, Vec::set1(C::kHalfOverSqrt2), Vec::set1(1.0f)));
  V p = Vec::set1(C::kP[9]);
  for (int k = 8; k >= 0; --k) p = Vec::fmadd(p, t, Vec::set1(C::kP[k]));
  // -z^2 + P(t) - ln 2, z^2 = a^2 / 2.
  const V h = Vec::mul(t, Vec::exp(Vec::fnmadd(Vec::mul(a, Vec::set1(0.5f)), a, p)));
  return Vec::fmadd(Vec::min(zero, x), zero, Vec::fnmadd(a, h, Vec::max(zero, x)));
}

// x Phi(x) by the C library's erfc, as vector_gelu_f32 computes it.
template <typename T>
T scalar_gelu(T x) {
  if (std::isnan(x)) return x;
  const T a = std::fmin(std::fabs(x), std::numeric_limits<T>::max());
  const T h = T(0.5) * std::erfc(a * T(0.70710678118654752440));
  return std::fmax(x, T(0)) - a * h + std::fmin(x, T(0)) * T(0);
}

// scalar_gelu lane by lane, through memory.
template <class Vec>
typename Vec::V lanewise_gelu(typename Vec::V x) {
  typename Vec::T lanes[Vec::W];
  Vec::store(lanes, x);
  for (auto& v : lanes) v = scalar_gelu(v);
  return Vec::load(lanes);
}

}  // namespace
}  // namespace attnx::simd
