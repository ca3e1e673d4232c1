// Helpers for the drivers' parallel loops; they compile without OpenMP too.
#pragma once

#ifdef ATTNX_HAVE_OPENMP
#include <omp.h>
#endif

namespace attnx {

// Threads to use for a call doing about `work` multiply-adds: 1 for small
// calls, the configured count otherwise.
int threads_for(double work);

inline int current_thread() {
#ifdef ATTNX_HAVE_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace attnx
