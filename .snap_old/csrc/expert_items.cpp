// The work items of the fused expert op (expert_op.h): phase 0 prepares x per token, phase 1
// runs gate and up per expert and chunk of I rows, phase 2 runs down (per chunk of H rows of
// every expert, or per chunk of one expert's rows, the last of which sums the pairs there).
#include <chrono>
#include <cmath>
#include <cstring>

#include "decode_steps.h"
#include "expert_op.h"
#include "prefetch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace ft {
namespace {
constexpr int kGroup = 16;     // pairs per kernel call
constexpr int64_t kMaxChunk = kMaxGateUpRows;  // rows per gate/up work item
constexpr int kExpertSpins = 100000;  // pauses (a few ms) before a down item sleeps on gate/up

// Act views advanced to vector `first` of K-long vectors.
Act offset_act(const Act& a, int64_t first) {
  Act o = a;
  int64_t K = a.K;
  if (o.f) o.f += first * K;
  if (o.bf) o.bf += first * K;
  if (o.q) o.q += first * K;
  if (o.d) o.d += first * (K / 32);
  if (o.dl) o.dl += first * (K / 4);
  if (o.gs) o.gs += first * (K / 4);
  if (o.gb) o.gb += first * (K / 4);
  return o;
}

void prepare_x(Job& j, int64_t t) {
  const Layer& L = *j.L;
  const float* x = j.x + t * L.H;
  for (int act : {ACT_BF16, ACT_Q8})
    if (L.x_needs[act]) encode_act(x, act, j.xa, t, j.quant);
}

// Gate and up for rows [i0, i1) of one expert, for all of its pairs; h = act(g) * u.
void gate_up(Job& j, int64_t item) {
  const Layer& L = *j.L;
  const int64_t H = L.H, I = L.I;
  int64_t ea = item / j.chunks1;
  int64_t i0 = (item % j.chunks1) * j.c1, i1 = min64(I, i0 + j.c1), rows = i1 - i0;
  int e = j.active[ea];
  float g[kGroup * kMaxChunk], u[kGroup * kMaxChunk];
  // up's first rows on their way while gate runs, so up does not start from memory's latency
  const Mat& um = L.up.experts[e];
  prefetch_start(um.data + i0 * um.row_bytes, rows * um.row_bytes, prefetch_bytes(),
                 prefetch_level());
  for (int64_t p0 = j.start[ea]; p0 < j.start[ea + 1]; p0 += kGroup) {
    int n = (int)min64(kGroup, j.start[ea + 1] - p0);
    L.gate.fn(L.gate.experts[e], H, i0, i1, j.xa, j.ptok + p0, n, g, rows);
    L.up.fn(L.up.experts[e], H, i0, i1, j.xa, j.ptok + p0, n, u, rows);
    const ExpertGlu& G = L.glu;
    if (!G.gate_bias.empty()) {
      const float* bg = G.gate_bias.data() + e * I + i0;
      const float* bu = G.up_bias.data() + e * I + i0;
      for (int v = 0; v < n; ++v)
        for (int64_t i = 0; i < rows; ++i) {
          g[v * rows + i] += bg[i];
          u[v * rows + i] += bu[i];
        }
    }
    for (int v = 0; v < n; ++v) {
      int64_t p = p0 + v;
      float* h = j.hf + p * I + i0;
      if (L.activation == ACTV_SWIGLU_OAI) {
        const float* gv = g + v * rows;
        const float* uv = u + v * rows;
        for (int64_t i = 0; i < rows; ++i) h[i] = clamped_swiglu(G.alpha, G.limit, gv[i], uv[i]);
      } else {
        glu(g + v * rows, rows, u + v * rows, rows, 1, (int)rows, L.activation, h);
      }
      if (L.down.act == ACT_BF16)
        for (int64_t i = 0; i < rows; ++i) j.hbf[p * I + i0 + i] = f32_to_bf16(h[i]);
      else if (L.down.act == ACT_Q8)
        j.quant(h, rows, j.hq + p * I + i0, j.hd + p * (I / 32) + i0 / 32,
                    j.hdl + p * (I / 4) + i0 / 4, j.hgs + p * (I / 4) + i0 / 4,
                    j.hgb + p * (I / 4) + i0 / 4);
    }
  }
  if (__atomic_add_fetch(&j.ready[ea], 1, __ATOMIC_SEQ_CST) == j.chunks1 &&
      __atomic_load_n(&j.sleepers, __ATOMIC_SEQ_CST) > 0)
    futex_wake_all_at(reinterpret_cast<uint32_t*>(&j.ready[ea]));
}

// Wait until every gate/up chunk of active expert ea is done (they are all being worked on):
// a bounded spin, then sleep on the counter (the chunk that completes it wakes sleepers).
void await_expert(Job& j, int ea) {
  int32_t* ready = &j.ready[ea];
  if (__atomic_load_n(ready, __ATOMIC_ACQUIRE) >= j.chunks1) return;
  const auto t0 = std::chrono::steady_clock::now();
  auto count = [&j, t0] {
    int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - t0)
                     .count();
    __atomic_add_fetch(&j.await_ns, ns, __ATOMIC_RELAXED);
  };
  for (int spins = 0; spins < kExpertSpins; ++spins) {
    if (__atomic_load_n(ready, __ATOMIC_ACQUIRE) >= j.chunks1) return count();
    cpu_relax();
  }
  for (;;) {
    if (__atomic_load_n(ready, __ATOMIC_ACQUIRE) >= j.chunks1) return count();
    __atomic_add_fetch(&j.sleepers, 1, __ATOMIC_SEQ_CST);
    int32_t v = __atomic_load_n(ready, __ATOMIC_SEQ_CST);
    if (v < j.chunks1) futex_wait_at(reinterpret_cast<uint32_t*>(ready), (uint32_t)v);
    __atomic_sub_fetch(&j.sleepers, 1, __ATOMIC_SEQ_CST);
  }
}

// Expert e's down bias for rows [r0, r0 + rows) added to n outputs `stride` floats apart.
inline void add_down_bias(const Layer& L, int e, int64_t r0, int64_t rows, int n, float* y,
                          int64_t stride) {
  if (L.glu.down_bias.empty()) return;
  const float* b = L.glu.down_bias.data() + (int64_t)e * L.H + r0;
  for (int v = 0; v < n; ++v)
    for (int64_t r = 0; r < rows; ++r) y[v * stride + r] += b[r];
}

// Down for rows [r0, r1) of every active expert, weighted and summed into out.
void down_sum(Job& j, int64_t item) {
  const Layer& L = *j.L;
  const int64_t H = L.H, I = L.I;
  int64_t r0 = item * j.c2, r1 = min64(H, r0 + j.c2), rows = r1 - r0;
  for (int64_t t = 0; t < j.T; ++t) std::memset(j.out + t * H + r0, 0, rows * sizeof(float));
  float y[kGroup * kMaxChunk];
  for (int ea = 0; ea < j.n_active; ++ea) {
    int e = j.active[ea];
    await_expert(j, ea);
    for (int64_t p0 = j.start[ea]; p0 < j.start[ea + 1]; p0 += kGroup) {
      int n = (int)min64(kGroup, j.start[ea + 1] - p0);
      L.down.fn(L.down.experts[e], I, r0, r1, offset_act(j.ha, p0), nullptr, n, y, rows);
      add_down_bias(L, e, r0, rows, n, y, rows);
      for (int v = 0; v < n; ++v) {
        float wgt = j.pw[p0 + v];
        float* o = j.out + (int64_t)j.ptok[p0 + v] * H + r0;
        for (int64_t r = 0; r < rows; ++r) o[r] += wgt * y[v * rows + r];
      }
    }
  }
}

// DOWN_EXPERTS: the weighted sum of the pairs' down outputs for rows [r0, r1) of H, in pair
// order (experts ascending), as down_sum adds them.
void sum_pairs(Job& j, int64_t r0, int64_t r1) {
  const int64_t H = j.L->H, rows = r1 - r0;
  for (int64_t t = 0; t < j.T; ++t) std::memset(j.out + t * H + r0, 0, rows * sizeof(float));
  for (int64_t p = 0; p < j.P; ++p) {
    float wgt = j.pw[p];
    const float* y = j.y + p * H + r0;
    float* o = j.out + (int64_t)j.ptok[p] * H + r0;
    for (int64_t r = 0; r < rows; ++r) o[r] += wgt * y[r];
  }
}

// DOWN_EXPERTS: down for rows [r0, r1) of one active expert, per pair into y; the item that
// completes these rows for every expert sums them (its counter's acquire-release chain makes
// the other items' y visible to it).
void down_expert(Job& j, int64_t item) {
  const Layer& L = *j.L;
  const int64_t H = L.H, I = L.I;
  int ea = (int)(item / j.chunks2);
  int64_t c = item % j.chunks2, r0 = c * j.c2, r1 = min64(H, r0 + j.c2);
  int e = j.active[ea];
  await_expert(j, ea);
  for (int64_t p0 = j.start[ea]; p0 < j.start[ea + 1]; p0 += kGroup) {
    int n = (int)min64(kGroup, j.start[ea + 1] - p0);
    L.down.fn(L.down.experts[e], I, r0, r1, offset_act(j.ha, p0), nullptr, n,
              j.y + p0 * H + r0, H);
    add_down_bias(L, e, r0, r1 - r0, n, j.y + p0 * H + r0, H);
  }
  if (__atomic_add_fetch(&j.rows_done[c], 1, __ATOMIC_ACQ_REL) == j.n_active)
    sum_pairs(j, r0, r1);
}

}  // namespace

void run_expert_item(void* ctx, int phase, int64_t item, int) {
  Job& j = *(Job*)ctx;
  if (phase == 0)
    prepare_x(j, item);
  else if (phase == 1)
    gate_up(j, item);
  else if (j.down == DOWN_ROWS)
    down_sum(j, item);
  else
    down_expert(j, item);
}

}  // namespace ft
