// Scaled dot-product attention, forward: the call is described, planned
// (sdpa_plan.cpp: which path it takes, and how its work is cut into tasks for
// the threads), and its tasks run.
//
//   tile path (sdpa_tiles.cpp): flash attention over tiles of queries, for
//     calls with a quarter of a tile of queries per head or more;
//   row path (sdpa_rows.cpp): each query row on its own, for fewer queries
//     (decoding, with long key sequences split into chunks over the
//     threads) and for the weights of long key sequences;
//   weights tile (sdpa_weights_tile.cpp): the weights a tile at a time.
//
// Key range: each row may attend a band of keys (causal, sliding window,
// per-batch key lengths; see KeyRange). Blocks outside every band of a task
// are skipped and never read; only blocks a band end crosses are masked.
// Keys and values stored as 16-bit floats are widened block by block.
//
// Each output row is computed by one thread in a fixed order, so results do
// not depend on the thread count.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/cache_line_array.h"
#include "attention/masking/key_range.h"
#include "attention/masking/mask_blocks.h"
#include "attention/sdpa_common.h"
#include "attention/sdpa_context.h"
#include "attention/sdpa_plan.h"
#include "attention/sdpa_rows.h"
#include "attention/sdpa_tiles.h"
#include "attention/sdpa_weights_tile.h"
#include "attnx/attention.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {

using namespace sdpa;

// Scratch memory of the calling thread, uninitialised, kept between calls
// (it only grows): a small call pays neither an allocation nor a fill.
template <typename T>
T* calling_thread_scratch(size_t size) {
  thread_local CacheLineArray<T> buffer;
  thread_local size_t capacity = 0;
  if (size > capacity) {
    buffer = cache_line_array<T>(size);
    capacity = size;
  }
  return buffer.get();
}

// The call as the planner sees it.
template <typename T>
SdpaShape describe(const SdpaArgs<T>& a) {
  SdpaShape call;
  call.B = a.query.shape[0], call.Hq = a.query.shape[1], call.L = a.query.shape[2];
  call.Hk = a.key.shape(1), call.S = a.key.shape(2), call.E = a.query.shape[3];
  call.Ev = a.value.shape(3);
  // Keys past every batch's key length are never read.
  call.S_read = call.S;
  if (a.range.key_lengths)
    call.S_read = *std::max_element(a.range.key_lengths, a.range.key_lengths + call.B);
  call.element_size = int(sizeof(T));
  const auto stored = [](const StoredView<T>& v) {
    StoredShape s;
    s.native = v.storage == Storage::kNative;
    s.element_size = v.element_size();
    s.batch_broadcast = v.stride(0) == 0;
    s.head_broadcast = v.stride(1) == 0;
    return s;
  };
  call.keys = stored(a.key);
  call.values = stored(a.value);
  call.masks = a.masks[0].present() || a.masks[1].present();
  call.banded = a.range.banded();
  call.key_lengths = a.range.key_lengths != nullptr;
  call.query_lengths = a.range.query_lengths != nullptr;
  call.packed = a.range.packed;
  if (call.packed)
    for (int64_t b = 0; b < call.B; ++b)
      call.pairs += double(query_length(a, b)) * double(key_length(a, b));
  call.weights = a.weights != nullptr;
  call.int8_products = a.precision == Precision::kInt8;
  call.values_on_lines = call.values.native && value_rows_on_lines(a, 0, 0);
  return call;
}

// The plan of a call as described.
template <typename T>
SdpaPlan plan_of(const SdpaShape& call, const KernelTable<T>& kt) {
  const bool pairs = call.bf16_products && bf16_products() == Bf16Products::kPairs;
  return plan_sdpa(call, KernelFacts{kt.query_tile, kt.vector_width, pairs},
                   threads_for(sdpa_work(call)));
}

template <typename T>
void run_planned(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaShape& call,
                 const SdpaPlan& plan, const Bf16Operands* bf16,
                 const Int8Queries* int8 = nullptr);
template <typename T>
bool run_split(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaShape& call,
               const Bf16Operands* bf16);

// A call with bfloat16 products: planned as the call it is (the planner
// knows what each path then reads), and its operands rounded for the path
// planned (into a16). A paged step whose products are float32 multiply-adds
// reads the pool in place on either path (the tile path rounds each block
// as it reads it): its operands serve both, and it splits as at the default
// precision.
static void sdpa_forward_bf16(const SdpaArgs<float>& args, const KernelTable<float>& kt) {
  SdpaShape call = describe(args);
  call.bf16_products = true;
  SdpaArgs<float> a16;
  Bf16Operands ops;
  if (args.key.paged.present() && args.range.packed &&
      bf16_products() == Bf16Products::kFloat) {
    prepare_bf16(args, kt, SdpaPath::kTiles, ops, a16);
    if (run_split(a16, kt, call, &ops)) return;
    run_planned(a16, kt, call, plan_of(call, kt), &ops);
    return;
  }
  const SdpaPlan plan = plan_of(call, kt);
  prepare_bf16(args, kt, plan.path, ops, a16);
  run_planned(a16, kt, call, plan, &ops);
}

template <typename T>
void sdpa_forward(const SdpaArgs<T>& a) {
  if (a.query.shape[0] == 0 || a.query.shape[1] == 0 || a.query.shape[2] == 0 ||
      a.value.shape(3) == 0)
    return;
  if (a.range.packed && (a.weights || a.masks[0].present() || a.masks[1].present() ||
                         a.mask_cols != a.key.shape(2)))
    throw std::invalid_argument("sdpa_forward: packed sequences take no weights and no masks");
  const KernelTable<T>& kt = active_kernels(T());
  if (a.precision == Precision::kInt8 &&
      (a.key.storage != Storage::kInt8 || a.value.storage != Storage::kInt8 || a.weights))
    throw std::invalid_argument(
        "precision 'int8' multiplies int8 keys and values (an int8 cache), without weights");
  if constexpr (std::is_same_v<T, float>) {
    if (a.precision == Precision::kBFloat16) return sdpa_forward_bf16(a, kt);
    if (a.precision == Precision::kInt8) {
      const SdpaShape call = describe(a);
      const Int8Queries queries(a);
      run_planned(a, kt, call, plan_of(call, kt), nullptr, &queries);
      return;
    }
  }
  const SdpaShape call = describe(a);
  if (a.key.paged.present() && a.range.packed && run_split(a, kt, call, nullptr)) return;
  run_planned(a, kt, call, plan_of(call, kt), nullptr);
}

// One planned part of a call: the call as its plan sees it, the plan, and,
// for packed sequences, the query lengths it takes (0 for another part's
// sequences), else null.
struct SdpaPart {
  SdpaShape call;
  SdpaPlan plan;
  const int64_t* query_lengths = nullptr;
};

constexpr int kMaxParts = 2;  // a call's plans: one, or a paged step's two (run_split)

// A part as it runs: its context and its tasks.
template <typename T>
struct PartRun {
  SdpaContext<T> context;
  SdpaTasks tasks;
  PartRun(const SdpaContext<T>& c, int64_t B, int64_t L, const int64_t* query_lengths,
          const int64_t* key_lengths)
      : context(c), tasks(c.plan, B, L, query_lengths, key_lengths) {}
};

template <typename T>
void run_parts(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaPart* parts, int count,
               const Bf16Operands* bf16, const Int8Queries* int8 = nullptr);

// The call's tasks, as planned; bf16: the rounded operands of bfloat16
// products (a is then theirs), else null; int8: the quantized queries of
// int8 products, else null.
template <typename T>
void run_planned(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaShape& call,
                 const SdpaPlan& plan, const Bf16Operands* bf16, const Int8Queries* int8) {
  const SdpaPart part{call, plan, a.range.packed ? a.range.query_lengths : nullptr};
  run_parts(a, kt, &part, 1, bf16, int8);
}

// The call as a plan sees it when it takes only the packed sequences whose
// `lengths` are not 0: its longest queries, keys and their pairs.
template <typename T>
SdpaShape part_of(const SdpaArgs<T>& a, const SdpaShape& call, const std::vector<int64_t>& lengths) {
  SdpaShape part = call;
  part.L = part.S_read = 0;
  part.pairs = 0;
  for (int64_t b = 0; b < call.B; ++b) {
    if (lengths[size_t(b)] == 0) continue;
    part.L = std::max(part.L, lengths[size_t(b)]);
    part.S_read = std::max(part.S_read, key_length(a, b));
    part.pairs += double(lengths[size_t(b)]) * double(key_length(a, b));
  }
  return part;
}

// A paged step that holds both sequences of many queries (prefill chunks)
// and of few (decoding) runs each kind on its own path -- query tiles for
// the first, grouped rows split into key chunks for the others -- in one
// parallel loop, where one plan for all would run every decoding row as a
// tile of 16 lanes. Each sequence's rows are then those of a call of its
// kind alone. False where the step holds one kind only.
template <typename T>
bool run_split(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaShape& call,
               const Bf16Operands* bf16) {
  // Integer products take the row path for every sequence (plan_sdpa).
  if (call.int8_products) return false;
  std::vector<int64_t> many(size_t(call.B), 0), few(size_t(call.B), 0);
  bool any_many = false, any_few = false;
  for (int64_t b = 0; b < call.B; ++b) {
    const int64_t rows = query_length(a, b);
    // The planner's rule for the path of a call (plan_sdpa), per sequence.
    if (rows * 4 > kt.query_tile) {
      many[size_t(b)] = rows, any_many = true;
    } else {
      few[size_t(b)] = rows, any_few = any_few || rows > 0;
    }
  }
  if (!any_many || !any_few) return false;
  SdpaPart parts[2];
  parts[0].call = part_of(a, call, many);
  parts[1].call = part_of(a, call, few);
  parts[0].query_lengths = many.data();
  parts[1].query_lengths = few.data();
  for (SdpaPart& part : parts) part.plan = plan_of(part.call, kt);
  run_parts(a, kt, parts, 2, bf16);
  return true;
}

template <typename T>
void run_parts(const SdpaArgs<T>& a, const KernelTable<T>& kt, const SdpaPart* parts, int count,
               const Bf16Operands* bf16, const Int8Queries* int8) {
  int nthreads = 1;
  size_t scratch_per_thread = 0;
  for (int p = 0; p < count; ++p) {
    nthreads = std::max(nthreads, parts[p].plan.threads);
    scratch_per_thread = std::max(scratch_per_thread, parts[p].plan.scratch_per_thread);
  }
  const SdpaPlan& first = parts[0].plan;  // the plan that may align values, check them or map masks
  // Allocated before the parallel loop: an allocation failure raises here
  // (MemoryError in Python) rather than inside a worker thread.
  // The chunk states after the threads' scratch, in the same buffer: every
  // task writes its rows' states before the merge reads them, so they need
  // no clearing (a long sequence's states are megabytes: cleared and paged
  // in afresh on every call, they cost a decoding step a fifth of its time).
  size_t states_total = 0;
  for (int p = 0; p < count; ++p) states_total += parts[p].plan.states_size;
  T* scratch = calling_thread_scratch<T>(size_t(nthreads) * scratch_per_thread + states_total);
  std::vector<AlignedValues<T>> aligned_values(first.align_values ? nthreads : 0);
  for (int i = 0; i < int(aligned_values.size()); ++i) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(scratch + (i + 1) * scratch_per_thread);
    const uintptr_t start = end - first.values_copy_size * sizeof(T);
    aligned_values[i].data = reinterpret_cast<T*>((start + 63) / 64 * 64);
    aligned_values[i].ld = first.values_ld;
  }
  T* states[kMaxParts] = {};
  T* next_states = scratch + size_t(nthreads) * scratch_per_thread;
  for (int p = 0; p < count; ++p) {
    states[p] = next_states;
    next_states += parts[p].plan.states_size;
  }
  FiniteRows finite_values;
  if (first.finite_values)
    finite_values.take(a, kt, parts[0].call.B, parts[0].call.Hk, parts[0].call.S_read, nthreads);
  MaskBlockMap<T> mask_blocks;
  if (first.mask_blocks) mask_blocks.build(a, kt, kt.query_tile, nthreads);
  // In place, not on the heap: a small call pays no allocation for them.
  std::optional<PartRun<T>> runs[kMaxParts];
  int64_t total = 0;
  for (int p = 0; p < count; ++p) {
    runs[p].emplace(SdpaContext<T>{a, kt, parts[p].plan, finite_values, mask_blocks, states[p],
                                   bf16, int8},
                    parts[p].call.B, parts[p].call.L, parts[p].query_lengths,
                    parts[p].query_lengths ? a.range.key_lengths : nullptr);
    total += runs[p]->tasks.count();
  }

  // Each thread runs a contiguous share of the tasks, in which a head's tasks
  // follow each other, so its keys and values are read into that core's
  // cache alone; a thread done with its share takes the end of another's
  // (parallel_for). Handing out whole heads to whichever thread is free
  // instead, a core slowed for a moment leaves the other idle for up to a
  // head's time at the end (see docs/tuning.md).
  parallel_for(total, nthreads, [&](int64_t t) {
    int p = 0;
    while (t >= runs[p]->tasks.count()) t -= runs[p++]->tasks.count();
    const SdpaContext<T>& context = runs[p]->context;
    const SdpaPlan& plan = context.plan;
    T* my_scratch = scratch + current_thread() * scratch_per_thread;
    const SdpaTask task = runs[p]->tasks.at(t);
    const int64_t b = task.b, h = task.h, c = task.c;
    const int64_t qb = task.qg * plan.group;
    const int64_t r0 = qb * plan.rows_per_task;
    const int64_t r1 = std::min(task.rows_per_head, r0 + plan.rows_per_task);
    switch (plan.path) {
      case SdpaPath::kTiles:
        flash_tiles(context, b, h, r0, std::min(plan.group, task.q_blocks - qb), my_scratch,
                    plan.align_values ? &aligned_values[current_thread()] : nullptr);
        break;
      case SdpaPath::kWeightsTile:
        weights_tile(context, b, h, r0, my_scratch);
        break;
      case SdpaPath::kRowsWithWeights:
        rows_with_weights(context, b, h, r0, r1, my_scratch);
        break;
      case SdpaPath::kRows:
        flash_rows(context, b, h, r0, r1, c, my_scratch);
        break;
    }
  });
  for (int p = 0; p < count; ++p) {
    const SdpaPlan& plan = parts[p].plan;
    if (plan.chunks == 1) continue;
    const int64_t chunks = plan.chunks, Hq = parts[p].call.Hq, L = plan.L, Ev = parts[p].call.Ev;
    const int64_t state_size = plan.state_size;
    const int64_t* lengths = parts[p].query_lengths;
    const T* part_states = states[p];
    const SdpaTasks& part_tasks = runs[p]->tasks;
    // Its own thread count: merging a decoding step's few rows is far less
    // work than waking a worker for it.
    const int64_t rows = parts[p].call.B * Hq * L;
    parallel_for(rows, threads_for(double(rows) * double(chunks) * double(Ev)), [&](int64_t row) {
      const int64_t bh = row / L, i = row % L;
      // Packed: rows past the sequence's are another's (or another part's).
      if (i >= (lengths ? lengths[bh / Hq] : query_rows(a, bh / Hq))) return;
      // Only the chunks the sequence has keys in were run (and wrote states).
      merge_chunks(part_states + row * chunks * state_size, part_tasks.chunks(bh / Hq), state_size,
                   Ev, a.out.at(bh / Hq, bh % Hq, i));
    });
  }
}

template void sdpa_forward<float>(const SdpaArgs<float>&);
template void sdpa_forward<double>(const SdpaArgs<double>&);

}  // namespace attnx
