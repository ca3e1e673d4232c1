// Helpers for the drivers' parallel loops; they compile without OpenMP too.
#pragma once

#include <cstdint>

#include "dispatch/balanced_shares.h"

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {

// Threads to use for a call doing about `work` multiply-adds: 1 for small
// calls, the configured count otherwise.
int threads_for(double work);

// What one element read from memory (or the last-level cache) and used for
// a few multiply-adds counts for in threads_for's work: a decoding step or
// the projections of a few rows take the memory's time, not the
// multiply-adds': a decoding step of fewer multiply-adds than threads_for's
// serial limit can take long enough to gain from more threads
// (measurements: docs/tuning.md).
constexpr double kStreamedElementWork = 8;

inline int current_thread() {
#ifdef ATTNX_HAVE_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

enum class Schedule {
  kStatic,   // contiguous, equal shares of the iterations
  kBalanced  // kStatic's shares, run from the front by their threads and
             // from the back by threads whose own are done (BalancedShares):
             // for loops of long iterations, where a core slowed by another
             // process would otherwise hold up the call
};

// body(i) for every i in [0, n), on `threads` threads. With one thread it is
// a plain loop: an OpenMP region, even one made serial by an if clause, ends
// on a barrier that costs the caller futex system calls, a noticeable part
// of a small attention call (measurements: docs/tuning.md).
template <typename Body>
void parallel_for(int64_t n, int threads, Schedule schedule, const Body& body) {
#ifdef ATTNX_HAVE_OPENMP
  if (threads > 1 && n > 1) {
    if (schedule == Schedule::kBalanced && BalancedShares::fits(n)) {
      // A team given fewer threads than asked leaves shares that no thread
      // owns; the others take them.
      BalancedShares shares(n, threads);
#pragma omp parallel num_threads(threads)
      {
        const int thread = omp_get_thread_num();
        for (int64_t i = shares.next(thread); i >= 0; i = shares.next(thread)) body(i);
      }
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
      for (int64_t i = 0; i < n; ++i) body(i);
    }
    return;
  }
#else
  (void)threads, (void)schedule;
#endif
  for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace attnx
