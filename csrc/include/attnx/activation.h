// The activations of a transformer layer's feed-forward block.
#pragma once

#include <cstdint>

namespace attnx {

enum class Activation : uint8_t {
  kNone,  // identity
  kRelu,  // max(x, 0); NaN stays NaN
  kGelu   // x Phi(x), Phi the normal distribution (torch's exact "gelu", by erf)
};

}  // namespace attnx
