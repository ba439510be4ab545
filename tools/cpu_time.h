// CPU time of the process and of the calling thread, for the benchmarks'
// "CPU per GB" and "host us per descriptor" columns: what the copy costs the
// CPU, next to what it achieves on the link.
#pragma once

#include <time.h>

namespace kvtier::cli {

inline double cpu_clock_ms(clockid_t clock) {
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}
// Every thread of the process (kvtier's submission, progress and lane threads, the driver's).
inline double process_cpu_ms() { return cpu_clock_ms(CLOCK_PROCESS_CPUTIME_ID); }
inline double thread_cpu_ms() { return cpu_clock_ms(CLOCK_THREAD_CPUTIME_ID); }

}  // namespace kvtier::cli
