// The hyperbolic tangent of the SIMD vector types, for soft-capped scores
// (c tanh(s / c)), written once over the primitives each type provides
// (set1, mul, fmadd, min, max, div; see vec_exp.h).
//
// float: tanh(y) = y P(y^2) / Q(y^2) on y clamped to [-9, 9], P of degree 4
// and Q of degree 4 in y^2: 10 multiply-adds and one division, no branch and
// no blend, where 1 - 2 / (e^2y + 1) costs an exponential and loses the
// relative accuracy of small y. Past |y| = 9, tanh(y) rounds to +-1 in float;
// a NaN passes through max and min (their second operand). Within a few
// units in the last place of tanh (docs/tuning.md: the fit, its error and
// its cost).
//
// double: the C library's tanh lane by lane, as the portable vector type
// (vec_portable.h) does for both: a rational of double accuracy over the
// range would take some 20 terms, and float64 is the accurate dtype, not the
// fast one.
#pragma once

#include <cmath>

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set, and no
// copy of it may be merged with another built for a different one.
namespace {

struct TanhConstantsF32 {
  static constexpr float kClamp = 9.0f;
  // y P(t) / Q(t), t = y^2: a least-squares fit of the relative error on
  // [0, 9], reweighted towards its largest errors.
  static constexpr float kP[5] = {0.9999999795511254f, 0.1338105182919811f,
                                  0.0034956188266313344f, 2.0609572918938452e-05f,
                                  1.3355315911619607e-08f};
  static constexpr float kQ[5] = {1.0f, 0.46714367455903577f, 0.02587710001004676f,
                                  0.0003285684378827158f, 7.776831423504259e-07f};
};

// c tanh(y): the factor c is taken into P's coefficients (c p_k, rounded
// once each), a multiplication fewer per vector. y P reaches about 400 c at
// the clamp, so a cap past 2^100 (one that caps no float score a model
// makes) multiplies tanh(y) instead, rather than overflow.
template <class Vec>
typename Vec::V vector_tanh_times_f32(typename Vec::V y, float c) {
  using C = TanhConstantsF32;
  if (!(c <= 0x1p100f)) return Vec::mul(vector_tanh_times_f32<Vec>(y, 1.0f), Vec::set1(c));
  y = Vec::max(Vec::set1(-C::kClamp), y);
  y = Vec::min(Vec::set1(C::kClamp), y);
  const typename Vec::V t = Vec::mul(y, y);
  typename Vec::V p = Vec::set1(c * C::kP[4]), q = Vec::set1(C::kQ[4]);
  for (int k = 3; k >= 0; --k) {
    p = Vec::fmadd(p, t, Vec::set1(c * C::kP[k]));
    q = Vec::fmadd(q, t, Vec::set1(C::kQ[k]));
  }
  return Vec::div(Vec::mul(y, p), q);
}

// c tanh(y) lane by lane, through memory.
template <class Vec>
typename Vec::V lanewise_tanh_times(typename Vec::V y, typename Vec::T c) {
  typename Vec::T lanes[Vec::W];
  Vec::store(lanes, y);
  for (auto& x : lanes) x = c * std::tanh(x);
  return Vec::load(lanes);
}

}  // namespace
}  // namespace attnx::simd
