// The shares of a parallel loop's iterations that its threads run and take
// from each other (worker_pool.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace attnx {

// The iterations [0, n) as one contiguous share per thread, as a static
// schedule cuts them. A thread runs its share from the front, in order, so
// what it reads stays in its own core's cache (a head's keys and values, a
// block of weights); one whose share is done takes the back half of the
// largest share left, so that where a core is slowed (another process on
// it, a busy neighbour of the VM) the others take over the end of its share
// instead of waiting for it.
//
// A share is one 64-bit word holding [begin, end) in its halves and changed
// only by compare-and-swap: its owner advances begin, a thief lowers end. A
// stale word that still compares equal is still true: an iteration once run
// never returns to a share, so equal words with begin < end hold the same
// iterations, none of them run yet.
class BalancedShares {
 public:
  // Whether n iterations fit the words' halves.
  static constexpr bool fits(int64_t n) { return n >= 0 && n < (int64_t(1) << 31); }

  // Room for loops of up to `capacity` threads.
  explicit BalancedShares(int capacity);

  // Cuts [0, n) into `threads` (at most the capacity) shares.
  void reset(int64_t n, int threads);

  // The next iteration for `thread` (in [0, threads)) to run, or -1 when no
  // share holds one.
  int64_t next(int thread);

 private:
  struct alignas(64) Share {  // one cache line each: no false sharing
    std::atomic<uint64_t> word{0};
  };
  int threads_;
  std::unique_ptr<Share[]> shares_;
};

// For the tests: runs a parallel loop of n iterations on `threads` threads,
// each iteration sleeping `microseconds`, or `slow_microseconds` on thread
// `slow_thread`. Returns how many times each iteration ran, and in
// `ran_on` the thread that ran it (the last, were it run twice).
std::vector<int32_t> trace_balanced_loop(int64_t n, int threads, int64_t microseconds,
                                         int slow_thread, int64_t slow_microseconds,
                                         std::vector<int32_t>& ran_on);

}  // namespace attnx
