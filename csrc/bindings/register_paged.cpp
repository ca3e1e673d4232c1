// The binding of attention over a paged KV cache: one step of continuous
// batching. The query rows of many sequences are packed end to end (as in
// varlen attention), and each sequence's keys and values are read in place
// from the blocks of a pool through its block table: the pool is a
// StoredView with a BlockTable, run by the same planner and kernels as every
// other call.
//
// Releasing the GIL is safe: the core touches no Python object, and the
// py::array arguments keep every buffer alive until the call returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <type_traits>
#include <vector>

#include "attnx/attention.h"
#include "bindings/array_views.h"
#include "bindings/sdpa_arguments.h"

namespace attnx::bindings {

namespace {

// A pool of keys or values (num_blocks, H, block_size, D), as stored_view
// reads keys or values (int8 with `scales` (num_blocks, H, block_size)), with
// its dim-0 strides as they are: a pool of one block has one too (read as 0,
// as for other arrays of extent 1, it would say that every sequence's rows
// are the same rows).
template <typename T>
StoredView<T> pool_view(const py::array& pool, const char* name, const OptArray& scales) {
  if (pool.ndim() != 4)
    throw py::value_error(std::string(name) +
                          ": expected a pool (num_blocks, num_kv_heads, block_size, dim), got " +
                          shape_string(pool));
  StoredView<T> v = stored_view<T>(pool, name, scales);
  const int64_t blocks = pool.strides(0) / pool.itemsize();
  v.native.stride[0] = v.bits.stride[0] = v.q8.stride[0] = blocks;
  if (v.storage == Storage::kInt8) v.scales.stride[0] = scales->strides(0) / 4;
  return v;
}

// The pool seen as (B, H, capacity, D) through the block tables: dim 0 is
// then the sequence, and row j of sequence b is found through its table.
template <typename T>
void attach_table(StoredView<T>& v, const BlockTable& table, int64_t B, int64_t capacity) {
  v.paged = table;
  v.native.shape[0] = v.bits.shape[0] = v.q8.shape[0] = v.scales.shape[0] = B;
  v.native.shape[2] = v.bits.shape[2] = v.q8.shape[2] = v.scales.shape[2] = capacity;
}

template <typename T>
void run_paged_typed(const py::array& query, const py::array& key_pool,
                     const py::array& value_pool, const OptArray& key_scales,
                     const OptArray& value_scales, const py::array& block_tables,
                     const py::array& seq_lens, const py::array& cu_seqlens_q,
                     const SdpaOptions& o, py::array& out) {
  const StridedView<const T, 3> q = const_view<T, 3>(query, "query");
  const std::vector<int64_t> q_lengths =
      sequence_lengths(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "query");
  const int64_t B = int64_t(q_lengths.size()), Hq = q.shape[1], E = q.shape[2];
  StoredView<T> keys = pool_view<T>(key_pool, "key pool", key_scales);
  StoredView<T> values = pool_view<T>(value_pool, "value pool", value_scales);
  const int64_t blocks = keys.shape(0), Hk = keys.shape(1), block_size = keys.shape(2);
  const int64_t Ev = values.shape(3);
  if (keys.shape(3) != E || values.shape(0) != blocks || values.shape(1) != Hk ||
      values.shape(2) != block_size)
    throw py::value_error("key pool " + shape_string(key_pool) + " and value pool " +
                          shape_string(value_pool) +
                          " must be (num_blocks, Hk, block_size, E) and (num_blocks, Hk, "
                          "block_size, Ev) for query " + shape_string(query));
  if (Hq > 0 && (Hk == 0 || Hq % Hk != 0))
    throw py::value_error("query heads (" + std::to_string(Hq) +
                          ") must be a multiple of key heads (" + std::to_string(Hk) + ")");
  if (block_size < 1) throw py::value_error("block_size must be at least 1");
  const StridedView<const int32_t, 2> tables = const_view<int32_t, 2>(block_tables, "block_tables");
  if (tables.shape[0] != B)
    throw py::value_error("block_tables: expected " + std::to_string(B) + " rows, got " +
                          shape_string(block_tables));
  // capacity: the rows a table reaches; table_stride: entries from one row to the next.
  const int64_t capacity = tables.shape[1] * block_size, table_stride = tables.stride[0];
  const int32_t* table = tables.data;
  const int64_t* lengths = vector_data<int64_t>(seq_lens, "seq_lens", B);
  // Every block a sequence's length reaches must be one of the pool's, and
  // its newest rows are its queries.
  for (int64_t b = 0; b < B; ++b) {
    if (lengths[b] < q_lengths[size_t(b)] || lengths[b] > capacity)
      throw py::value_error("seq_lens: " + std::to_string(lengths[b]) + " at index " +
                            std::to_string(b) + " is outside [" +
                            std::to_string(q_lengths[size_t(b)]) + ", " +
                            std::to_string(capacity) + "]");
    for (int64_t i = 0; i < (lengths[b] + block_size - 1) / block_size; ++i) {
      const int32_t block = table[b * table_stride + i];
      if (block < 0 || block >= blocks)
        throw py::value_error("block_tables: entry " + std::to_string(block) + " at (" +
                              std::to_string(b) + ", " + std::to_string(i) +
                              ") is not a block of the pool's " + std::to_string(blocks));
    }
  }
  const BlockTable paging{table, table_stride, block_size};
  attach_table(keys, paging, B, capacity);
  attach_table(values, paging, B, capacity);
  std::vector<int64_t> q_offsets, out_offsets;
  SdpaArgs<T> a;
  a.query = packed_view(q, q_lengths, q_offsets);
  a.key = keys;
  a.value = values;
  if (out.ndim() != 3 || out.shape(0) != q.shape[0] || out.shape(1) != Hq || out.shape(2) != Ev)
    throw py::value_error("out: expected (" + std::to_string(q.shape[0]) + ", " +
                          std::to_string(Hq) + ", " + std::to_string(Ev) + "), got " +
                          shape_string(out));
  a.out = packed_view(mutable_view<T, 3>(out, "out"), q_lengths, out_offsets);
  apply_options(o, capacity, a);
  a.range.query_lengths = q_lengths.data();
  a.range.key_lengths = lengths;
  a.range.packed = true;
  py::gil_scoped_release release;
  sdpa_forward(a);
}

void run_paged(const py::array& query, const py::array& key_pool, const py::array& value_pool,
               const OptArray& key_scales, const OptArray& value_scales,
               const py::array& block_tables, const py::array& seq_lens,
               const py::array& cu_seqlens_q, const py::object& options, py::array& out) {
  const SdpaOptions& o = options.cast<const SdpaOptions&>();
  if (o.scores >= 0) throw py::value_error("paged attention returns no scores");
  if (is_dtype(query, py::dtype::of<float>()))
    run_paged_typed<float>(query, key_pool, value_pool, key_scales, value_scales, block_tables,
                           seq_lens, cu_seqlens_q, o, out);
  else if (is_dtype(query, py::dtype::of<double>()))
    run_paged_typed<double>(query, key_pool, value_pool, key_scales, value_scales, block_tables,
                            seq_lens, cu_seqlens_q, o, out);
  else
    throw py::type_error("query: expected float32 or float64");
}

}  // namespace

void register_paged(py::module_& m) {
  m.def("paged_attention", &run_paged, py::arg("query"), py::arg("key_pool"),
        py::arg("value_pool"), py::arg("key_scales"), py::arg("value_scales"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("cu_seqlens_q"),
        py::arg("options"), py::arg("out"),
        "Attention of packed query rows (total_q, Hq, E) over a paged cache: sequence b's\n"
        "queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int64), its keys the first\n"
        "seq_lens[b] (int64) rows of the blocks block_tables[b] (int32, (B, max_blocks)) of\n"
        "the pools (num_blocks, Hk, block_size, E / Ev); int8 pools take their\n"
        "(num_blocks, Hk, block_size) float32 scales. The options apply per sequence; into\n"
        "out (total_q, Hq, Ev), C-contiguous.");
}

}  // namespace attnx::bindings
