// The threads that run a parallel loop beside the thread that calls it.
//
// A loop's iterations are claimed, never assigned: the calling thread starts
// on them at once, and the pool's workers join as the OS runs them, each
// taking iterations through BalancedShares. The caller then waits only for
// the iterations already claimed, never for a worker: one that the OS has not
// run yet (another process holds its core) finds nothing left when it
// arrives, and the call has long returned. A team with a barrier at the end
// of every region (OpenMP's) waits for that thread instead, once per region:
// on a machine with other work, milliseconds per call (docs/threads.md).
#pragma once

#include <cstdint>

namespace attnx {

// One iteration of a loop: invoke(body, i).
using LoopInvoker = void (*)(const void* body, int64_t i);

// Runs invoke(body, i) for every i in [0, n) on the calling thread and up to
// `threads` - 1 of the process's workers, and returns when every one has run.
// While another thread's loop holds the workers (concurrent calls from
// several Python threads, or a loop inside a loop), the calling thread runs
// its loop alone: the results are the same on any number of threads.
void run_claimed_loop(int64_t n, int threads, LoopInvoker invoke, const void* body) noexcept;

// The number, in [0, threads), of the calling thread in the loop it is
// running: 0 for the caller and outside loops. Indexes the threads' scratch.
int current_thread();

// Sets the calling thread's number to 0 for as long as it lives: a loop run
// on one thread, inside another loop's iteration, indexes its own scratch.
class SerialLoopScope {
 public:
  SerialLoopScope();
  ~SerialLoopScope();
  SerialLoopScope(const SerialLoopScope&) = delete;
  SerialLoopScope& operator=(const SerialLoopScope&) = delete;

 private:
  int saved_;
};

}  // namespace attnx
