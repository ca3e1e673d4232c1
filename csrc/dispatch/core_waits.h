// Whether a thread shares its core with other busy threads, from the time it
// spends ready to run while the OS runs others (worker_pool.cpp).
#pragma once

#include <chrono>
#include <cstdint>

namespace attnx {

// The time the calling thread has spent ready to run but waiting for a core
// (Linux's /proc/thread-self/schedstat). Elsewhere, and where that file cannot
// be read, always 0: the thread is taken to have its core to itself.
class CoreWaitClock {
 public:
  CoreWaitClock();  // on the thread whose waits it reads
  ~CoreWaitClock();
  CoreWaitClock(const CoreWaitClock&) = delete;
  CoreWaitClock& operator=(const CoreWaitClock&) = delete;

  // Nanoseconds waited since the thread started.
  uint64_t waited_ns() const;

 private:
  int fd_ = -1;
};

// A worker's judgement, round by round (a round: from being woken for a loop
// to leaving it), of whether another busy thread shares its core. A round in
// which it waited over kLongWait for its core counts as a long wait; two
// close together say "shared", and the judgement holds while long waits go
// on coming, until none has for kHold. On a quiet machine a single long wait
// (a timer, a kernel thread) comes seldom and alone, and never says "shared";
// with a busy process on the core, most rounds of a worker that keeps to its
// core wait a time slice (measurements: docs/tuning.md).
class CoreSharing {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kLongWait{500};
  static constexpr std::chrono::milliseconds kHold{200};

  // Adds a round that waited `waited_ns`; returns whether the core is shared.
  bool add_round(uint64_t waited_ns, Clock::time_point now);

 private:
  double recent_ = 0;  // long waits among the last rounds, weighted 1/8 each
  Clock::time_point shared_until_{};
};

}  // namespace attnx
