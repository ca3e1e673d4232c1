// The precision of a call's products.
#pragma once

#include <cstdint>

namespace attnx {

// kNative: products in the compute dtype (float32, or float64 for float64
// calls), the default. kBFloat16: the operands of every product (the scores,
// P.V, the projections) rounded to bfloat16, the sums float32; softmax, masks,
// norms and activations stay float32 (float32 calls only). kInt8: attention
// over int8 keys and values (an int8 cache) with integer products: each
// query row quantized to int8 as a cache row is, the probabilities of each
// row quantized per block of keys, int32 sums (kernels/int8_table.h).
enum class Precision : uint8_t { kNative, kBFloat16, kInt8 };

}  // namespace attnx
