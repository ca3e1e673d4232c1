// Thread count and build facts.
//
// Until set_num_threads is called, a call uses OpenMP's setting for the
// calling thread (omp_get_max_threads: OMP_NUM_THREADS, or what
// threadpoolctl's threadpool_limits set). set_num_threads then fixes one
// process-wide count, used by every parallel loop (worker_pool.h), so a
// service calling attnx from many Python threads gets the same count in all.
#include <atomic>
#include <string>
#include <thread>

#include "attnx/runtime.h"
#include "dispatch/parallel.h"

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {
namespace {

std::atomic<int> g_num_threads{0};  // 0: not set, follow OpenMP

}  // namespace

// The most threads a loop is given: max(64, 4 x the processors available),
// and never more than OpenMP's thread limit. More never helps, and far more
// breaks: every thread gets its own scratch (2^31 - 1 threads: bad_alloc on
// a small call), and the pool's loops hold a share per thread.
int max_useful_threads() {
#ifdef ATTNX_HAVE_OPENMP
  static const int cap = [] {
    const int procs = omp_get_num_procs();
    const int want = procs > 16 ? 4 * procs : 64;
    const int limit = omp_get_thread_limit();
    return limit > 0 && limit < want ? limit : want;
  }();
  return cap;
#else
  static const int cap = [] {
    const int procs = static_cast<int>(std::thread::hardware_concurrency());
    return procs > 16 ? 4 * procs : 64;
  }();
  return cap;
#endif
}

int get_num_threads() {
  int n = g_num_threads.load(std::memory_order_relaxed);
#ifdef ATTNX_HAVE_OPENMP
  if (n < 1) n = omp_get_max_threads();
#else
  if (n < 1) n = 1;
#endif
  const int cap = max_useful_threads();
  return n < cap ? n : cap;
}

void set_num_threads(int n) { g_num_threads.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

bool have_openmp() {
#ifdef ATTNX_HAVE_OPENMP
  return true;
#else
  return false;
#endif
}

std::string compiler_name() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

int threads_for(double work) {
  // Below about a million multiply-adds a parallel loop costs more than it
  // saves: waking a worker takes microseconds, comparable to that work
  // (measurements: docs/tuning.md).
  constexpr double kSerialWork = 1 << 20;
  return work < kSerialWork ? 1 : get_num_threads();
}

}  // namespace attnx
