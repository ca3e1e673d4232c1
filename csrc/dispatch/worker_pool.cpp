#include "dispatch/worker_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define ATTNX_HAVE_PTHREAD_ATFORK 1
#endif

#include "dispatch/balanced_shares.h"
#include "dispatch/core_waits.h"
#include "dispatch/parallel.h"

namespace attnx {
namespace {

thread_local int t_thread = 0;  // current_thread()

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

using Clock = std::chrono::steady_clock;

// How long a worker on a core of its own keeps looking for the next loop
// before it sleeps: long enough to span the gaps between the loops of one
// call and between calls in a row (a decoding step's layers), short enough
// that an idle pool gives its cores back to the machine's other work at once.
// How long a caller waits for its loop's last claimed iterations before it
// sleeps: up to a millisecond while every worker has a core of its own; 50 us
// where one shares its core, so that a worker running on the caller's core
// gets it (measurements: docs/tuning.md).
constexpr auto kWorkerSpin = std::chrono::microseconds(200);
constexpr auto kCallerSpin = std::chrono::microseconds(50);
constexpr auto kCallerSpinAlone = std::chrono::microseconds(1000);

// A worker asleep longer than this was idle: the first round after it says
// nothing of whether its core is shared (see work).
constexpr auto kIdle = std::chrono::milliseconds(5);

// How long a worker on a shared core claims iterations after it is woken,
// and how long it then sleeps before it claims again: a stretch well within
// the time slice the OS gives a thread woken from sleep, so that it sleeps
// again before the slice ends; a sleep that ends the slice
// and leaves the core to the other thread for a while, so that the next
// stretch starts on a fresh one (measurements: docs/tuning.md).
constexpr auto kSharedCoreBudget = std::chrono::microseconds(1000);
constexpr auto kSharedCoreRest = std::chrono::microseconds(500);

// Spins until done() or `limit` has passed; returns done().
template <typename Done>
bool spin_until(const Done& done, Clock::duration limit) {
  if (done()) return true;
  const Clock::time_point end = Clock::now() + limit;
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      cpu_relax();
      if (done()) return true;
    }
    if (Clock::now() >= end) return done();
  }
}

// One loop: what its threads share. A pool has two, used in turns, so that a
// worker still leaving the previous loop never delays the next one.
struct alignas(64) Loop {
  static constexpr uint64_t kClosed = 0;

  explicit Loop(int capacity) : shares(capacity) {}

  // The number of the loop this holds, kClosed once it is complete: a worker
  // that finds another number here leaves without claiming anything.
  std::atomic<uint64_t> number{kClosed};
  // Workers between entering this loop and leaving it: the loop is set up
  // anew only when none is left.
  std::atomic<int> visitors{0};
  std::atomic<int> next_thread{1};   // the caller is thread 0
  std::atomic<int64_t> finished{0};  // iterations run, added by each thread once its claims run out
  std::atomic<bool> caller_asleep{false};
  int threads = 0;
  int64_t base = 0;  // the loop's iterations are base + [0, n)
  int64_t n = 0;
  LoopInvoker invoke = nullptr;
  const void* body = nullptr;
  BalancedShares shares;

  // Claims and runs iterations as thread `thread` until none is left, or
  // until `until` has passed; returns how many it ran.
  int64_t run_claims(int thread, Clock::time_point until = Clock::time_point::max()) {
    const int saved = t_thread;
    t_thread = thread;
    int64_t ran = 0;
    const bool timed = until != Clock::time_point::max();
    for (int64_t i = shares.next(thread); i >= 0; i = shares.next(thread)) {
      invoke(body, base + i);
      ++ran;
      if (timed && Clock::now() >= until) break;
    }
    t_thread = saved;
    return ran;
  }
};

class Pool {
 public:
  explicit Pool(int capacity) : capacity_(capacity), loops_{Loop(capacity), Loop(capacity)} {}

  int capacity() const { return capacity_; }

  // Whether the calling thread may post loops (no other thread's loop is
  // running); it posts them until release().
  bool try_acquire() { return !busy_.exchange(true, std::memory_order_acquire); }
  void release() { busy_.store(false, std::memory_order_release); }

  // Runs invoke(body, base + i) for i in [0, n), n a share word's range.
  void run(int64_t base, int64_t n, int threads, LoopInvoker invoke, const void* body) {
    start_workers(threads - 1);
    threads = std::min(threads, started_ + 1);
    const uint64_t number = posted_.load(std::memory_order_relaxed) + 1;
    Loop& loop = loops_[number % 2];
    // The loop two before this one is complete and closed; a worker may still
    // be leaving it (a few instructions, unless the OS stopped it there).
    while (loop.visitors.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
    loop.threads = threads;
    loop.base = base;
    loop.n = n;
    loop.invoke = invoke;
    loop.body = body;
    loop.shares.reset(n, threads);
    loop.next_thread.store(1, std::memory_order_relaxed);
    loop.finished.store(0, std::memory_order_relaxed);
    loop.caller_asleep.store(false, std::memory_order_relaxed);
    loop.number.store(number, std::memory_order_release);
    posted_.store(number, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      workers_wake_.notify_all();
    }

    const int64_t ran = loop.run_claims(0);
    // seq_cst: with caller_asleep's store and finish's, either the caller
    // sees the last iterations counted or their thread sees it asleep.
    const auto all_run = [&] { return loop.finished.load(std::memory_order_seq_cst) == n; };
    if (loop.finished.fetch_add(ran, std::memory_order_acq_rel) + ran != n &&
        !spin_until(all_run, shared_workers_.load(std::memory_order_relaxed) > 0
                                 ? kCallerSpin
                                 : kCallerSpinAlone)) {
      // Iterations claimed by workers still run: sleep until the last one
      // wakes this thread (see finish).
      loop.caller_asleep.store(true, std::memory_order_seq_cst);
      std::unique_lock<std::mutex> lock(mutex_);
      caller_wake_.wait(lock, all_run);
    }
    loop.number.store(Loop::kClosed, std::memory_order_seq_cst);
  }

 private:
  void start_workers(int want) {
    want = std::min(want, capacity_ - 1);
    while (started_ < want) {
      try {
        std::thread([this] { work(); }).detach();
      } catch (const std::system_error&) {
        return;  // no more threads to be had: the loop runs on those there are
      }
      ++started_;
    }
  }

  // A worker's life. Where another busy thread shares its core (CoreSharing),
  // the OS runs it a time slice at a time, and a thread stopped at the end of
  // a slice holds up the loop whose iteration it was running until its next
  // slice: milliseconds. So on a shared core a worker never spins (it would
  // spend its slice doing so), and claims iterations in stretches of
  // kSharedCoreBudget, each begun on the fresh slice of a thread woken from
  // sleep (see join).
  [[noreturn]] void work() {
    uint64_t seen = posted_.load(std::memory_order_acquire);
    const CoreWaitClock wait_clock;
    uint64_t waited = wait_clock.waited_ns();
    CoreSharing sharing;
    bool shared = false;
    for (;;) {
      const auto posted = [&] { return posted_.load(std::memory_order_seq_cst) != seen; };
      bool idle = false;
      if (shared || !spin_until(posted, kWorkerSpin)) {
        const Clock::time_point asleep = Clock::now();
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        workers_wake_.wait(lock, posted);
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        idle = Clock::now() - asleep > kIdle;
      }
      seen = posted_.load(std::memory_order_acquire);
      join(loops_[seen % 2], seen, shared);
      const uint64_t now_waited = wait_clock.waited_ns();
      // Woken after an idle while, a worker may wait for a core that has to
      // wake up too, or be moved off its caller's: no sign of a busy thread.
      if (!idle) {
        const bool was_shared = shared;
        shared = sharing.add_round(now_waited - waited, Clock::now());
        if (shared != was_shared)
          shared_workers_.fetch_add(shared ? 1 : -1, std::memory_order_relaxed);
      }
      waited = now_waited;
    }
  }

  // Runs what is left of loop `number`, if it is still open. On a shared
  // core, in stretches of kSharedCoreBudget with a sleep between them, so
  // that each stretch starts on a fresh time slice.
  void join(Loop& loop, uint64_t number, bool shared) {
    int thread = -1;
    for (;;) {
      bool rest = false;
      loop.visitors.fetch_add(1, std::memory_order_seq_cst);
      if (loop.number.load(std::memory_order_seq_cst) == number) {
        if (thread < 0) thread = loop.next_thread.fetch_add(1, std::memory_order_relaxed);
        if (thread < loop.threads) {
          const Clock::time_point until =
              shared ? Clock::now() + kSharedCoreBudget : Clock::time_point::max();
          const int64_t ran = loop.run_claims(thread, until);
          if (ran > 0) finish(loop, ran);
          rest = shared && Clock::now() >= until;
        }
      }
      loop.visitors.fetch_sub(1, std::memory_order_release);
      if (!rest) return;
      std::this_thread::sleep_for(kSharedCoreRest);
      if (posted_.load(std::memory_order_acquire) != number) return;  // a newer loop waits
    }
  }

  // Adds a worker's iterations, all run, to the loop's count; the one that
  // completes it wakes the caller if it sleeps.
  void finish(Loop& loop, int64_t ran) {
    if (loop.finished.fetch_add(ran, std::memory_order_seq_cst) + ran == loop.n &&
        loop.caller_asleep.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      caller_wake_.notify_all();
    }
  }

  const int capacity_;
  Loop loops_[2];
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> posted_{0};  // the number of the latest loop
  std::atomic<int> sleeping_{0};     // workers asleep (or going to sleep) on workers_wake_
  std::atomic<int> shared_workers_{0};  // workers that judge their core shared
  int started_ = 0;                  // changed only by the thread holding busy_
  std::mutex mutex_;
  std::condition_variable workers_wake_;
  std::condition_variable caller_wake_;

 public:
  Pool* retired = nullptr;  // the parent's pool, in a forked child (kept reachable)
};

// The process's pool, made on first use. Never destroyed: its workers sleep
// in it until the process ends.
std::atomic<Pool*> g_pool{nullptr};
std::atomic<Pool*> g_retired{nullptr};

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Pool* made = new Pool(max_useful_threads());
  made->retired = g_retired.load(std::memory_order_relaxed);
  if (g_pool.compare_exchange_strong(p, made, std::memory_order_acq_rel)) return *made;
  delete made;
  return *p;
}

// fork(): the child's only thread is the one that called fork; the parent's
// workers do not exist there, and the pool's state may be mid-loop. The
// child starts a pool of its own on its first loop.
#ifdef ATTNX_HAVE_PTHREAD_ATFORK
void forget_pool_in_child() {
  g_retired.store(g_pool.load(std::memory_order_relaxed), std::memory_order_relaxed);
  g_pool.store(nullptr, std::memory_order_relaxed);
  t_thread = 0;
}
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
#endif

}  // namespace

void run_claimed_loop(int64_t n, int threads, LoopInvoker invoke, const void* body) noexcept {
  Pool& p = pool();
  threads = std::min(threads, p.capacity());
  if (threads < 2 || !p.try_acquire()) {
    SerialLoopScope scope;
    for (int64_t i = 0; i < n; ++i) invoke(body, i);
    return;
  }
  // A share word holds fewer than 2^31 iterations: a longer loop runs as
  // loops of 2^30 in turn.
  constexpr int64_t kPart = int64_t(1) << 30;
  static_assert(BalancedShares::fits(kPart), "a part fits a share word");
  for (int64_t base = 0; base < n; base += kPart)
    p.run(base, std::min(kPart, n - base), threads, invoke, body);
  p.release();
}

int current_thread() { return t_thread; }

SerialLoopScope::SerialLoopScope() : saved_(t_thread) { t_thread = 0; }
SerialLoopScope::~SerialLoopScope() { t_thread = saved_; }

}  // namespace attnx
