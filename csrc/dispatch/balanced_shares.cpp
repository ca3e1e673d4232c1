#include "dispatch/balanced_shares.h"

#include <chrono>
#include <thread>

#include "dispatch/parallel.h"

namespace attnx {
namespace {

uint64_t pack(int64_t begin, int64_t end) { return uint64_t(begin) | (uint64_t(end) << 32); }
int64_t begin_of(uint64_t word) { return int64_t(word & 0xffffffffu); }
int64_t end_of(uint64_t word) { return int64_t(word >> 32); }

}  // namespace

BalancedShares::BalancedShares(int capacity)
    : threads_(0), shares_(std::make_unique<Share[]>(size_t(capacity))) {}

void BalancedShares::reset(int64_t n, int threads) {
  threads_ = threads;
  for (int t = 0; t < threads; ++t)
    shares_[t].word.store(pack(n * t / threads, n * (t + 1) / threads),
                          std::memory_order_relaxed);
}

// Relaxed order throughout: a word only hands out iteration numbers; the
// shares are published to the workers, and the loop's data returned to the
// caller, by the pool's own acquire and release (worker_pool.cpp).
int64_t BalancedShares::next(int thread) {
  std::atomic<uint64_t>& own = shares_[thread].word;
  uint64_t word = own.load(std::memory_order_relaxed);
  while (begin_of(word) < end_of(word)) {
    if (own.compare_exchange_weak(word, pack(begin_of(word) + 1, end_of(word)),
                                  std::memory_order_relaxed))
      return begin_of(word);
  }
  // Own share done: take the back half (at least one) of the largest.
  for (;;) {
    int victim = -1;
    int64_t most = 0;
    for (int t = 0; t < threads_; ++t) {
      const uint64_t w = shares_[t].word.load(std::memory_order_relaxed);
      if (end_of(w) - begin_of(w) > most) most = end_of(w) - begin_of(w), victim = t;
    }
    if (victim < 0) return -1;
    uint64_t w = shares_[victim].word.load(std::memory_order_relaxed);
    const int64_t begin = begin_of(w), end = end_of(w);
    if (begin >= end) continue;
    const int64_t take = (end - begin + 1) / 2;
    if (!shares_[victim].word.compare_exchange_strong(w, pack(begin, end - take),
                                                      std::memory_order_relaxed))
      continue;
    // An empty share is never taken from, so no other thread writes this
    // word until it holds the rest of the taken iterations.
    own.store(pack(end - take + 1, end), std::memory_order_relaxed);
    return end - take;
  }
}

std::vector<int32_t> trace_balanced_loop(int64_t n, int threads, int64_t microseconds,
                                         int slow_thread, int64_t slow_microseconds,
                                         std::vector<int32_t>& ran_on) {
  std::vector<std::atomic<int32_t>> runs(static_cast<size_t>(n));
  std::vector<std::atomic<int32_t>> last(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) runs[i].store(0), last[i].store(-1);
  parallel_for(n, threads, [&](int64_t i) {
    const int thread = current_thread();
    runs[i].fetch_add(1);
    last[i].store(thread);
    const int64_t sleep = thread == slow_thread ? slow_microseconds : microseconds;
    if (sleep > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep));
  });
  std::vector<int32_t> counts(static_cast<size_t>(n));
  ran_on.assign(static_cast<size_t>(n), -1);
  for (int64_t i = 0; i < n; ++i) counts[i] = runs[i].load(), ran_on[i] = last[i].load();
  return counts;
}

}  // namespace attnx
