// Dense matrices in their checkpoint format on the expert pool: out = x @ W^T for T vectors,
// with the same per-format, per-ISA row kernels the expert op uses, or from kBatchVectors
// vectors on (a prompt) the batched kernels over weight panels. Phase 0 encodes each vector
// in the kernel's activation format; phase 1 runs chunks of rows (or panels) for every
// vector, so the result does not depend on the number of threads.
#include <cstring>

#include "dispatch.h"
#include "expert_op.h"
#include "panels.h"

namespace ft {
namespace {

constexpr int kVectors = 16;  // vectors per kernel call
constexpr int kPanelsPerItem = 4;  // a batched job's item: up to this many panels of rows
constexpr int kSliceVectors = 64;  // vectors per batched kernel call

// The Q8 parts of `a` from vector `first` on.
Act act_from(const Act& a, int64_t first) {
  Act o = a;
  o.q += first * a.K;
  o.d += first * (a.K / 32);
  o.dl += first * (a.K / 4);
  o.gs += first * (a.K / 4);
  o.gb += first * (a.K / 4);
  return o;
}


void run_linear_item(void* ctx, int phase, int64_t item, int) {
  LinearJob& j = *(LinearJob*)ctx;
  const Proj& W = *j.W;
  if (phase == 0) {
    encode_act(j.x + item * W.cols, W.act, j.xa, item, j.quant);
    return;
  }
  int64_t r0 = item * j.chunk, r1 = min64(W.rows, r0 + j.chunk);
  if (j.batched) {
    // The item's panels side by side, a slice of vectors at a time: each output row gets
    // kPanelsPerItem * 64 contiguous bytes while its lines are fresh.
    thread_local PanelBuf bufs[kPanelsPerItem];
    Panel p[kPanelsPerItem];
    const int np = (int)cdiv(r1 - r0, kPanelRows);
    for (int i = 0; i < np; ++i) {
      int64_t p0 = r0 + i * kPanelRows;
      j.panel(W.fmt, W.experts[0], p0, (int)min64(kPanelRows, r1 - p0), W.cols, bufs[i], &p[i]);
    }
    for (int m0 = 0; m0 < j.T; m0 += kSliceVectors) {
      const int m = (int)min64(kSliceVectors, j.T - m0);
      const Act a = act_from(j.xa, m0);
      for (int i = 0; i < np; ++i)
        W.batch(p[i], a, m, j.out + (int64_t)m0 * W.rows + r0 + i * kPanelRows, W.rows);
    }
    return;
  }
  for (int t0 = 0; t0 < j.T; t0 += kVectors) {
    int n = (int)min64(kVectors, j.T - t0);
    W.fn(W.experts[0], W.cols, r0, r1, j.xa, j.tok + t0, n, j.out + t0 * W.rows + r0, W.rows);
  }
}

}  // namespace

std::string Executor::add_linear(int id, Proj w, int act_mode) {
  if (id < 0 || w.rows <= 0 || w.cols <= 0) return "id, rows and cols must be positive";
  if (w.fmt < 0 || w.fmt >= F_COUNT) return "unknown format";
  if (w.experts.size() != 1) return "a dense matrix is one Mat";
  if (w.cols % block_of(w.fmt))
    return std::string(fmt_name(w.fmt)) + " rows of " + std::to_string(w.cols) +
           " are not whole blocks";
  std::string err = set_kernel(w, act_mode);
  if (!err.empty()) return err;
  if (w.act == ACT_Q8 && panel_sub(w.fmt) && w.cols % 32 == 0) {
    BatchPick b = pick_batch(w.fmt, isa_);
    w.batch = b.fn;
    w.batch_isa = b.isa;
  }
  std::lock_guard<std::mutex> lock(layers_mu_);
  if ((int)linears_.size() <= id) linears_.resize(id + 1);
  linears_[id] = std::make_unique<Proj>(std::move(w));
  return "";
}

const Proj* Executor::linear(int id) const {
  return id >= 0 && id < (int)linears_.size() ? linears_[id].get() : nullptr;
}

int64_t Executor::submit_linear(int id, const float* x, float* out, int T) {
  const Proj* W;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    W = linear(id);
  }
  if (!W || T <= 0) return -1;
  int slot = pool_.acquire();
  LinearJob& j = linear_jobs_[slot];
  jobs_[slot].await_ns = 0;  // the slot's timing record reads it
  const int64_t K = W->cols;
  const bool bf = W->act == ACT_BF16, q = W->act == ACT_Q8;
  size_t sizes[kActParts + 1];
  act_sizes(T, K, bf, q, sizes);
  sizes[kActParts] = (size_t)T * 4;  // tok
  constexpr int kParts = kActParts + 1;
  uint8_t* part[kParts];
  j.scratch.carve(sizes, kParts, part);
  j.W = W;
  j.quant = quant_;
  j.x = x;
  j.out = out;
  j.T = T;
  j.xa = act_view(K, x, part);
  j.tok = (int32_t*)part[kActParts];
  for (int t = 0; t < T; ++t) j.tok[t] = t;
  const int from = batch_from_.load(std::memory_order_relaxed);
  j.batched = W->batch && from > 0 && T >= from;
  j.panel = pick_panel(W->fmt, isa_);
  // Enough items that every worker takes several; chunks stay within the kernels' limits.
  const int64_t target = 8 * (int64_t)threads();
  j.chunk = j.batched ? (W->rows / (kPanelsPerItem * kPanelRows) >= 2 * (int64_t)threads()
                             ? kPanelsPerItem * kPanelRows : kPanelRows)
            : W->rows / 64 >= target ? 64 : W->rows / 32 >= target ? 32 : 16;
  j.chunks = (W->rows + j.chunk - 1) / j.chunk;
  bytes_[slot] = W->expert_bytes;
  int64_t counts[2] = {bf || q ? T : 0, j.chunks};
  pool_.publish(slot, counts, 2, run_linear_item, &j);
  return slot;
}

}  // namespace ft
