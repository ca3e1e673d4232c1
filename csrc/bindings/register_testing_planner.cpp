// Test hooks of the planner of scaled dot-product attention: the plan of a
// described call, without running it (attnx._core._testing).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "attention/sdpa_plan.h"
#include "attention/sdpa_rows.h"
#include "attention/sdpa_tiles.h"
#include "attention/sdpa_weights_tile.h"
#include "kernels/kernel_table.h"

namespace py = pybind11;

namespace attnx::bindings {
namespace {

using sdpa::SdpaShape;

// The call from a dict: B, Hq, Hk, L, S, E, Ev required; the rest optional.
SdpaShape shape_from(const py::dict& d) {
  static const char* const known[] = {
      "B", "Hq", "Hk", "L", "S", "E", "Ev", "S_read", "element_size", "keys_16bit",
      "values_16bit", "keys_batch_broadcast", "keys_head_broadcast", "values_batch_broadcast",
      "values_head_broadcast", "masks", "banded", "key_lengths", "query_lengths", "weights",
      "values_on_lines", "packed", "bf16_products", "int8_products"};
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    bool found = false;
    for (const char* name : known) found = found || key == name;
    if (!found) throw py::key_error("plan_sdpa: unknown field '" + key + "'");
  }
  const auto integer = [&](const char* name, int64_t fallback, bool required) {
    if (!d.contains(name)) {
      if (required) throw py::key_error(std::string("plan_sdpa: missing field '") + name + "'");
      return fallback;
    }
    const int64_t value = d[name].cast<int64_t>();
    if (value < 0) throw py::value_error(std::string("plan_sdpa: ") + name + " must be >= 0");
    return value;
  };
  const auto flag = [&](const char* name, bool fallback) {
    return d.contains(name) ? d[name].cast<bool>() : fallback;
  };
  SdpaShape call;
  call.B = integer("B", 0, true), call.Hq = integer("Hq", 0, true);
  call.Hk = integer("Hk", 0, true), call.L = integer("L", 0, true);
  call.S = integer("S", 0, true), call.E = integer("E", 0, true);
  call.Ev = integer("Ev", 0, true);
  call.S_read = integer("S_read", call.S, false);
  call.element_size = int(integer("element_size", 4, false));
  if (call.B < 1 || call.Hq < 1 || call.Hk < 1 || call.L < 1 || call.Ev < 1)
    throw py::value_error("plan_sdpa: B, Hq, Hk, L and Ev must be >= 1");
  if (call.Hq % call.Hk != 0) throw py::value_error("plan_sdpa: Hq must be a multiple of Hk");
  if (call.S_read > call.S) throw py::value_error("plan_sdpa: S_read must be <= S");
  if (call.element_size != 4 && call.element_size != 8)
    throw py::value_error("plan_sdpa: element_size must be 4 or 8");
  const auto stored = [&](const std::string& prefix) {
    sdpa::StoredShape s;
    s.native = !flag((prefix + "_16bit").c_str(), false);
    if (!s.native && call.element_size != 4)
      throw py::value_error("plan_sdpa: 16-bit " + prefix + " need element_size 4");
    s.element_size = s.native ? call.element_size : 2;
    s.batch_broadcast = flag((prefix + "_batch_broadcast").c_str(), false);
    s.head_broadcast = flag((prefix + "_head_broadcast").c_str(), false);
    return s;
  };
  call.keys = stored("keys");
  call.values = stored("values");
  call.masks = flag("masks", false);
  call.banded = flag("banded", false);
  call.key_lengths = flag("key_lengths", false);
  call.query_lengths = flag("query_lengths", false);
  call.weights = flag("weights", false);
  call.values_on_lines = flag("values_on_lines", true);
  call.int8_products = flag("int8_products", false);
  call.bf16_products = flag("bf16_products", false);
  call.packed = flag("packed", false);
  return call;
}

py::dict plan_dict(const sdpa::SdpaPlan& plan) {
  py::dict d;
  d["path"] = sdpa::path_name(plan.path);
  d["threads"] = plan.threads;
  d["S_read"] = plan.S_read;
  d["heads"] = plan.heads;
  d["rows_per_head"] = plan.rows_per_head;
  d["rows_per_task"] = plan.rows_per_task;
  d["q_blocks"] = plan.q_blocks;
  d["group"] = plan.group;
  d["q_groups"] = plan.q_groups;
  d["chunks"] = plan.chunks;
  d["tasks"] = plan.tasks;
  d["key_block"] = plan.key_block;
  d["ask_ahead"] = plan.ask_ahead;
  d["align_values"] = plan.align_values;
  d["finite_values"] = plan.finite_values;
  d["mask_blocks"] = plan.mask_blocks;
  d["values_ld"] = plan.values_ld;
  d["values_copy_size"] = plan.values_copy_size;
  d["scratch_per_thread"] = plan.scratch_per_thread;
  d["state_size"] = plan.state_size;
  d["states_size"] = plan.states_size;
  return d;
}

}  // namespace

void register_testing_planner(py::module_& testing) {
  testing.def(
      "plan_sdpa",
      [](const py::dict& call, int query_tile, int vector_width, int threads, bool bf16_pairs) {
        if (query_tile < 1 || query_tile > sdpa::kMaxTile || vector_width < 1 ||
            query_tile % vector_width != 0)
          throw py::value_error(
              "plan_sdpa: query_tile must be a multiple of vector_width, at most " +
              std::to_string(sdpa::kMaxTile));
        if (threads < 1) throw py::value_error("plan_sdpa: threads must be >= 1");
        return plan_dict(sdpa::plan_sdpa(shape_from(call),
                                         sdpa::KernelFacts{query_tile, vector_width, bf16_pairs},
                                         threads));
      },
      py::arg("call"), py::arg("query_tile"), py::arg("vector_width"), py::arg("threads"),
      py::arg("bf16_pairs") = true,
      "The plan of scaled dot-product attention for a described call (a dict of B, Hq, Hk, "
      "L, S, E, Ev and optional facts), as a dict; nothing is run. bf16_pairs: whether "
      "bfloat16 products run as pairs (else as float32 multiply-adds).");
  testing.def(
      "sdpa_work",
      [](const py::dict& call) { return sdpa::sdpa_work(shape_from(call)); }, py::arg("call"),
      "The work estimate that sets a call's thread count.");
  testing.def(
      "kernel_facts",
      [](const std::string& dtype) {
        py::dict d;
        if (dtype == "float32") {
          const KernelTable<float>& kt = active_kernels(float());
          d["query_tile"] = kt.query_tile, d["vector_width"] = kt.vector_width;
        } else if (dtype == "float64") {
          const KernelTable<double>& kt = active_kernels(double());
          d["query_tile"] = kt.query_tile, d["vector_width"] = kt.vector_width;
        } else {
          throw py::value_error("kernel_facts: dtype must be 'float32' or 'float64'");
        }
        return d;
      },
      py::arg("dtype"), "query_tile and vector_width of the active kernel for dtype.");
  testing.def("planner_constants", [] {
    py::dict d;
    d["query_block"] = sdpa::kQueryBlock;
    d["row_key_block"] = sdpa::kKeyBlock;
    d["key_chunk"] = sdpa::kKeyChunk;
    d["tile_chunk"] = sdpa::kTileChunk;
    d["max_tile_group"] = sdpa::kMaxTileGroup;
    d["tile_group_bytes"] = sdpa::kTileGroupBytes;
    d["tile_group_min_key_bytes"] = sdpa::kTileGroupMinKeyBytes;
    d["ahead_min_call_bytes"] = sdpa::kAheadMinCallBytes;
    d["aligned_values_max_bytes"] = sdpa::kAlignedValuesMaxBytes;
    d["aligned_values_max_call_bytes"] = sdpa::kAlignedValuesMaxCallBytes;
    d["weights_tile_bytes"] = sdpa::kWeightsTileBytes;
    return d;
  }, "The constants the planner's rules use.");
}

}  // namespace attnx::bindings
