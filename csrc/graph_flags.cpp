// See graph_flags.h.
#include "graph_flags.h"

#include <immintrin.h>
#include <time.h>

#include <chrono>

namespace ft {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// Polled with a pause for spin_us, then asleep between polls (50 us), so that a long wait does
// not hold the core.
bool wait_flag(const uint32_t* go, int32_t spin_us, int32_t timeout_ms) {
  if (__atomic_load_n(go, __ATOMIC_ACQUIRE) == 1) return true;
  auto start = Clock::now();
  auto spin_end = start + std::chrono::microseconds(spin_us);
  auto give_up = start + std::chrono::milliseconds(timeout_ms);
  for (int i = 0;; ++i) {
    if (__atomic_load_n(go, __ATOMIC_ACQUIRE) == 1) return true;
    if ((i & 63) != 63) {
      _mm_pause();
      continue;
    }
    auto now = Clock::now();
    if (now >= give_up) return false;
    if (now >= spin_end) {
      timespec ts{0, 50000};
      nanosleep(&ts, nullptr);
    }
  }
}

int serve_flag_jobs(FlagJobs& f) {
  f.served = 0;
  for (int32_t k = 0; k < f.n; ++k) {
    int32_t i = f.first + k;
    if (!wait_flag(&f.go[i], f.spin_us, f.timeout_ms)) {
      release_flag_jobs(f);
      return -1;
    }
    run_host_node(f.jobs[i]);
    __atomic_store_n(&f.done[i], 1u, __ATOMIC_RELEASE);
    f.served = k + 1;
  }
  return 0;
}

void release_flag_jobs(FlagJobs& f) {
  for (int32_t k = 0; k < f.n; ++k) __atomic_store_n(&f.done[f.first + k], 1u, __ATOMIC_RELEASE);
}

}  // namespace ft
