#include "dispatch/core_waits.h"

#include <cstdlib>

#ifdef __linux__
#include <fcntl.h>
#include <unistd.h>
#endif

namespace attnx {

CoreWaitClock::CoreWaitClock() {
#ifdef __linux__
  fd_ = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
#endif
}

CoreWaitClock::~CoreWaitClock() {
#ifdef __linux__
  if (fd_ >= 0) close(fd_);
#endif
}

uint64_t CoreWaitClock::waited_ns() const {
#ifdef __linux__
  // "<time on a core> <time waiting for one> <time slices>", in nanoseconds.
  char text[128];
  if (fd_ < 0) return 0;
  const ssize_t n = pread(fd_, text, sizeof text - 1, 0);
  if (n <= 0) return 0;
  text[n] = '\0';
  char* end = nullptr;
  std::strtoull(text, &end, 10);
  return end == text ? 0 : std::strtoull(end, nullptr, 10);
#else
  return 0;
#endif
}

bool CoreSharing::add_round(uint64_t waited_ns, Clock::time_point now) {
  const bool long_wait = waited_ns > uint64_t(std::chrono::nanoseconds(kLongWait).count());
  recent_ += ((long_wait ? 1.0 : 0.0) - recent_) / 8;
  if (long_wait && (recent_ > 0.2 || now < shared_until_)) shared_until_ = now + kHold;
  return now < shared_until_;
}

}  // namespace attnx
