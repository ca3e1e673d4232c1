// Thread count and build facts.
//
// Until set_num_threads is called, a call uses OpenMP's setting for the
// calling thread (omp_get_max_threads: OMP_NUM_THREADS, or what
// threadpoolctl's threadpool_limits set). set_num_threads then fixes one
// process-wide count, used as `num_threads` on every parallel region, so a
// service calling attnx from many Python threads gets the same count in all.
#include <atomic>
#include <string>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define ATTNX_HAVE_PTHREAD_ATFORK 1
#endif

#include "attnx/runtime.h"
#include "dispatch/parallel.h"

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {
namespace {

std::atomic<int> g_num_threads{0};  // 0: not set, follow OpenMP

// The most threads a parallel region is given: max(64, 4 x the processors
// available), and never more than OpenMP's thread limit. More never helps,
// and far more breaks: libgomp builds a team's start data on the caller's
// stack (100000 threads overflowed it: a segfault), and every thread gets
// its own scratch (2^31 - 1 threads: bad_alloc on a small call).
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
  // No team is ever started, but the count reported obeys the same cap.
  static const int cap = [] {
    const int procs = static_cast<int>(std::thread::hardware_concurrency());
    return procs > 16 ? 4 * procs : 64;
  }();
  return cap;
#endif
}

// fork(): the child's only thread is the one that called fork, and if it
// ever started an OpenMP team, its libgomp pool still lists the parent's
// worker threads, which do not exist in the child: its next parallel region
// with more than one thread waits for them forever. So in the child that
// thread computes alone (same numbers: results never depend on the thread
// count); threads the child starts later get fresh pools and the full count.
thread_local bool t_stale_openmp_pool = false;

#if defined(ATTNX_HAVE_OPENMP) && defined(ATTNX_HAVE_PTHREAD_ATFORK)
void mark_forking_thread_stale() { t_stale_openmp_pool = true; }
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, mark_forking_thread_stale);
#endif

}  // namespace

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
  // Below about a million multiply-adds a parallel region costs more than
  // it saves: waking a team takes microseconds, comparable to that work,
  // and far more when another process holds the other cores (measurements:
  // docs/tuning.md).
  constexpr double kSerialWork = 1 << 20;
  return work < kSerialWork || t_stale_openmp_pool ? 1 : get_num_threads();
}

}  // namespace attnx
