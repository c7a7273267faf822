// The C ABI of a decode step's host side: the expert cache's slot decisions, a layer call's
// plan, the rows copied into cache slots, the host's waits on a stream, and the pool's jobs
// inside a CUDA graph (as host nodes or served on flags). The rest is in capi.cpp.
#include "capi.h"
#include "expert_slots.h"
#include "graph_flags.h"
#include "host_node.h"
#include "layer_call.h"
#include "row_copy.h"

// The expert cache's slot decisions (expert_slots.h). Tables are the caller's int64 arrays.
FT_API void* ft_slots_new(int slots) { return slots > 0 ? new ft::SlotLru(slots) : nullptr; }

FT_API void ft_slots_free(void* h) { delete (ft::SlotLru*)h; }

FT_API int ft_slots_add_layer(void* h, int layer, int64_t* table, int experts) {
  return ((ft::SlotLru*)h)->add_layer(layer, table, experts) ? 0 : -1;
}

FT_API int ft_slots_lookup(void* h, int layer, const int64_t* experts, int n, int64_t* slots) {
  return ((ft::SlotLru*)h)->lookup(layer, experts, n, slots) ? 0 : -1;
}

FT_API int ft_slots_admit(void* h, int layer, const int64_t* experts, int n,
                          const int64_t* keep, int n_keep, int64_t* slots) {
  return ((ft::SlotLru*)h)->admit(layer, experts, n, keep, n_keep, slots);
}

FT_API int ft_slots_route(void* h, int layer, const int64_t* flat, int n_flat, int64_t* needed,
                          int64_t* uses, int64_t* slot) {
  return ((ft::SlotLru*)h)->route(layer, flat, n_flat, needed, uses, slot);
}

FT_API int ft_slots_split(void* h, int layer, const int64_t* flat, int n_flat,
                          const int64_t* needed, const int64_t* uses, const int64_t* slot,
                          int n_needed, int n_fetch, int64_t* fetched, int64_t* fetched_slots,
                          int64_t* cpu_ids) {
  return ((ft::SlotLru*)h)->split(layer, flat, n_flat, needed, uses, slot, n_needed, n_fetch,
                                  fetched, fetched_slots, cpu_ids);
}

FT_API int ft_slots_rank(void* h, int layer, const int64_t* picks, int n, int64_t* predicted,
                         int64_t* slots) {
  return ((ft::SlotLru*)h)->rank(layer, picks, n, predicted, slots);
}

FT_API int ft_slots_admit_ranked(void* h, int n_take, const int64_t* keep, int n_keep,
                                 int64_t* fetched, int64_t* slots) {
  return ((ft::SlotLru*)h)->admit_ranked(n_take, keep, n_keep, fetched, slots);
}

FT_API void ft_slots_state(void* h, int64_t* order, int64_t* owner_layer,
                           int64_t* owner_expert) {
  ((ft::SlotLru*)h)->order(order);
  ((ft::SlotLru*)h)->owners(owner_layer, owner_expert);
}

// An offloaded layer's decode call planned in one call (layer_call.h): 0, 1 (it streams) or
// a negative error.
FT_API int ft_plan_layer_call(ft::LayerCall* c) { return ft::plan_layer_call(c); }

// How many of m misses a fetch rule fetches, and which probe it made (layer_call.h).
FT_API int ft_fetch_count(const ft::FetchRule* r, int m, int* probing) {
  return ft::fetch_count(*r, m, probing);
}

// How many of m predicted misses look-ahead fetches (layer_call.h).
FT_API int ft_ahead_count(const ft::AheadRule* r, int m) { return ft::ahead_count(*r, m); }

// Expert rows into cache slots in one call (row_copy.h): 0, or the CUDA driver's error.
FT_API int ft_copy_rows(const ft::RowCopyApi* api, const ft::RowCopy* c) {
  return ft::copy_rows(*api, *c);
}

// Spans of bytes copied in order on one stream, the host waiting for them with an event
// ``done`` (row_copy.h): 0, or the CUDA driver's error.
FT_API int ft_copy_spans(const ft::RowCopyApi* api, void* stream, int n, const uint64_t* dst,
                         const uint64_t* src, const int64_t* bytes, void* done, int spin_us) {
  return ft::copy_spans(*api, stream, n, dst, src, bytes, done, spin_us);
}

// The host waits for a stream's work so far: a bounded spin, then asleep (row_copy.h).
FT_API int ft_wait_event(const ft::RowCopyApi* api, void* event, void* stream, int spin_us) {
  return ft::wait_event(*api, event, stream, spin_us);
}

// ft_run as a CUDA host function (cuLaunchHostFunc's CUhostFn): `job` is an ft::HostNodeJob
// the caller keeps alive while any graph holds it; refusals are counted in its step.
FT_API void ft_host_node_run(void* job) { ft::run_host_node(*(ft::HostNodeJob*)job); }

// A graph piece's pool jobs served on its flags (csrc/graph_flags.h): 0, or -1 (a go flag not
// set in time; the range's done flags are set). ft_flag_jobs_release sets them all.
FT_API int ft_flag_jobs_serve(ft::FlagJobs* f) { return ft::serve_flag_jobs(*f); }
FT_API void ft_flag_jobs_release(ft::FlagJobs* f) { ft::release_flag_jobs(*f); }

// One flag awaited as serve_flag_jobs awaits a go flag: 0, or -1 when it is not 1 in time.
FT_API int ft_flag_wait(const uint32_t* flag, int spin_us, int timeout_ms) {
  return ft::wait_flag(flag, spin_us, timeout_ms) ? 0 : -1;
}
