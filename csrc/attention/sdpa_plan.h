// How a call of scaled dot-product attention is run: its path, how its work
// is cut into tasks, and the scratch they need. plan_sdpa is a pure function
// of a plain description of the call (SdpaShape), two facts of the active
// kernel and the thread count, so that the choices can be tested without
// running them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace attnx::sdpa {

// Keys or values as the call stores them: what their bytes in memory depend on.
struct StoredShape {
  int element_size = 4;          // bytes of one stored element (2: 16-bit storage)
  bool native = true;            // stored as the compute dtype (not widened)
  bool batch_broadcast = false;  // batch axis of stride 0: every batch reads the same rows
  bool head_broadcast = false;   // head axis of stride 0
};

// The canonical call (B, Hq, L, E) x (B, Hk, S, E) -> (B, Hq, L, Ev), as the
// planner sees it.
struct SdpaShape {
  int64_t B = 0, Hq = 0, Hk = 0, L = 0, S = 0, E = 0, Ev = 0;
  int64_t S_read = 0;  // keys read: the largest key length, else S
  int element_size = 4;  // sizeof(T) of the compute dtype: 4 or 8
  StoredShape keys, values;
  bool masks = false;          // any mask present
  bool banded = false;         // a causal band or a sliding window
  bool key_lengths = false;    // per-batch key lengths
  bool query_lengths = false;  // per-batch query lengths
  // Sequences packed end to end (KeyRange::packed): no batch has rows past
  // its lengths, and pairs (below) counts the query-key pairs they have.
  bool packed = false;
  double pairs = 0;            // packed: sum over batches of qlen * klen
  bool weights = false;        // the probabilities are wanted
  // Products of bfloat16 operands (Precision::kBFloat16; see sdpa_bf16.h):
  // the tile path reads the keys and the values as bfloat16 pairs, or as
  // float32 copies (KernelFacts::bf16_pairs).
  bool bf16_products = false;
  // Integer products over int8 keys and values (Precision::kInt8): the row
  // path, whatever the number of queries (its kernels alone have them).
  bool int8_products = false;
  bool values_on_lines = true; // the value rows of (0, 0) start on cache lines
};

// What the planner needs of the active kernel table.
struct KernelFacts {
  int query_tile = 16;   // queries per flash tile
  int vector_width = 8;  // lanes of one vector
  bool bf16_pairs = true;  // bfloat16 products as pairs (Bf16Products::kPairs)
};

enum class SdpaPath {
  kTiles,            // flash_tiles: query tiles, no weights
  kWeightsTile,      // weights_tile: a tile of queries with its weights
  kRowsWithWeights,  // rows_with_weights: one row at a time with its weights
  kRows,             // flash_rows: rows of the heads that share a key head, in key chunks
};

const char* path_name(SdpaPath path);

struct SdpaPlan {
  SdpaPath path = SdpaPath::kRows;
  int threads = 1;
  int64_t S_read = 0;         // keys read (as in SdpaShape)
  // Tasks: B x heads x q_groups x chunks, in that order (chunks innermost).
  int64_t heads = 0;          // per batch: Hk on the row path (grouped), else Hq
  int64_t rows_per_head = 0;  // query rows of one head: (Hq / Hk) * L on the row path, else L
  int64_t rows_per_task = 0;  // a query tile on the tile paths, kQueryBlock on the row paths
  int64_t q_blocks = 0;       // blocks of rows_per_task rows per head
  int64_t group = 1;          // query tiles per task (flash_tiles)
  int64_t q_groups = 0;       // tasks per head and chunk
  int64_t chunks = 1;         // key chunks per row (flash_rows): at most, where sequences differ
  bool int8_products = false; // the chunks' keys: row_key_chunk
  int64_t tasks = 0;
  int64_t key_block = 0;      // keys per block on the tile paths
  bool ask_ahead = false;     // the first tile of each task asks for its keys and values ahead
  bool align_values = false;  // each thread copies a head's values onto cache lines
  bool finite_values = false; // take FiniteRows of the values once for the call
  bool mask_blocks = false;   // build the MaskBlockMap
  int64_t values_ld = 0;      // row stride of the aligned values' copy
  size_t values_copy_size = 0;    // elements of one thread's copy, with room to align it
  size_t scratch_per_thread = 0;  // elements (values' copy included)
  int64_t state_size = 0;         // elements of one row's state per chunk (m, l, open, acc)
  size_t states_size = 0;         // elements of the chunk states (0: one chunk)
  int64_t L = 0;                  // query rows per head of the call planned: the states' layout
};

// The work that sets the thread count: the multiply-adds, plus the keys and
// values read (see kStreamedElementWork).
double sdpa_work(const SdpaShape& call);

// Where a task of a plan works: batch b, head h (a key head on the row
// path), query group qg and key chunk c; the batch's query blocks and rows
// per head.
struct SdpaTask {
  int64_t b = 0, h = 0, qg = 0, c = 0;
  int64_t q_blocks = 0, rows_per_head = 0;
};

// The tasks of a plan, in order: batch, head, query group, key chunk. A
// packed call's batches have tasks for their own query rows and key chunks
// only (a batch of one long sequence among short ones is then cut as finely
// as a call of it alone, and the short ones get no task for keys they do not
// have), so task t lies in the batch b with first[b] <= t < first[b + 1].
class SdpaTasks {
 public:
  // query_lengths, key_lengths: a packed call's (B), else null.
  SdpaTasks(const SdpaPlan& plan, int64_t B, int64_t L, const int64_t* query_lengths,
            const int64_t* key_lengths);
  int64_t count() const { return count_; }
  SdpaTask at(int64_t t) const;
  // The key chunks of batch b's rows: those whose states a merge takes.
  int64_t chunks(int64_t b) const { return chunks_.empty() ? plan_.chunks : chunks_[size_t(b)]; }

 private:
  const SdpaPlan& plan_;
  int64_t count_ = 0;
  int64_t heads_per_row_ = 1;    // query heads a row group spans (rows_per_head / L)
  std::vector<int64_t> first_;   // packed: (B + 1)
  std::vector<int64_t> chunks_;  // packed: (B), each in [1, plan.chunks]
  const int64_t* query_lengths_ = nullptr;
};

// The plan of a call that has work (B, Hq, L and Ev all > 0), run on `threads`
// threads (threads_for(sdpa_work(call))).
SdpaPlan plan_sdpa(const SdpaShape& call, const KernelFacts& kernel, int threads);

}  // namespace attnx::sdpa
