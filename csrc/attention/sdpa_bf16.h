// The operands of scaled dot-product attention with bfloat16 products
// (Precision::kBFloat16): each product's operands rounded to bfloat16 once
// per call, before any path reads them.
//
//   queries   round(query_scale * q): as the tile path packs each tile, or
//             for the other paths a float32 copy (the call's scale then 1)
//   keys      bfloat16 rows with an even row stride: read in place where the
//             caller's keys are such rows, else rounded into a copy; the tile
//             path multiplies them as pairs along the head dim, the weights
//             paths widen them
//   values    the tile path: pairs of consecutive keys' values (P.V sums
//             over keys); the weights paths: bfloat16 rows, as the keys
//   P         rounded where each path multiplies it (the tile path packs it
//             into pairs; the row paths round it in place)
//
// That is the tile path where the products run as pairs (Bf16Products::
// kPairs); where they run as float32 multiply-adds, it reads float32 copies
// of the rounded keys, values and queries as it reads float32 operands, and
// rounds P in place; over a paged pool it reads the keys and values in
// place and rounds each block into its buffers instead.
//
// The row path without weights (decoding) copies neither keys nor values:
// it reads them in place on every call, with the bfloat16 table's row
// kernels, which round float32 elements as they load them and take 16-bit
// and int8 ones as stored: a bfloat16 or int8 element is a bfloat16 value
// (an int8 row's scale multiplies in float32), and a float16 one, whose 11
// significand bits make its products with bfloat16 values exact in float32
// as well, is multiplied as it is: rounding it as it is loaded lengthens
// the widening that bounds such a step, and rounding a cache into a copy on
// each call costs far more than the step (docs/tuning.md).
//
// Broadcast batch or head axes stay broadcast in the copies.
#pragma once

#include <cstdint>

#include "attention/cache_line_array.h"
#include "attention/sdpa_plan.h"
#include "attnx/attention.h"
#include "kernels/bf16_table.h"
#include "kernels/kernel_table.h"

namespace attnx::sdpa {

struct Bf16Operands {
  const Bf16KernelTable* kt16 = nullptr;
  // The tile path's products as pairs (Bf16Products::kPairs: its operands
  // below); else every path multiplies float32 rows of rounded operands.
  bool as_pairs = false;
  // float32 products over a paged pool: the tile path reads the keys and
  // values in place and rounds each block as it reads it (a copy of a pool's
  // sequences could take more memory than the pool).
  bool round_blocks = false;
  CacheLineArray<float> queries;
  // The row path's queries as bfloat16 bits (queries' layout), for the
  // pairs kernels over a bfloat16 cache (scores_bf16_rows); empty elsewhere.
  CacheLineArray<uint16_t> query_bits;
  // The row path's queries split as scores_bf16_split takes them, for the
  // float route over a bfloat16 cache; empty elsewhere.
  CacheLineArray<float> query_split;
  CacheLineArray<uint16_t> keys, values;  // copies where needed
  CacheLineArray<float> float_keys, float_values;  // the tile path's, for float32 products
  // Value pairs (B', Hk', S2, Ev), S2 = ceil(S / 2): pair p of column d is
  // the values of keys 2p and 2p + 1 (0 past the last key).
  CacheLineArray<uint32_t> pairs;
  int64_t pairs_stride[2] = {0, 0};  // of b and h (0 where broadcast)
  int64_t ldk = 0;                   // key row stride in pairs

  // Key rows from j of (b, kv head) as pairs, ldk pairs apart.
  const uint32_t* key_pairs(const SdpaArgs<float>& a16, int64_t b, int64_t h, int64_t j) const {
    return reinterpret_cast<const uint32_t*>(a16.key.bits.at(b, h, j));
  }
  // The pairs of keys from 2p of (b, kv head), Ev pairs a row.
  const uint32_t* value_pairs(int64_t b, int64_t h, int64_t p, int64_t Ev) const {
    return pairs.get() + b * pairs_stride[0] + h * pairs_stride[1] + p * Ev;
  }
};

// Fills `ops` and `a16`: `a` with its query, keys and values replaced by the
// rounded operands that `path` reads (the tile path: the values as pairs;
// the weights paths: bfloat16 rows; the row path: the queries alone).
void prepare_bf16(const SdpaArgs<float>& a, const KernelTable<float>& kt, SdpaPath path,
                  Bf16Operands& ops, SdpaArgs<float>& a16);

}  // namespace attnx::sdpa
