// Warm reads: a layer's likely experts read into the CPU's caches while the pool would idle.
//
// In a decode step on a GPU the pool computes a layer's experts, then waits while the GPU runs
// the next layer's attention and router; only then does it learn the next layer's experts.
// The experts' bytes come from memory at the memory's pace, so that wait is reading time lost.
// A warm read spends it reading the experts a prediction names (the next layer's router on this
// layer's input), so the job that follows reads them from the last-level cache. It changes no
// result, only where the job's bytes come from; the next job cancels what is left of it, so it
// never delays a job by more than the reads already started (one chunk per worker).
#include <algorithm>

#include "expert_op.h"

namespace ft {

namespace {

// Item i: chunk i - first[s] of the span s holding it; nothing once the read is cancelled.
void run_warm(void* ctx, int, int64_t item, int) {
  WarmRead& r = *(WarmRead*)ctx;
  if (r.cancel.load(std::memory_order_relaxed)) return;
  int s = (int)(std::upper_bound(r.first, r.first + r.spans + 1, item) - r.first) - 1;
  int64_t off = (item - r.first[s]) * WarmRead::kChunk;
  int64_t n = std::min(WarmRead::kChunk, r.len[s] - off);
  r.sink.fetch_xor(r.fn(r.ptr[s] + off, n), std::memory_order_relaxed);
  r.bytes.fetch_add(n, std::memory_order_relaxed);
}

// The bytes of one expert's matrix: its rows (scales kept apart, as nvfp4's, are a few per
// cent of them and stay unread).
void add_span(WarmRead& r, const Proj& p, int e) {
  const Mat& m = p.experts[e];
  r.ptr[r.spans] = m.data;
  r.len[r.spans++] = (p.rows * m.row_bytes) & ~(int64_t)63;  // whole lines: the reader's unit
}

}  // namespace

Executor::~Executor() { settle_warm(); }

void Executor::settle_warm() {
  std::lock_guard<std::mutex> lock(warm_mu_);
  settle_warm_locked();
}

void Executor::settle_warm_locked() {
  if (warm_slot_ < 0) return;
  warm_->cancel.store(true, std::memory_order_relaxed);
  pool_.wait(warm_slot_, /*join=*/true);  // the items left are empty: joining ends them soonest
  pool_.release(warm_slot_);
  warm_slot_ = -1;
  warm_bytes_ += warm_->bytes.load(std::memory_order_relaxed);
}

int Executor::warm(int layer_id, const int32_t* experts, int n) {
  const Layer* L;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    L = layer(layer_id);
  }
  if (!L) return -1;
  if (n < 0 || n > kMaxWarmExperts) return -3;
  for (int i = 0; i < n; ++i)
    if (experts[i] < 0 || experts[i] >= L->E) return -2;
  std::lock_guard<std::mutex> lock(warm_mu_);
  settle_warm_locked();
  if (n == 0) return 0;
  if (!warm_) warm_ = std::make_unique<WarmRead>();
  WarmRead& r = *warm_;
  r.fn = pick_reader(isa_);
  r.cancel.store(false, std::memory_order_relaxed);
  r.bytes.store(0, std::memory_order_relaxed);
  r.spans = 0;
  for (int i = 0; i < n; ++i) {  // expert by expert: the likeliest is read first
    add_span(r, L->gate, experts[i]);
    add_span(r, L->up, experts[i]);
    add_span(r, L->down, experts[i]);
  }
  for (int s = 0; s < r.spans; ++s) r.first[s + 1] = r.first[s] + cdiv(r.len[s], WarmRead::kChunk);
  int64_t counts[1] = {r.first[r.spans]};
  if (counts[0] == 0) return 0;  // matrices of less than a cache line: nothing worth reading
  warm_slot_ = pool_.acquire();
  pool_.publish(warm_slot_, counts, 1, run_warm, &r);
  ++warm_reads_;
  return 0;
}

void Executor::warm_stats(int64_t* reads, int64_t* bytes) {
  std::lock_guard<std::mutex> lock(warm_mu_);
  *reads = warm_reads_;
  *bytes = warm_bytes_ +
           (warm_slot_ >= 0 ? warm_->bytes.load(std::memory_order_relaxed) : 0);
}

}  // namespace ft
