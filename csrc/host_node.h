// A layer's CPU pool job as a host function of a CUDA graph (cuLaunchHostFunc): the decode
// graph copies the layer's inputs to pinned memory, the driver's host thread runs the job (it
// calls no CUDA API), and the graph copies the result back, with no host step between pieces.
#pragma once
#include <cstdint>

namespace ft {

class Executor;

// What one graph's host nodes share, in host memory: the live rows of the next replay, which
// the caller writes before it (padded rows are not computed), and the jobs refused so far.
struct HostNodeStep {
  int64_t rows;
  int64_t failures;
  int64_t last_error;  // the last refused job's code (Executor::submit's)
  int64_t core;        // the core a thread running the jobs is pinned to first (-1: none)
};

// One layer's job: pinned float32 x (T, H), int64 ids and float32 w (T, A), float32 out
// (T, H) that the pool writes.
struct HostNodeJob {
  Executor* ex;
  const float* x;
  const int64_t* ids;
  const float* w;
  float* out;
  int32_t layer, T, A, pad;
  HostNodeStep* step;
};

// The job on the step's live rows, submitted and waited on the calling thread; a refusal is
// counted in the step (a host function has no caller to return it to). With the step's core
// set, the calling thread is pinned to it first (once per thread): the driver's host thread,
// unpinned, would otherwise share a pool worker's core while it joins the job.
void run_host_node(HostNodeJob& job);

}  // namespace ft
