// Thread count and build facts.
//
// Until set_num_threads is called, a call uses OpenMP's setting for the
// calling thread (omp_get_max_threads: OMP_NUM_THREADS, or what
// threadpoolctl's threadpool_limits set). set_num_threads then fixes one
// process-wide count, used as `num_threads` on every parallel region, so a
// service calling attnx from many Python threads gets the same count in all.
#include <atomic>
#include <string>

#include "attnx/runtime.h"
#include "dispatch/parallel.h"

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {
namespace {

std::atomic<int> g_num_threads{0};  // 0: not set, follow OpenMP

}  // namespace

int get_num_threads() {
  const int n = g_num_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
#ifdef ATTNX_HAVE_OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
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
  // Below about a million multiply-adds (~10 us on one core) a parallel
  // region costs more than it saves: waking a team takes microseconds, and
  // far more when another process holds the other cores.
  constexpr double kSerialWork = 1 << 20;
  return work < kSerialWork ? 1 : get_num_threads();
}

}  // namespace attnx
