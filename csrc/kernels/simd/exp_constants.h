// Constants of the vector exp used by every kernel.
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
  // Below kUnderflow the result is 0 (and exp(-inf) is exactly 0, which the
  // masking rules need); above kOverflow it is +inf.
  static constexpr float kUnderflow = -0x1.5d589ep+6f;  // -87.33 ~ ln(FLT_MIN)
  static constexpr float kOverflow = 0x1.62e42ep+6f;    //  88.72 ~ ln(FLT_MAX)
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

}  // namespace attnx::simd
