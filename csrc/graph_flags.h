// A decode graph's CPU pool jobs served on flags in pinned memory: the graph copies a layer's
// inputs to pinned memory, writes go[i] = 1 (a stream memory write, ordered after the copies)
// and waits in the stream until done[i] == 1 (a stream memory wait), then copies the result
// back. The engine thread launches the graph and serves its jobs in order with one call: no
// driver host thread, no graph break, no Python between the layers.
#pragma once
#include <cstdint>

#include "host_node.h"

namespace ft {

// One piece's jobs [first, first + n) of a graph's `jobs`; go and done are the graph's flags,
// one of each per job, zeroed before a replay.
struct FlagJobs {
  HostNodeJob* jobs;
  uint32_t* go;
  uint32_t* done;
  int32_t first, n;
  int32_t spin_us;     // a flag polled this long, then polled asleep
  int32_t timeout_ms;  // a flag not set by then: the graph is taken to be stuck
  int32_t served;      // out: the jobs run
  int32_t pad;
};

// Each job run on the calling thread (as run_host_node: a refusal is counted in its step)
// once its go flag is set, then its done flag set. 0, or -1 when a go flag was not set in
// timeout_ms: then every done flag of the range is set, so the graph runs on (its output is
// not to be used).
int serve_flag_jobs(FlagJobs& f);

// Whether *flag becomes 1 within timeout_ms (polled for spin_us, then asleep between polls):
// a host step inside the graph waits for its go flag so.
bool wait_flag(const uint32_t* flag, int32_t spin_us, int32_t timeout_ms);

// Every done flag in [first, first + n) set: a graph left waiting is let go.
void release_flag_jobs(FlagJobs& f);

}  // namespace ft
