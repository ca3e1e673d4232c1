// The arithmetic peak of this machine, as the active kernel reaches it.
//
// Each thread runs the kernel's fma_probe (multiply-adds on registers only)
// in batches until `seconds` have passed, and its rate is its multiply-adds
// over its own time; the threads' rates add up. benchmarks/compare.py
// reports attnx's GFLOP/s as a fraction of this figure.
#include <chrono>
#include <system_error>
#include <thread>
#include <vector>

#include "attnx/runtime.h"
#include "kernels/kernel_table.h"

namespace attnx {

double measure_fma_peak(int threads, double seconds) {
  const KernelTable<float>& kt = active_kernels(float());
  const double flops_per_iteration = 2.0 * kFmaProbeChains * kt.vector_width;
  constexpr int64_t kBatch = 1 << 14;  // iterations between clock reads
  std::vector<double> rates(size_t(threads > 0 ? threads : 1), 0.0);
  // Every thread runs at the same time (not claimed iterations: a peak is
  // the threads' rates at once), each on a thread of its own.
  const auto probe = [&](int t) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    int64_t iterations = 0;
    double elapsed = 0;
    do {
      kt.fma_probe(kBatch);  // called through a pointer: never optimised away
      iterations += kBatch;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < seconds);
    rates[t] = double(iterations) * flops_per_iteration / elapsed;
  };
  std::vector<std::thread> others;
  try {
    for (int t = 1; t < int(rates.size()); ++t) others.emplace_back(probe, t);
  } catch (const std::system_error&) {
    // No more threads to be had: the peak of those there are (rates of 0).
  }
  probe(0);
  for (std::thread& other : others) other.join();
  double total = 0;
  for (const double rate : rates) total += rate;
  return total / 1e9;
}

}  // namespace attnx
