// An offloaded layer's decode call planned in one library call: the routed ids -> hits and
// misses (SlotLru::route), the fetched share (the split policy's rule), victims and the CPU's
// pairs (SlotLru::split), the CPU's job submitted, the misses' row copies queued and the slot
// table published. freetoken/moe/layer_call.py fills it; the Python plan
// (OffloadExperts._plan, HybridExperts._plan_misses) is its slow twin.
#pragma once
#include <cstdint>

#include "row_copy.h"

namespace ft {

// How many of a call's m misses to fetch: freetoken/moe/split.py's SplitPolicy.count.
struct FetchRule {
  int32_t held;         // 1: round(share * m) (the wall check's share, or offload's 1.0)
  int32_t online;       // probes keep both sides timed (not with held)
  int32_t pcie_due;     // the link is due a probe
  int32_t cpu_due;      // the CPU is due a probe
  double share;         // the fetched share; < 0: none yet (every miss)
  double probe_share;   // the fetched share of a CPU probe's misses
  int32_t max_fetch;    // at most this many (< 0: no cap; not with held)
  int32_t arrived;      // routed experts look-ahead fetched: counted as misses, not fetched
};

enum Probing : int32_t { PROBE_NONE = 0, PROBE_PCIE = 1, PROBE_CPU = 2 };

struct LayerCall {
  // set once per layer and set of host copies
  void* slots;                 // the layer's SlotLru
  void* executor;              // the CPU pool (null: no CPU share)
  const RowCopyApi* api;
  RowCopy copy;                // dst, src, strides, streams, ev_ready; rows set per call
  const int64_t* ids;          // the call's routed ids, T x A
  int32_t layer, rows, top_k;  // rows: T
  int32_t num_slots;
  int32_t stream_above;        // a call missing more experts than this streams instead
  int32_t pad0;
  const float* x;              // the CPU job's inputs and output (host copies)
  const float* w;
  float* cpu_out;
  uint32_t* cpu_signal;        // set to 1 once cpu_out is written (null: none)
  int64_t* cpu_ids;            // the CPU job's ids (-1: not the CPU's pair)
  int64_t* needed;             // outputs, T * A each: the experts, ascending
  int64_t* uses;
  int64_t* slot;               // each needed expert's slot, -1 for a miss (before the split)
  int64_t* fetched;            // the fetched misses, ascending, and their slots
  int64_t* fetched_slots;
  int32_t* dst_rows;           // the copies' rows, scratch
  int32_t* src_rows;
  const int64_t* table;        // the layer's table expert -> slot, published through
  int64_t* staged;             // a pinned copy (experts entries)
  uint64_t device_table;       // the device's table
  int64_t table_bytes;
  // set per call
  FetchRule rule;
  void* wait_first;            // an event the compute stream waits for when nothing is fetched
  void* ev_start;              // the copies' span (null: host clock)
  void* ev_end;
  // outputs
  int32_t n_needed, misses, n_fetched, n_cpu;
  int32_t probing;             // Probing
  int32_t pad1;
  int64_t ticket;              // the CPU job's (n_cpu > 0)
  int64_t submit_ns;           // the submit's host time
  int64_t copy_ns;             // the copies' host time (the span on the CPU)
};

// How many of m misses the rule fetches; *probing says which probe it made.
int32_t fetch_count(const FetchRule& r, int32_t m, int32_t* probing);

// 0: planned (CPU job submitted when n_cpu > 0, copies queued, table published); 1: the call
// must stream (routed only: needed, uses, slot hold its experts); -1: an id out of range; -2:
// no slot left to evict; -3: the CPU job refused; -4: an incomplete driver API;
// kDriverError - e: the CUDA driver's error e.
constexpr int kDriverError = -1000;
int plan_layer_call(LayerCall* c);

}  // namespace ft
