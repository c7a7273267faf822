// See host_node.h.
#include "host_node.h"

#include <sched.h>

#include <algorithm>

#include "expert_op.h"

namespace ft {

void run_host_node(HostNodeJob& job) {
  HostNodeStep* step = job.step;
  thread_local int64_t pinned = -1;
  if (step->core >= 0 && pinned != step->core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)step->core, &set);
    sched_setaffinity(0, sizeof(set), &set);  // best effort: a refusal leaves it unpinned
    pinned = step->core;
  }
  int T = (int)std::min<int64_t>(job.T, step->rows);
  if (T <= 0) return;
  int64_t h = job.ex->submit(job.layer, job.x, job.ids, job.w, job.out, T, job.A);
  if (h >= 0) h = job.ex->wait(h);
  if (h < 0) {
    __atomic_fetch_add(&step->failures, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&step->last_error, h, __ATOMIC_RELAXED);
  }
}

}  // namespace ft
