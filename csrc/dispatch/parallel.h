// The drivers' parallel loops.
#pragma once

#include <cstdint>

#include "dispatch/worker_pool.h"

namespace attnx {

// Threads to use for a call doing about `work` multiply-adds: 1 for small
// calls, the configured count otherwise.
int threads_for(double work);

// The most threads a loop is given (threads.cpp).
int max_useful_threads();

// What one element read from memory (or the last-level cache) and used for
// a few multiply-adds counts for in threads_for's work: a decoding step or
// the projections of a few rows take the memory's time, not the
// multiply-adds': a decoding step of fewer multiply-adds than threads_for's
// serial limit can take long enough to gain from more threads
// (measurements: docs/tuning.md).
constexpr double kStreamedElementWork = 8;

// body(i) for every i in [0, n), on up to `threads` threads (worker_pool.h):
// each thread starts on a contiguous share of the iterations, in order, so
// that what it reads (a head's keys and values, a block of weights) stays in
// its own core's cache, and one whose share is done takes the back half of
// the largest share left (BalancedShares). Which thread runs an iteration
// never changes a result. With one thread it is a plain loop: a small call
// pays nothing for the pool.
template <typename Body>
void parallel_for(int64_t n, int threads, const Body& body) {
  if (threads > 1 && n > 1) {
    run_claimed_loop(
        n, threads, [](const void* b, int64_t i) { (*static_cast<const Body*>(b))(i); }, &body);
    return;
  }
  SerialLoopScope scope;
  for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace attnx
