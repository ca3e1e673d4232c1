// The arithmetic peak of this machine, as the active kernel reaches it.
//
// Each thread runs the kernel's fma_probe (multiply-adds on registers only)
// in batches until `seconds` have passed, and its rate is its multiply-adds
// over its own time; the threads' rates add up. benchmarks/compare.py
// reports attnx's GFLOP/s as a fraction of this figure.
#include <chrono>
#include <vector>

#include "attnx/runtime.h"
#include "dispatch/parallel.h"
#include "kernels/kernel_table.h"

namespace attnx {

double measure_fma_peak(int threads, double seconds) {
  const KernelTable<float>& kt = active_kernels(float());
  const double flops_per_iteration = 2.0 * kFmaProbeChains * kt.vector_width;
  constexpr int64_t kBatch = 1 << 14;  // iterations between clock reads
  std::vector<double> rates(size_t(threads > 0 ? threads : 1), 0.0);
#ifdef ATTNX_HAVE_OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
  {
    using Clock = std::chrono::steady_clock;
    const int t = current_thread();
    const Clock::time_point start = Clock::now();
    int64_t iterations = 0;
    double elapsed = 0;
    do {
      kt.fma_probe(kBatch);  // called through a pointer: never optimised away
      iterations += kBatch;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < seconds);
    rates[t] = double(iterations) * flops_per_iteration / elapsed;
  }
  double total = 0;
  for (const double rate : rates) total += rate;
  return total / 1e9;
}

}  // namespace attnx
