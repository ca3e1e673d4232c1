// The precision of a call's products.
#pragma once

#include <cstdint>

namespace attnx {

// kNative: products in the compute dtype (float32, or float64 for float64
// calls), the default. kBFloat16: the operands of every product (the scores,
// P.V, the projections) rounded to bfloat16, the sums float32; softmax, masks,
// norms and activations stay float32 (float32 calls only).
enum class Precision : uint8_t { kNative, kBFloat16 };

}  // namespace attnx
