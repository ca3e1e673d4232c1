// The row path of scaled dot-product attention.
//
// Each query row against key blocks with the row kernels (dot, axpy); with
// weights, each row's probabilities are written to the weights, then
// out = p.V. Without weights, the rows of the query heads that share a key
// head are taken together (each block of keys and values is read once per
// group), and long key sequences are split into chunks (row_key_chunk),
// one task each, whose softmax states (m, l, acc) are merged in chunk order:
// decoding (one query, many keys) then uses every core.
#include <algorithm>
#include <cmath>

#include "attention/sdpa_rows.h"

#include "kernels/int8_table.h"

namespace attnx::sdpa {

// A block's probabilities are quantized on the stack of the int8 kernels.
static_assert(kKeyBlock <= kInt8MaxBlock);

namespace {

// f(part, ld, s0, m) for rows [start, start + n) of stored rows widened
// into buf kWidenRows at a time: part holds rows start + s0 .. + m, ld apart.
template <typename T, typename F>
void in_widened_parts(const RowReader<T>& reader, int64_t start, int64_t n, T* buf, F&& f) {
  for (int64_t s0 = 0; s0 < n; s0 += kWidenRows) {
    const int64_t m = std::min(kWidenRows, n - s0);
    int64_t ld = 0;
    const T* part = reader.rows(start + s0, m, buf, ld);
    f(part, ld, s0, m);
  }
}

}  // namespace

template <typename T>
void flash_rows(const SdpaContext<T>& c, int64_t b, int64_t kv_head, int64_t r0, int64_t r1,
                int64_t chunk, T* scratch) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const int64_t chunks = c.plan.chunks, S_read = c.plan.S_read;
  // One chunk: every key read, the output rows written. Several: this
  // chunk's keys, its states stored. The sequence's key length sets the
  // chunks' keys, as it did the chunks (SdpaTasks).
  const int64_t key_chunk = row_key_chunk(
      c.plan.int8_products, a.range.key_lengths ? a.range.key_lengths[b] : S_read);
  const int64_t j_begin = chunks == 1 ? 0 : chunk * key_chunk;
  const int64_t j_end = chunks == 1 ? S_read : std::min(S_read, j_begin + key_chunk);
  T* states = chunks == 1 ? nullptr : c.states;
  const int64_t Hq = a.query.shape[1], E = a.query.shape[3];
  const int64_t Ev = a.value.shape(3), group = Hq / a.key.shape(1);
  const int64_t rows = r1 - r0;
  T* tile = scratch;                      // rows x kKeyBlock scores
  T* acc = tile + rows * kKeyBlock;       // rows x Ev
  T* m = acc + rows * Ev;                 // rows
  T* l = m + rows;                        // rows
  T* k_buf = l + rows;                    // kKeyBlock x E: widened keys
  T* v_buf = k_buf + kKeyBlock * E;       // kKeyBlock x Ev: widened values
  int64_t head[kQueryBlock], row[kQueryBlock];
  bool open[kQueryBlock] = {};            // whether the row has any open key
  const T* q_rows[kQueryBlock];
  T* s_rows[kQueryBlock];
  T* acc_rows[kQueryBlock];
  std::fill(acc, acc + rows * Ev, T(0));
  std::fill(m, m + rows, kNegInf<T>);
  std::fill(l, l + rows, T(0));
  // Rows r0..r1 run over the group's heads, each with the batch's query rows.
  const int64_t rows_of_head = query_rows(a, b);
  for (int64_t r = 0; r < rows; ++r) {
    head[r] = kv_head * group + (r0 + r) / rows_of_head;
    row[r] = (r0 + r) % rows_of_head;
    q_rows[r] = a.query.at(b, head[r], row[r]);
    s_rows[r] = tile + r * kKeyBlock;
    acc_rows[r] = acc + r * Ev;
  }
  // The keys any of the rows may attend, in whole blocks, and whether they
  // read one row of the masks.
  RowMasks<T> masks;
  masks.begin(a, b, head, row, rows, j_begin, kKeyBlock);

  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);
  // 16-bit and int8 keys and values are read straight from storage by their
  // row kernels, widened in registers, for up to kDirectRowGroups groups of
  // the row kernels' rows (int8: kDirectInt8Rows rows); for more rows they
  // are widened into the buffer and read from there by every row: for a few
  // groups, widening again for each costs less than storing the rows and
  // loading them back.
  const int64_t direct_rows = keys.q8 ? kDirectInt8Rows : kDirectRowGroups * kt.row_group;
  const bool direct_keys = rows <= direct_rows && keys.stored();
  const bool direct_values = rows <= direct_rows && values.stored();
  // A paged cache's rows, which lie in blocks, are listed one pointer each
  // and read by the listed kernels: a block of kKeyBlock keys is then one
  // call, read and asked for ahead as a contiguous one is (a call per
  // cache block took 1.5x the time at 16 rows a block: see docs/tuning.md).
  // Stored rows for more than 4 rows are widened into the buffer as usual.
  //
  // With bfloat16 products the keys and values are read in place, never
  // rounded into a copy on each call: float32 rows are listed and read by
  // the bfloat16 table's row kernels, which round them as they load them;
  // 16-bit and int8 rows are taken as stored (see sdpa_bf16.h).
  const Bf16KernelTable* kt16 = nullptr;
  if constexpr (std::is_same_v<T, float>) kt16 = c.bf16 ? c.bf16->kt16 : nullptr;
  const bool rounded_keys = kt16 && !keys.stored();
  const bool rounded_values = kt16 && !values.stored();
  // With int8 products (an int8 cache) every block is listed and read in
  // place by the int8 kernels, for any number of rows, against the query
  // rows quantized once for the call.
  const Int8KernelTable* kt8 = nullptr;
  const int8_t* q8_rows[kQueryBlock];
  float q8_scales[kQueryBlock];
  if constexpr (std::is_same_v<T, float>) {
    if (c.int8) {
      kt8 = &active_int8_kernels();
      for (int64_t r = 0; r < rows; ++r) {
        q8_rows[r] = c.int8->row(b, head[r], row[r]);
        q8_scales[r] = c.int8->scale(b, head[r], row[r]);
      }
    }
  }
  // On the pairs route (where vdpbf16ps pays: bf16_products), a bfloat16
  // cache's keys and values are read as pairs as they lie, against the
  // queries as bfloat16 bits (prepared once for the call): no element is
  // widened.
  // On the float route a bfloat16 cache's keys are read by
  // scores_bf16_split, a whole load at a time, against the queries split as it
  // takes them (prepared once for the call), for any number of rows, so that
  // a row's scores are the same whatever rows share its call.
  const uint16_t* q16_rows[kQueryBlock];
  const float* q_split_rows[kQueryBlock];
  const bool pairs = kt16 && bf16_products() == Bf16Products::kPairs;
  const bool pair_keys = pairs && c.bf16->query_bits && keys.bits && keys.bits_kind == 1;
  const bool pair_values =
      pairs && kt16->accumulate_pv_bf16_rows && values.bits && values.bits_kind == 1;
  const bool split_keys = kt16 && c.bf16->query_split && keys.bits && keys.bits_kind == 1;
  if constexpr (std::is_same_v<T, float>) {
    const int64_t L = a.query.shape[2];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = ((b * Hq + head[r]) * L + row[r]) * E;
      if (pair_keys) q16_rows[r] = c.bf16->query_bits.get() + at;
      if (split_keys) q_split_rows[r] = c.bf16->query_split.get() + at;
    }
  }
  const bool listed_keys = kt8 || pair_keys || split_keys || rounded_keys ||
                           (keys.blocks && (direct_keys || !keys.stored()));
  const bool listed_values =
      kt8 || pair_values || rounded_values || (values.blocks && (direct_values || !values.stored()));
  // A block's rows listed, and the next rows (to be asked for ahead, as the
  // kernels do within a block: at a block's start a contiguous cache has
  // the hardware prefetchers' stream going, a paged one not).
  const void* listed[kKeyBlock + kListAhead];
  float listed_scales[kKeyBlock + kListAhead];  // their int8 scales
  const int64_t keys_held = std::min(j_end, key_length(a, b));
  const int n_rows = static_cast<int>(rows);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyBlock) {
    // A block of source keys is cut to the rows' keys, or skipped.
    const Band part = keys_of_block(masks.keys, a.mask_cols, j0, std::min(kKeyBlock, j_end - j0));
    if (part.empty()) continue;
    const int64_t start = part.lo, n = part.hi - part.lo;
    int64_t ldk = 0, ldv = 0;
    LineRange lead = stored_row_lines(a.value, b, kv_head, start, std::min(n, kBlockLeadRows));
    request_lines_to_l2(lead, lead.size());
    // Rows read as T and not listed are read where they lie; stored rows
    // that no kernel reads in place are widened into the buffer a part at a
    // time (in_widened_parts), each part taken through every row.
    const bool widen_keys = keys.stored() && !direct_keys && !listed_keys;
    const T* kb = keys.stored() || listed_keys ? nullptr : keys.rows(start, n, k_buf, ldk);
    const T* vb = values.stored() || listed_values ? nullptr : values.rows(start, n, v_buf, ldv);
    // (1) the scores of every row: the kernel takes a few rows through each
    // key at once; the first of them read the block from memory, the others
    // from cache.
    const int64_t ahead = std::clamp<int64_t>(keys_held - start - n, 0, kListAhead);
    if (listed_keys) {
      keys.list(start, n, ahead, listed, listed_scales);
      if constexpr (std::is_same_v<T, float>) {
        if (rounded_keys)
          kt16->scores_rounded(q_rows, n_rows, reinterpret_cast<const float* const*>(listed), n,
                               n + ahead, E, a.query_scale(), s_rows);
        else if (kt8)
          kt8->scores(q8_rows, q8_scales, n_rows, reinterpret_cast<const int8_t* const*>(listed),
                      listed_scales, n, n + ahead, E, s_rows);
        else if (pair_keys)
          kt16->scores_bf16_rows(q16_rows, n_rows, reinterpret_cast<const uint16_t* const*>(listed),
                                 n, n + ahead, E, a.query_scale(), s_rows);
        else if (split_keys)
          kt16->scores_bf16_split(q_split_rows, n_rows,
                                  reinterpret_cast<const uint16_t* const*>(listed), n, n + ahead,
                                  E, a.query_scale(), s_rows);
      }
      if (!rounded_keys && !kt8 && !pair_keys && !split_keys)
        kt.scores_listed(q_rows, n_rows, listed, listed_scales, keys.stored_kind(), n, n + ahead,
                         E, a.query_scale(), s_rows);
    } else if constexpr (std::is_same_v<T, float>) {
      if (direct_keys && keys.q8)
        kt.scores_int8(q_rows, n_rows, keys.q8 + start * keys.ld, keys.ld, keys.scales + start,
                       n, E, a.query_scale(), s_rows, true);
      else if (direct_keys)
        kt.scores_16bit[keys.bits_kind](q_rows, n_rows, keys.bits + start * keys.ld, keys.ld, n,
                                        E, a.query_scale(), s_rows, true);
    }
    if (kb) kt.scores(q_rows, n_rows, kb, ldk, n, E, a.query_scale(), s_rows, keys.native);
    if (widen_keys)
      in_widened_parts(keys, start, n, k_buf,
                       [&](const T* part, int64_t ld, int64_t s0, int64_t m) {
                         T* s_part[kQueryBlock];
                         for (int64_t r = 0; r < rows; ++r) s_part[r] = s_rows[r] + s0;
                         kt.scores(q_rows, n_rows, part, ld, m, E, a.query_scale(), s_part, false);
                       });
    soft_cap(a, kt, tile, rows, kKeyBlock, n, a.softcap_folded());
    // The rows whose values go through the block in one pass, together.
    const T* p_plain[kQueryBlock];
    T* acc_plain[kQueryBlock];
    int plain = 0;
    const MaskBlock mask_block = masks.classify(a, start, n);
    // Listed values are listed here, before the softmax (the keys' list is
    // done with). With int8 products those past the lead are asked for
    // while the rows' softmax runs, a share before each row's maximum and
    // each row's exponentials: the memory is idle then, and the P.V that
    // follows finds them in L2. Through the list, so that a paged cache's
    // rows, which lie in runs, are asked for across its blocks. One line of
    // each pair: a request holds a line fill buffer until its line arrives,
    // and a burst of them stalls the softmax (measurements: docs/tuning.md).
    if (listed_values) values.list(start, n, ahead, listed, listed_scales);
    ListedLines values_ahead;
    if (kt8) {
      // The next block's scales too, where a paged cache scatters them.
      const int64_t next = std::min(j_end, j0 + kKeyBlock);
      const int64_t next_n = std::min(j_end, next + kKeyBlock) - next;
      keys.request_scales_to_l2(next, next_n);
      values.request_scales_to_l2(next, next_n);
      values_ahead.rows = listed + std::min(n, kBlockLeadRows);
      values_ahead.row_lines = (Ev + 63) / 64;
      values_ahead.end = std::max<int64_t>(0, n - kBlockLeadRows) * values_ahead.row_lines;
    }
    int64_t shares = 2 * rows;
    const auto ask_share = [&] {
      const int64_t pairs = (values_ahead.size() + 1) / 2;
      request_line_pairs_to_l2(values_ahead, (pairs + shares - 1) / shares);
      shares = std::max<int64_t>(1, shares - 1);
    };
    for (int64_t r = 0; r < rows; ++r) {
      T* s = s_rows[r];
      const KeyStates states = masks.apply(a, b, head[r], row[r], start, n, s, mask_block);
      open[r] = open[r] || states.any_open;
      // (2) new running max and the rescale of what was accumulated
      ask_share();
      const T m_new = max_ignoring_nan(m[r], kt.row_max(s, n));
      const T shift = exp_shift(m_new);
      // exp(0) is 1: where the running maximum holds, as it does past a
      // row's first blocks, the call is skipped.
      const T alpha = m[r] == shift ? T(1) : std::exp(m[r] - shift);
      ask_share();
      const T block_sum = kt.exp_shift_sum(s, n, shift);
      round_operands(c, s, n);
      // (3) update
      T* acc_r = acc_rows[r];
      if (alpha != T(1)) kt.scale(acc_r, Ev, alpha, acc_r);
      l[r] = alpha * l[r] + block_sum;
      m[r] = m_new;
      if (states.any_closed) {
        // A closed key's value must not reach the row (0 * NaN): where the
        // block holds a value that is not finite, the row goes key by key
        // (see accumulate_values).
        if (vb == nullptr) {
          vb = values.rows(start, n, v_buf, ldv);
          // float32 values are the products' operands rounded (in the buffer).
          if (rounded_values) vb = bf16_rounded_rows(c, vb, ldv, n, Ev, v_buf), ldv = Ev;
        }
        if (!rows_finite(kt, vb, ldv, n, Ev)) {
          accumulate_values(a, kt, b, head[r], row[r], start, n, true, s, vb, ldv, Ev, acc_r,
                            false);
          continue;
        }
      }
      p_plain[plain] = s;
      acc_plain[plain++] = acc_r;
    }
    if (plain == 0) continue;
    if (j0 + kKeyBlock < j_end) {
      lead = stored_row_lines(a.key, b, kv_head, j0 + kKeyBlock,
                              std::min(j_end - j0 - kKeyBlock, kBlockLeadRows));
      request_lines_to_l2(lead, lead.size());
    }
    if (listed_values) {
      if constexpr (std::is_same_v<T, float>) {
        if (rounded_values)
          kt16->accumulate_pv_rounded(p_plain, plain, reinterpret_cast<const float* const*>(listed),
                                      n, n + ahead, Ev, acc_plain);
        else if (kt8)
          kt8->accumulate_pv(p_plain, plain, reinterpret_cast<const int8_t* const*>(listed),
                             listed_scales, n, n + ahead, Ev, acc_plain);
        else if (pair_values)
          kt16->accumulate_pv_bf16_rows(p_plain, plain,
                                        reinterpret_cast<const uint16_t* const*>(listed), n,
                                        n + ahead, Ev, acc_plain);
      }
      if (!rounded_values && !kt8 && !pair_values)
        kt.accumulate_pv_listed(p_plain, plain, listed, listed_scales, values.stored_kind(), n,
                              n + ahead, Ev, acc_plain);
    } else if (direct_values) {
      if constexpr (std::is_same_v<T, float>) {
        if (values.q8)
          kt.accumulate_pv_int8(p_plain, plain, values.q8 + start * values.ld, values.ld,
                                values.scales + start, n, Ev, acc_plain, true);
        else
          kt.accumulate_pv_16bit[values.bits_kind](p_plain, plain,
                                                   values.bits + start * values.ld, values.ld, n,
                                                   Ev, acc_plain, true);
      }
    } else if (vb == nullptr) {
      // Stored values to widen, where no closed key widened the whole block.
      in_widened_parts(values, start, n, v_buf,
                       [&](const T* part, int64_t ld, int64_t s0, int64_t m) {
                         const T* p_part[kQueryBlock];
                         for (int i = 0; i < plain; ++i) p_part[i] = p_plain[i] + s0;
                         kt.accumulate_pv(p_part, plain, part, ld, m, Ev, acc_plain, false);
                       });
    } else {
      kt.accumulate_pv(p_plain, plain, vb, ldv, n, Ev, acc_plain, values.native);
    }
  }
  if (states) {
    const int64_t state_size = Ev + 3;
    for (int64_t r = 0; r < rows; ++r) {
      T* state =
          states + (((b * Hq + head[r]) * c.plan.L + row[r]) * chunks + chunk) * state_size;
      state[0] = m[r], state[1] = l[r], state[2] = open[r] ? T(1) : T(0);
      std::copy_n(acc + r * Ev, Ev, state + 3);
    }
    return;
  }
  // (4) normalise. A row with no open key is zero; a row with open keys
  // whose scores were all -inf (an Inf in the inputs) is 0/0 = NaN.
  for (int64_t r = 0; r < rows; ++r) {
    T* o = a.out.at(b, head[r], row[r]);
    const T* acc_r = acc + r * Ev;
    if (!open[r]) {
      std::fill(o, o + Ev, T(0));
    } else {
      kt.scale(acc_r, Ev, T(1) / l[r], o);
    }
  }
}

template <typename T>
void merge_chunks(const T* states, int64_t chunks, int64_t stride, int64_t Ev, T* out) {
  T row_max = kNegInf<T>;
  bool open = false;
  for (int64_t c = 0; c < chunks; ++c) {
    row_max = max_ignoring_nan(row_max, states[c * stride]);
    open = open || states[c * stride + 2] != T(0);
  }
  std::fill(out, out + Ev, T(0));
  if (!open) return;
  const T shift = exp_shift(row_max);
  T l = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const T* state = states + c * stride;
    const T weight = std::exp(state[0] - shift);
    l += state[1] * weight;
    for (int64_t d = 0; d < Ev; ++d) out[d] += state[3 + d] * weight;
  }
  const T inv = T(1) / l;
  for (int64_t d = 0; d < Ev; ++d) out[d] *= inv;
}

template <typename T>
void rows_with_weights(const SdpaContext<T>& c, int64_t b, int64_t h, int64_t i0, int64_t i1,
                       T* scratch) {
  const SdpaArgs<T>& a = c.args;
  const KernelTable<T>& kt = c.kt;
  const int64_t Hq = a.query.shape[1], L = a.query.shape[2], S = a.key.shape(2);
  const int64_t E = a.query.shape[3], Ev = a.value.shape(3);
  const int64_t kv_head = h / (Hq / a.key.shape(1));
  const int64_t S_read = a.range.key_lengths ? a.range.key_lengths[b] : S;
  const RowReader<T> keys = row_reader(a.key, kt, b, kv_head);
  const RowReader<T> values = row_reader(a.value, kt, b, kv_head);
  T* k_buf = scratch;                   // kKeyBlock x E
  T* v_buf = k_buf + kKeyBlock * E;     // kKeyBlock x Ev
  for (int64_t i = i0; i < i1; ++i) {
    T* p = a.weights + ((b * Hq + h) * L + i) * S;
    T* o = a.out.at(b, h, i);
    const T* q = a.query.at(b, h, i);
    for (int64_t j0 = 0; j0 < S_read; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, S_read - j0);
      int64_t ldk;
      const T* kb = keys.rows(j0, n, k_buf, ldk);
      T* scores = p + j0;
      kt.scores(&q, 1, kb, ldk, n, E, a.query_scale(), &scores, i == i0 && keys.native);
    }
    soft_cap(a, kt, p, 1, S_read, S_read, a.softcap_folded());
    std::fill(p + S_read, p + S, T(0));
    const KeyStates states = apply_masks(a, b, h, i, 0, S_read, p);
    std::fill(o, o + Ev, T(0));
    if (!row_probabilities(kt, p, S_read, states.any_open)) continue;  // fully masked row
    // Keys past the key length (trailing padding, never read) are closed: in a NaN row
    // (a NaN sum) their weight 0 / sum is NaN too, as torch gives for the padding mask.
    if (S_read < S && S_read > 0 && std::isnan(p[0])) std::fill(p + S_read, p + S, p[0]);
    round_operands(c, p, S_read);
    for (int64_t j0 = 0; j0 < S_read; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, S_read - j0);
      int64_t ldv;
      const T* vb = values.rows(j0, n, v_buf, ldv);
      accumulate_values(a, kt, b, h, i, j0, n, states.any_closed, p + j0, vb, ldv, Ev, o,
                        i == i0 && values.native);
    }
  }
}

template void flash_rows<float>(const SdpaContext<float>&, int64_t, int64_t, int64_t, int64_t,
                                int64_t, float*);
template void flash_rows<double>(const SdpaContext<double>&, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, double*);
template void merge_chunks<float>(const float*, int64_t, int64_t, int64_t, float*);
template void merge_chunks<double>(const double*, int64_t, int64_t, int64_t, double*);
template void rows_with_weights<float>(const SdpaContext<float>&, int64_t, int64_t, int64_t,
                                       int64_t, float*);
template void rows_with_weights<double>(const SdpaContext<double>&, int64_t, int64_t, int64_t,
                                        int64_t, double*);

}  // namespace attnx::sdpa
