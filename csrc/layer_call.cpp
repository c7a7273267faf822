#include "layer_call.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "expert_op.h"
#include "expert_slots.h"

namespace ft {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Python's round(): to nearest, ties to even (the default rounding mode).
int32_t py_round(double v) { return (int32_t)std::nearbyint(v); }

// How many of ids[0..n) are among sorted[0..k).
int32_t count_in(const int64_t* ids, int64_t n, const int64_t* sorted, int32_t k) {
  int32_t found = 0;
  for (int64_t i = 0; i < n; ++i) found += std::binary_search(sorted, sorted + k, ids[i]);
  return found;
}

// The call's incoming prediction (the layer before's look-ahead) scored against its experts
// (needed, k of them, ascending), then cleared; what it fetched and the call routed to counts
// as arrived for the split.
void score(LayerCall* c, int32_t k) {
  c->la_predicted = -1, c->la_used = 0;
  int64_t* in = c->incoming;
  if (in == nullptr) {
    c->rule.arrived = 0;
    return;
  }
  const int64_t* predicted = in + IN_LISTS;
  if (in[IN_PREDICTED] >= 0) {
    c->la_predicted = (int32_t)in[IN_PREDICTED];
    c->la_used = count_in(predicted, in[IN_PREDICTED], c->needed, k);
  }
  c->rule.arrived = count_in(predicted + c->experts, in[IN_FETCHED], c->needed, k);
  in[IN_PREDICTED] = -1, in[IN_FETCHED] = 0;
}

// Look-ahead after the call's plan: 0, -2 (no slot left), -5 (a pick out of range), or a copy
// error as copy_rows gives it.
int look_ahead(LayerCall* c) {
  Ahead& a = c->ahead;
  a.n_predicted = -1, a.n_fetched = 0, a.copy_ns = 0;
  if (a.slots == nullptr || a.rule.budget <= 0 || ahead_count(a.rule, a.rule.budget) <= 0)
    return 0;
  auto* lru = (SlotLru*)a.slots;
  int32_t k = lru->rank(a.layer, a.picks, a.n_picks, a.predicted, a.slot);
  if (k < 0) return -5;
  int32_t m = 0;
  for (int32_t i = 0; i < k; ++i) m += a.slot[i] < 0;
  int32_t n = std::min(ahead_count(a.rule, m), a.rule.budget);
  int32_t got = 0;
  if (n > 0) {
    int32_t n_keep = 0;  // this call's slots, which its compute still reads
    if (a.same_pool) {
      for (int32_t i = 0; i < c->n_needed; ++i)
        if (c->slot[i] >= 0) a.keep[n_keep++] = c->slot[i];
      for (int32_t i = 0; i < c->n_fetched; ++i) a.keep[n_keep++] = c->fetched_slots[i];
    }
    got = lru->admit_ranked(n, a.keep, n_keep, a.fetched, a.fetched_slots);
    if (got < 0) return -2;
  }
  a.n_predicted = k, a.n_fetched = got;
  int64_t* in = a.incoming;  // what the next layer's call scores
  in[IN_PREDICTED] = k, in[IN_FETCHED] = got;
  std::memcpy(in + IN_LISTS, a.predicted, sizeof(int64_t) * k);
  std::memcpy(in + IN_LISTS + a.experts, a.fetched, sizeof(int64_t) * got);
  if (got == 0) return 0;
  RowCopy rc = a.copy;
  for (int32_t i = 0; i < got; ++i)
    a.dst_rows[i] = (int32_t)a.fetched_slots[i], a.src_rows[i] = (int32_t)a.fetched[i];
  rc.dst_rows = a.dst_rows, rc.src_rows = a.src_rows, rc.n = got;
  rc.ev_start = a.ev_start, rc.ev_end = a.ev_end, rc.compute_waits = 0;
  rc.compute_stream = c->copy.compute_stream;
  int64_t t0 = now_ns();
  int err = copy_rows(*c->api, rc);
  a.copy_ns = now_ns() - t0;
  return err;
}

}  // namespace

int32_t ahead_count(const AheadRule& r, int32_t m) {
  int32_t n = std::max(py_round(r.share * m), py_round(r.floor * m));
  return r.max_fetch >= 0 && n > r.max_fetch ? r.max_fetch : n;
}

int32_t fetch_count(const FetchRule& r, int32_t m, int32_t* probing) {
  *probing = PROBE_NONE;
  if (r.held) return py_round(r.share * m);
  int32_t n = r.share < 0 ? m : py_round(r.share * m);
  if (r.max_fetch >= 0 && n > r.max_fetch) n = r.max_fetch;
  if (r.online && m >= 2) {
    if (n == 0 && r.pcie_due) n = 1, *probing = PROBE_PCIE;
    if (n == m && r.cpu_due) {
      int32_t k = py_round((1 - r.probe_share) * m);
      k = k < 1 ? 1 : k > m ? m : k;
      n = m - k, *probing = PROBE_CPU;
    }
  }
  return n;
}

// The planned call's copies (the misses', then the table's) and look-ahead: 0, or
// plan_layer_call's error.
int queue_copies(LayerCall* c) {
  int err = 0;
  auto stream_wait = (int (*)(void*, void*, unsigned))c->api->stream_wait_event;
  if (c->n_fetched > 0) {
    RowCopy rc = c->copy;
    for (int32_t i = 0; i < c->n_fetched; ++i)
      c->dst_rows[i] = (int32_t)c->fetched_slots[i], c->src_rows[i] = (int32_t)c->fetched[i];
    rc.dst_rows = c->dst_rows, rc.src_rows = c->src_rows, rc.n = c->n_fetched;
    rc.ev_start = c->ev_start, rc.ev_end = c->ev_end, rc.compute_waits = 1;
    int64_t t0 = now_ns();
    err = copy_rows(*c->api, rc);
    c->copy_ns = now_ns() - t0;
  } else if (c->wait_first != nullptr && stream_wait != nullptr) {
    err = stream_wait(c->copy.compute_stream, c->wait_first, 0);
  }
  if (err) return err == -1 ? -4 : kDriverError - err;
  std::memcpy(c->staged, c->table, (size_t)c->table_bytes);
  uint64_t src = (uint64_t)(uintptr_t)c->staged;
  err = copy_spans(*c->api, c->copy.compute_stream, 1, &c->device_table, &src,
                   &c->table_bytes, nullptr, 0);
  if (err == 0) err = look_ahead(c);
  if (err == -2 || err == -5) return err;
  return err == -1 ? -4 : err ? kDriverError - err : 0;
}

int plan_layer_call(LayerCall* c) {
  auto* lru = (SlotLru*)c->slots;
  int32_t n_ids = c->rows * c->top_k;
  c->ticket = -1;  // no CPU job yet
  int32_t k = lru->route(c->layer, c->ids, n_ids, c->needed, c->uses, c->slot);
  if (k < 0) return -1;
  int32_t misses = 0;
  for (int32_t i = 0; i < k; ++i) misses += c->slot[i] < 0;
  c->n_needed = k, c->misses = misses, c->n_fetched = 0, c->n_cpu = 0;
  c->probing = PROBE_NONE;
  c->submit_ns = c->copy_ns = 0;
  c->ahead.n_predicted = -1, c->ahead.n_fetched = 0, c->ahead.copy_ns = 0;
  score(c, k);
  if (k > c->num_slots || misses > c->stream_above) return 1;
  int32_t n = fetch_count(c->rule, misses + c->rule.arrived, &c->probing) - c->rule.arrived;
  if (c->probing == PROBE_PCIE && n < 1) n = 1;
  n = n < 0 ? 0 : n > misses ? misses : n;
  int64_t* cpu_ids = c->executor != nullptr ? c->cpu_ids : nullptr;
  if (cpu_ids == nullptr) n = misses;  // no CPU: every miss is fetched
  int32_t n_cpu = lru->split(c->layer, c->ids, n_ids, c->needed, c->uses, c->slot, k, n,
                             c->fetched, c->fetched_slots, cpu_ids);
  if (n_cpu == -2) return -1;
  if (n_cpu < 0) return -2;
  c->n_cpu = n_cpu, c->n_fetched = misses - n_cpu;
  if (n_cpu > 0) {  // the CPU's job first: it runs while the link copies
    int64_t t0 = now_ns();
    c->ticket = ((Executor*)c->executor)->submit(c->layer, c->x, cpu_ids, c->w, c->cpu_out,
                                                 c->rows, c->top_k, c->cpu_signal);
    c->submit_ns = now_ns() - t0;
    if (c->ticket < 0) return -3;
  }
  int code = queue_copies(c);
  if (code < 0 && c->ticket >= 0)  // the CPU's job went out: waited for, so its slot comes back
    ((Executor*)c->executor)->wait(c->ticket);
  return code;
}

}  // namespace ft
