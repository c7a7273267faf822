#include "layer_call.h"

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

}  // namespace

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

int plan_layer_call(LayerCall* c) {
  auto* lru = (SlotLru*)c->slots;
  int32_t n_ids = c->rows * c->top_k;
  int32_t k = lru->route(c->layer, c->ids, n_ids, c->needed, c->uses, c->slot);
  if (k < 0) return -1;
  int32_t misses = 0;
  for (int32_t i = 0; i < k; ++i) misses += c->slot[i] < 0;
  c->n_needed = k, c->misses = misses, c->n_fetched = 0, c->n_cpu = 0, c->ticket = -1;
  c->probing = PROBE_NONE;
  c->submit_ns = c->copy_ns = 0;
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
  return err == -1 ? -4 : err ? kDriverError - err : 0;
}

}  // namespace ft
