// Thread count and build facts.
//
// The count is one process-wide value used as `num_threads` on every parallel
// region, rather than omp_set_num_threads, whose setting is per calling
// thread: a service calling attnx from many Python threads gets the same
// count in all of them.
#include <atomic>
#include <string>

#include "attnx/runtime.h"
#include "dispatch/parallel.h"

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {
namespace {

int default_threads() {
#ifdef ATTNX_HAVE_OPENMP
  return omp_get_max_threads();  // honours OMP_NUM_THREADS
#else
  return 1;
#endif
}

std::atomic<int> g_num_threads{default_threads()};

}  // namespace

int get_num_threads() { return g_num_threads.load(std::memory_order_relaxed); }

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
