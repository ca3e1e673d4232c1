// Multi-head self-attention over few rows, kept transposed from the input
// projection to the output projection (see self_attention_few_rows.cpp).
#pragma once

#include "attnx/attention.h"

namespace attnx {

// Computes mha_forward(a) and returns true where the call is one this form
// takes; otherwise does nothing and returns false. The caller has checked
// that query, key and value are one array projected by torch's stacked
// in_proj weights, with nothing appended to the keys, over rows few enough
// that linear_forward copies the input (stacked_self_projection).
template <typename T>
bool self_attention_few_rows(const MhaArgs<T>& a);

}  // namespace attnx
