// Constants of the vector exp and exp2 of the SIMD kernels (vec_exp.h).
//
// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 in [-ln2/2, ln2/2].
// ln2 is split in a high part with trailing zero bits (so n*ln2_hi is exact)
// and a low part, the classic Cody-Waite reduction. exp(r) is a Taylor
// polynomial: degree 7 for float (truncation error < 6e-9, under 0.1 ulp) and
// degree 13 for double (< 5e-18); results are within a few ulp of std::exp.
#pragma once

namespace attnx::simd {

template <typename T>
struct ExpConstants;

template <>
struct ExpConstants<float> {
  static constexpr float kLog2e = 0x1.715476p+0f;    // 1/ln2
  static constexpr float kLn2Hi = 0x1.62e400p-1f;    // ln2, top 15 bits
  static constexpr float kLn2Lo = 0x1.7f7d1cp-20f;   // ln2 - kLn2Hi
  // Below kUnderflow (about ln FLT_MIN) the result is 0: exp(-inf) is
  // exactly 0, which the masking rules need, and no result is subnormal (an
  // operation whose result underflows takes a microcode assist of hundreds
  // of cycles on Intel cores). Above kOverflow it is +inf.
  static constexpr float kUnderflow = -0x1.5d589ep+6f;  // -87.33 ~ ln(FLT_MIN)
  static constexpr float kOverflow = 0x1.62e42ep+6f;    //  88.72 ~ ln(FLT_MAX)
  // x is clamped to at most this (past kOverflow: +inf either way), so that
  // n = round(x / ln2) <= 130.
  static constexpr float kClampAbove = 90.0f;
  static constexpr int kDegree = 7;
  // 1/k! for k = 0..7
  static constexpr float kTaylor[8] = {1.0f, 1.0f, 0.5f, 0x1.555556p-3f, 0x1.555556p-5f,
                                       0x1.111112p-7f, 0x1.6c16c2p-10f, 0x1.a01a02p-13f};
};

template <>
struct ExpConstants<double> {
  static constexpr double kLog2e = 0x1.71547652b82fep+0;
  static constexpr double kLn2Hi = 0x1.62e42fee00000p-1;
  static constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
  static constexpr double kUnderflow = -0x1.6232bdd7abcd2p+9;  // -708.39 ~ ln(DBL_MIN)
  static constexpr double kOverflow = 0x1.62e42fefa39efp+9;    //  709.78 ~ ln(DBL_MAX)
  static constexpr double kClampAbove = 720.0;  // n <= 1039
  static constexpr int kDegree = 13;
  static constexpr double kTaylor[14] = {
      1.0,
      1.0,
      0.5,
      0x1.5555555555555p-3,   // 1/3!
      0x1.5555555555555p-5,   // 1/4!
      0x1.1111111111111p-7,   // 1/5!
      0x1.6c16c16c16c17p-10,  // 1/6!
      0x1.a01a01a01a01ap-13,  // 1/7!
      0x1.a01a01a01a01ap-16,  // 1/8!
      0x1.71de3a556c734p-19,  // 1/9!
      0x1.27e4fb7789f5cp-22,  // 1/10!
      0x1.ae64567f544e4p-26,  // 1/11!
      0x1.1eed8eff8d898p-29,  // 1/12!
      0x1.6124613a86d09p-33,  // 1/13!
  };
};

// 2^x = 2^n * 2^r, n = round(x), r = x - n in [-1/2, 1/2] (exact). 2^r is a
// polynomial: for float, degree 6 fitted on [-1/2, 1/2] (max relative error
// 1.6 ulp measured); for double, the Taylor series of e^(r ln2) to degree 13
// (truncation error < 5e-18). exp2 clamps x to [kClampBelow, kClampAbove],
// past the results 0 and +inf; 2^kMinExponent is the least normal number.
template <typename T>
struct Exp2Constants;

template <>
struct Exp2Constants<float> {
  static constexpr float kClampBelow = -160.0f, kClampAbove = 130.0f;
  static constexpr int kMinExponent = -126;
  static constexpr int kDegree = 6;
  static constexpr float kPoly[7] = {1.0f,           0x1.62e430p-1f, 0x1.ebfbdap-3f,
                                     0x1.c6aed6p-5f, 0x1.3b2dfep-7f, 0x1.5f44f0p-10f,
                                     0x1.41a6fep-13f};
};

template <>
struct Exp2Constants<double> {
  static constexpr double kClampBelow = -1100.0, kClampAbove = 1100.0;
  static constexpr int kMinExponent = -1022;
  static constexpr int kDegree = 13;
  static constexpr double kPoly[14] = {  // ln2^k / k!
      0x1.0000000000000p+0,  0x1.62e42fefa39efp-1, 0x1.ebfbdff82c58ep-3, 0x1.c6b08d704a0bfp-5,
      0x1.3b2ab6fba4e77p-7,  0x1.5d87fe78a6730p-10, 0x1.430912f86c786p-13, 0x1.ffcbfc588b0c5p-17,
      0x1.62c0223a5c822p-20, 0x1.b5253d395e7c1p-24, 0x1.e4cf5158b8ec7p-28, 0x1.e8cac7351bb22p-32,
      0x1.c3bd650fc2983p-36, 0x1.816193166d0f7p-40};
};

}  // namespace attnx::simd
