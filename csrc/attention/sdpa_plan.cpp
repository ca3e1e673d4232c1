// The plan of a call of scaled dot-product attention (see sdpa_plan.h).
#include "attention/sdpa_plan.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "attention/sdpa_rows.h"
#include "attention/sdpa_tiles.h"
#include "attention/sdpa_weights_tile.h"
#include "dispatch/parallel.h"

namespace attnx::sdpa {
namespace {

template <typename T>
SdpaPlan plan_for(const SdpaShape& call, const KernelFacts& kernel, int nthreads) {
  const int64_t B = call.B, Hq = call.Hq, Hk = call.Hk, L = call.L, S = call.S;
  const int64_t E = call.E, Ev = call.Ev, S_read = call.S_read;
  SdpaPlan plan;
  plan.threads = nthreads;
  plan.S_read = S_read;

  // The tile path wants most of a tile's lanes busy; fewer queries per head
  // (decoding) and the weights take the row path. The row path without
  // weights takes the query rows of all heads that share a key head
  // together, and splits long key sequences into chunks merged afterwards,
  // so that one (b, key head) of a decoding step can use every core. The
  // split depends on the shape only, never on the thread count. With a
  // quarter of a tile of queries or fewer, the row path is the faster (see
  // docs/tuning.md).
  const bool tiled = !call.weights && !call.int8_products && L * 4 > kernel.query_tile;
  const bool weights_tiled =
      call.weights && L * 4 >= kernel.query_tile && weights_tile_fits<T>(kernel.query_tile, S);
  const bool grouped = !tiled && !call.weights;
  plan.path = tiled           ? SdpaPath::kTiles
              : weights_tiled ? SdpaPath::kWeightsTile
              : call.weights  ? SdpaPath::kRowsWithWeights
                              : SdpaPath::kRows;
  const int64_t heads = grouped ? Hk : Hq;
  const int64_t rows_per_head = grouped ? (Hq / Hk) * L : L;
  const int64_t rows_per_task = tiled || weights_tiled ? kernel.query_tile : kQueryBlock;
  const int64_t q_blocks = (rows_per_head + rows_per_task - 1) / rows_per_task;
  const int64_t key_chunk = row_key_chunk(call.int8_products, S_read);
  const int64_t chunks = grouped ? std::max<int64_t>(1, (S_read + key_chunk - 1) / key_chunk) : 1;
  const bool skips_blocks = call.masks || call.banded || call.key_lengths || call.query_lengths;
  const int64_t key_block = tile_key_block<T>(kernel.query_tile, E, Ev, skips_blocks);
  // Query tiles per task (flash_tiles): several where each tile's keys span
  // several chunks, with tasks enough left to share out; the bits do not
  // depend on it.
  int64_t group = 1;
  if (tiled && S_read > kTileChunk &&
      double(S_read) * double(E + Ev) * sizeof(T) > kTileGroupMinKeyBytes) {
    const size_t buffer_bytes = flash_tile_buffers_size<T>(kernel.query_tile, E, Ev) * sizeof(T);
    group = std::clamp<int64_t>(int64_t(kTileGroupBytes / buffer_bytes), 1, kMaxTileGroup);
    group = std::min({group, q_blocks,
                      std::max<int64_t>(1, B * heads * q_blocks / (4 * int64_t(nthreads)))});
  }
  const int64_t q_groups = (q_blocks + group - 1) / group;
  // Whether the first tile of each task asks for its keys and values ahead
  // (see kAheadMinCallBytes): where they come from memory, and each task
  // reads a head's from beyond L2.
  // (The bytes in memory: a batch or head axis of stride 0, broadcast,
  // reads the same rows again.)
  const auto head_bytes_and_count = [&](const StoredShape& v, int64_t cols) {
    const double element = double(v.element_size);
    const double heads = double(!v.batch_broadcast ? B : 1) * double(!v.head_broadcast ? Hk : 1);
    return std::make_pair(double(S_read) * double(cols) * element, heads);
  };
  // With bfloat16 products the tile path reads bfloat16 keys and value
  // pairs, or float32 copies of them, whatever the call stores; the copies'
  // rows start on cache lines where whole lines hold them.
  StoredShape keys_read = call.keys, values_read = call.values;
  bool values_on_lines = call.values_on_lines;
  if (tiled && call.bf16_products) {
    keys_read.element_size = values_read.element_size = kernel.bf16_pairs ? 2 : 4;
    keys_read.native = values_read.native = !kernel.bf16_pairs;
    if (!kernel.bf16_pairs) values_on_lines = Ev * int64_t(sizeof(T)) % 64 == 0;
  }
  const auto [key_head_bytes, key_heads] = head_bytes_and_count(keys_read, E);
  const auto [value_head_bytes, value_heads] = head_bytes_and_count(values_read, Ev);
  const double head_bytes = key_head_bytes + value_head_bytes;
  const bool ask_ahead =
      tiled && key_heads * key_head_bytes + value_heads * value_head_bytes > kAheadMinCallBytes &&
      (q_groups == 1 || head_bytes > kTileGroupMinKeyBytes);
  // Each thread's copy of a head's values, where their rows miss the cache
  // lines (see AlignedValues): at the end of its scratch.
  const int64_t values_ld = aligned_values_ld<T>(Ev);
  const double values_copy_bytes = double(S) * double(values_ld) * sizeof(T);
  const bool align_values =
      tiled && values_read.native && !ask_ahead &&
      q_blocks >= min_tiles_to_align<T>(kernel.vector_width) &&
      values_copy_bytes <= kAlignedValuesMaxBytes &&
      values_copy_bytes * nthreads <= kAlignedValuesMaxCallBytes && !values_on_lines &&
      !call.packed;  // a packed batch's rows past its keys are another's
  const size_t values_copy_size = align_values ? size_t(S * values_ld) + 64 / sizeof(T) : 0;
  const int qt = kernel.query_tile;
  plan.scratch_per_thread =
      values_copy_size +
      (tiled           ? size_t(group) * flash_tile_buffers_size<T>(qt, E, Ev) +
                            flash_visit_scratch_size<T>(qt, E, Ev, key_block)
       : weights_tiled ? weights_tile_scratch_size<T>(qt, kernel.vector_width, S, E, Ev, key_block)
       : call.weights  ? size_t(kKeyBlock * (E + Ev))
                       : rows_scratch_size<T>(E, Ev));

  plan.heads = heads;
  plan.rows_per_head = rows_per_head;
  plan.rows_per_task = rows_per_task;
  plan.q_blocks = q_blocks;
  plan.group = group;
  plan.q_groups = q_groups;
  plan.chunks = chunks;
  plan.int8_products = call.int8_products;
  plan.tasks = B * heads * q_groups * chunks;
  plan.key_block = key_block;
  plan.ask_ahead = ask_ahead;
  plan.align_values = align_values;
  plan.values_ld = values_ld;
  plan.values_copy_size = values_copy_size;
  plan.state_size = Ev + 3;
  plan.states_size = chunks > 1 ? size_t(B * Hq * L * chunks * plan.state_size) : 0;
  plan.L = L;
  // With masks, most query tiles close a key in most blocks, and each then
  // checks that block's values (see visit_flash_chunk): the checks are made once.
  plan.finite_values = tiled && call.masks && values_read.native;
  plan.mask_blocks = call.masks && (tiled || weights_tiled);
  return plan;
}

}  // namespace

const char* path_name(SdpaPath path) {
  switch (path) {
    case SdpaPath::kTiles: return "tiles";
    case SdpaPath::kWeightsTile: return "weights_tile";
    case SdpaPath::kRowsWithWeights: return "rows_with_weights";
    case SdpaPath::kRows: return "rows";
  }
  return "?";
}

double sdpa_work(const SdpaShape& call) {
  const double streamed =
      double(call.B * call.Hk) * double(call.S_read) * double(call.E + call.Ev);
  const double products =
      call.packed ? double(call.Hq) * call.pairs
                  : double(call.B * call.Hq) * double(call.L) * double(call.S_read);
  return products * double(call.E + call.Ev) + kStreamedElementWork * streamed;
}

SdpaTasks::SdpaTasks(const SdpaPlan& plan, int64_t B, int64_t L, const int64_t* query_lengths,
                     const int64_t* key_lengths)
    : plan_(plan), count_(plan.tasks), query_lengths_(query_lengths) {
  if (!query_lengths) return;
  heads_per_row_ = L > 0 ? plan.rows_per_head / L : 1;
  first_.resize(size_t(B + 1));
  chunks_.resize(size_t(B));
  first_[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows = heads_per_row_ * query_lengths[b];
    const int64_t q_blocks = (rows + plan.rows_per_task - 1) / plan.rows_per_task;
    const int64_t q_groups = (q_blocks + plan.group - 1) / plan.group;
    const int64_t key_chunk = row_key_chunk(plan.int8_products, key_lengths ? key_lengths[b] : 0);
    const int64_t chunks =
        key_lengths ? std::clamp<int64_t>((key_lengths[b] + key_chunk - 1) / key_chunk, 1,
                                          plan.chunks)
                    : plan.chunks;
    chunks_[size_t(b)] = chunks;
    first_[size_t(b + 1)] = first_[size_t(b)] + plan.heads * q_groups * chunks;
  }
  count_ = first_.back();
}

SdpaTask SdpaTasks::at(int64_t t) const {
  SdpaTask task;
  int64_t q_groups = plan_.q_groups;
  task.q_blocks = plan_.q_blocks, task.rows_per_head = plan_.rows_per_head;
  if (query_lengths_) {
    task.b = int64_t(std::upper_bound(first_.begin(), first_.end(), t) - first_.begin()) - 1;
    t -= first_[size_t(task.b)];
    task.rows_per_head = heads_per_row_ * query_lengths_[task.b];
    task.q_blocks = (task.rows_per_head + plan_.rows_per_task - 1) / plan_.rows_per_task;
    q_groups = (task.q_blocks + plan_.group - 1) / plan_.group;
  }
  const int64_t chunks = query_lengths_ ? chunks_[size_t(task.b)] : plan_.chunks;
  task.c = t % chunks;
  task.qg = (t / chunks) % q_groups;
  const int64_t bh = t / (chunks * q_groups);
  if (query_lengths_) {
    task.h = bh;
  } else {
    task.b = bh / plan_.heads, task.h = bh % plan_.heads;
  }
  return task;
}

SdpaPlan plan_sdpa(const SdpaShape& call, const KernelFacts& kernel, int threads) {
  if (call.element_size == int(sizeof(float))) return plan_for<float>(call, kernel, threads);
  if (call.element_size == int(sizeof(double))) return plan_for<double>(call, kernel, threads);
  throw std::invalid_argument("plan_sdpa: element_size must be 4 or 8");
}

}  // namespace attnx::sdpa
