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
                        // (plan_layer_call sets it from the call's incoming, where given)
};

enum Probing : int32_t { PROBE_NONE = 0, PROBE_PCIE = 1, PROBE_CPU = 2 };

// How many of m predicted misses look-ahead fetches for the next layer: max(round(share m),
// round(floor m)), at most max_fetch (< 0: no cap). freetoken/moe/lookahead.py's
// AheadRule.count.
struct AheadRule {
  double share;      // the next layer's split share (offload: 1; none yet: 0)
  double floor;      // hybrid's look-ahead share of predicted misses, where that is more
  int32_t max_fetch;
  int32_t budget;    // at most this many in all (0: no look-ahead for the call)
};

int32_t ahead_count(const AheadRule& r, int32_t m);

// What the layer before's look-ahead did for a layer's next call, in one int64 array the
// Python side reads too (freetoken/moe/lookahead.py's Incoming): [0] how many experts it
// predicted (-1: none), [1] how many of them it fetched, then the predicted experts
// (`experts` entries), then the fetched ones (`experts` entries).
enum IncomingAt : int32_t { IN_PREDICTED = 0, IN_FETCHED = 1, IN_LISTS = 2 };

// Look-ahead after a call's plan (freetoken/moe/lookahead.py): the next MoE layer's router
// picks (made on the device before the plan, copied with the routed ids) ranked on its
// layer's slots, the first of their misses admitted into slots this call does not use and
// their rows copied on the copy stream, which the compute stream does not wait for.
struct Ahead {
  // set once per layer and set of host copies
  void* slots;                 // the next layer's SlotLru (null: no look-ahead)
  const int64_t* picks;        // its router's top-k of each of this call's tokens
  int32_t layer, n_picks;      // the next layer; rows x k picks
  int32_t same_pool;           // its slots are this call's pool: this call's stay
  int32_t experts;             // the next layer's experts (its incoming's list size)
  int64_t* incoming;           // the next layer's IncomingAt array
  RowCopy copy;                // its pool's rows, its bank's; streams and ev_ready
  int64_t* keep;               // scratch: this call's slots, T * A * 2
  int64_t* predicted;          // outputs, n_picks each: the ranked experts, their slots,
  int64_t* slot;               // the fetched ones and theirs
  int64_t* fetched;
  int64_t* fetched_slots;
  int32_t* dst_rows;           // the copies' rows, scratch
  int32_t* src_rows;
  // set per call
  AheadRule rule;
  void* ev_start;              // the copies' span (null: host clock)
  void* ev_end;
  // outputs
  int32_t n_predicted;         // -1: nothing ranked
  int32_t n_fetched;
  int64_t copy_ns;
};

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
  int64_t* incoming;           // this layer's IncomingAt array (null: no look-ahead into it)
  int32_t experts;             // its list size
  int32_t pad2;
  Ahead ahead;                 // look-ahead for the next layer (ahead.slots null: none)
  // set per call
  FetchRule rule;
  void* wait_first;            // an event the compute stream waits for when nothing is fetched
  void* ev_start;              // the copies' span (null: host clock)
  void* ev_end;
  // outputs
  int32_t n_needed, misses, n_fetched, n_cpu;
  int32_t probing;             // Probing
  int32_t pad1;
  int64_t ticket;              // the CPU job's (n_cpu > 0), else -1
  int64_t submit_ns;           // the submit's host time
  int64_t copy_ns;             // the copies' host time (the span on the CPU)
  int32_t la_predicted;        // the incoming prediction's experts (-1: none), those of them
  int32_t la_used;             // routed to, and the routed ones it fetched (rule.arrived)
};

// How many of m misses the rule fetches; *probing says which probe it made.
int32_t fetch_count(const FetchRule& r, int32_t m, int32_t* probing);

// 0: planned (CPU job submitted when n_cpu > 0, copies queued, table published, then
// look-ahead's ranking, admits and copies); 1: the call must stream (routed only: needed,
// uses, slot hold its experts; the incoming prediction scored and cleared); -1: an id out of
// range; -2: no slot left to evict; -3: the CPU job refused; -4: an incomplete driver API;
// -5: a look-ahead pick out of range (the call itself planned); kDriverError - e: the CUDA
// driver's error e. A call that fails after its CPU job went out has waited for the job (its
// pool slot back, its result dropped): the caller adopts a job only on 0.
constexpr int kDriverError = -1000;
int plan_layer_call(LayerCall* c);

}  // namespace ft
