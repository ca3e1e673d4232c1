// Attention with int8 products (Precision::kInt8): the query rows of a
// call quantized once, as an int8 cache's rows are (quantize_int8), for the
// row path's int8 kernels (sdpa_rows.cpp, kernels/int8_table.h).
#pragma once

#include <cstdint>
#include <vector>

#include "attention/narrowing.h"
#include "attnx/attention.h"

namespace attnx::sdpa {

struct Int8Queries {
  std::vector<int8_t> rows;   // (B, Hq, L, E), C order
  std::vector<float> scales;  // (B, Hq, L): each row's scale times the call's query scale
  int64_t Hq = 0, L = 0, E = 0;

  explicit Int8Queries(const SdpaArgs<float>& a)
      : Hq(a.query.shape[1]), L(a.query.shape[2]), E(a.query.shape[3]) {
    const int64_t count = a.query.shape[0] * Hq * L;
    rows.resize(size_t(count * E));
    scales.resize(size_t(count));
    for (int64_t b = 0, r = 0; b < a.query.shape[0]; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < L; ++i, ++r)
          scales[size_t(r)] =
              a.query_scale() * quantize_int8(a.query.at(b, h, i), E, rows.data() + r * E);
  }
  const int8_t* row(int64_t b, int64_t h, int64_t i) const {
    return rows.data() + ((b * Hq + h) * L + i) * E;
  }
  float scale(int64_t b, int64_t h, int64_t i) const {
    return scales[size_t((b * Hq + h) * L + i)];
  }
};

}  // namespace attnx::sdpa
