#include "expert_op.h"

#include <chrono>

namespace ft {

void Scratch::carve(const size_t* sizes, int n, uint8_t** part) {
  auto align64 = [](size_t v) { return (v + 63) & ~(size_t)63; };
  size_t total = 0;
  for (int i = 0; i < n; ++i) total += align64(sizes[i]);
  if (size < total) {
    mem.reset(new uint8_t[total + 64]);
    size = total;
  }
  uint8_t* base = mem.get();
  base += (64 - (uintptr_t)base % 64) % 64;
  size_t off = 0;
  for (int i = 0; i < n; off += align64(sizes[i]), ++i) part[i] = sizes[i] ? base + off : nullptr;
}

int64_t block_of(int fmt) { return fmt >= 0 && fmt < F_COUNT ? FMT_INFO[fmt].block : 1; }

const char* fmt_name(int fmt) { return fmt >= 0 && fmt < F_COUNT ? FMT_INFO[fmt].name : "unknown"; }

Executor::Executor(const std::vector<int>& cores, int isa_cap, int spin_us)
    : pool_(cores, spin_us), isa_(isa_cap < best_isa() ? isa_cap : best_isa()) {
  if (isa_ < 0) isa_ = ISA_SCALAR;
  quant_ = pick_quantizer(isa_);
}

std::string Executor::set_kernel(Proj& p, int act_mode) {
  // f32 weights are kept unquantised on purpose (a router, whose logits pick the experts):
  // int8 or bf16 activations would undo that, whatever the mode asks for the other formats.
  if (p.fmt == F_F32) act_mode = ACT_F32;
  Pick best{nullptr, -1};
  int best_act = ACT_F32;
  for (int act = 0; act < ACT_COUNT; ++act) {
    if (act_mode >= 0 && act != act_mode) continue;
    if (act == ACT_Q8 && p.cols % 32) continue;
    Pick k = pick_kernel(p.fmt, act, isa_);
    if (k.fn && k.isa > best.isa) {
      best = k;
      best_act = act;
    }
  }
  if (!best.fn)
    return std::string("no CPU kernel for ") + fmt_name(p.fmt) +
           (act_mode == ACT_Q8 ? " with int8 activations" : "") + " at or below isa " +
           isa_name(isa_);
  p.fn = best.fn;
  p.act = best_act;
  p.isa = best.isa;
  return "";
}

std::string Executor::add_layer(int layer, int E, int H, int I, int activation, ExpertGlu glu,
                                Proj gate, Proj up, Proj down, int act_mode) {
  if (layer < 0 || E <= 0 || H <= 0 || I <= 0) return "layer, E, H and I must be positive";
  if (activation < ACTV_SILU || activation > ACTV_SWIGLU_OAI) return "unknown activation";
  if (activation == ACTV_SWIGLU_OAI && !(glu.limit > 0 && glu.alpha > 0))
    return "the clamped SwiGLU needs a positive alpha and limit";
  const size_t EI = (size_t)E * I, EH = (size_t)E * H;
  if (!glu.gate_bias.empty() || !glu.up_bias.empty() || !glu.down_bias.empty())
    if (glu.gate_bias.size() != EI || glu.up_bias.size() != EI || glu.down_bias.size() != EH)
      return "biases must be (E, I) for gate and up and (E, H) for down, all three";
  struct Want {
    Proj* p;
    const char* name;
    int64_t rows, cols;
  } wants[3] = {{&gate, "gate_proj", I, H}, {&up, "up_proj", I, H}, {&down, "down_proj", H, I}};
  for (Want& w : wants) {
    Proj& p = *w.p;
    if (p.fmt < 0 || p.fmt >= F_COUNT) return std::string(w.name) + ": unknown format";
    if (p.rows != w.rows || p.cols != w.cols)
      return std::string(w.name) + ": shape " + std::to_string(p.rows) + "x" +
             std::to_string(p.cols) + " but the layer needs " + std::to_string(w.rows) + "x" +
             std::to_string(w.cols);
    if ((int64_t)p.experts.size() != E)
      return std::string(w.name) + ": " + std::to_string(p.experts.size()) + " experts, want " +
             std::to_string(E);
    if (p.cols % block_of(p.fmt))
      return std::string(w.name) + ": " + fmt_name(p.fmt) + " rows of " +
             std::to_string(p.cols) + " are not whole blocks";
    std::string err = set_kernel(p, act_mode);
    if (!err.empty()) return std::string(w.name) + ": " + err;
  }
  auto L = std::make_unique<Layer>();
  L->E = E;
  L->H = H;
  L->I = I;
  L->activation = activation;
  L->glu = std::move(glu);
  L->gate = std::move(gate);
  L->up = std::move(up);
  L->down = std::move(down);
  L->x_needs[L->gate.act] = true;
  L->x_needs[L->up.act] = true;
  std::lock_guard<std::mutex> lock(layers_mu_);
  if ((int)layers_.size() <= layer) layers_.resize(layer + 1);
  layers_[layer] = std::move(L);
  return "";
}

const Layer* Executor::layer(int layer) const {
  return layer >= 0 && layer < (int)layers_.size() ? layers_[layer].get() : nullptr;
}

int64_t Executor::submit(int layer_id, const float* x, const int64_t* ids, const float* w,
                         float* out, int T, int A, uint32_t* signal) {
  const Layer* L;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    L = layer(layer_id);
  }
  if (!L || T <= 0 || A <= 0) return -1;
  int64_t P = 0;
  for (int64_t i = 0; i < (int64_t)T * A; ++i) {
    if (ids[i] >= L->E) return -2;
    P += ids[i] >= 0;
  }
  int slot = pool_.acquire();
  Job& j = jobs_[slot];
  const int64_t H = L->H, I = L->I, E = L->E;
  j.L = L;
  j.quant = quant_;
  j.x = x;
  j.out = out;
  j.T = T;
  j.nthreads = threads();

  // Carve the scratch: sizes first, then grow (the slot is free, so nothing reads it now).
  const bool xbf = L->x_needs[ACT_BF16], xq = L->x_needs[ACT_Q8];
  const bool hbf = L->down.act == ACT_BF16, hq = L->down.act == ACT_Q8;
  size_t sizes[] = {
      (size_t)E * 4,                                  // count
      (size_t)(E < P ? E : P) * 4,                    // active
      (size_t)(E < P ? E : P) * 4,                    // ready
      (size_t)((E < P ? E : P) + 1) * 4,              // start
      (size_t)P * 4,                                  // ptok
      (size_t)P * 4,                                  // pw
      0, 0, 0, 0, 0, 0,                               // x representations (6..11)
      (size_t)P * I * 4,                              // h f32
      0, 0, 0, 0, 0, 0,                               // h representations (13..18)
      0,                                              // y (DOWN_EXPERTS)
      0,                                              // rows_done (DOWN_EXPERTS)
  };
  const int split = down_split_.load(std::memory_order_relaxed);
  j.down = split == DOWN_AUTO ? (P <= kExpertSplitPairs ? DOWN_EXPERTS : DOWN_ROWS) : split;
  if (P == 0) j.down = DOWN_ROWS;  // no expert to wait for: down_sum's items write the zeros
  if (j.down == DOWN_EXPERTS) {
    sizes[19] = (size_t)P * H * 4;
    sizes[20] = (size_t)cdiv(H, 16) * 4;  // chunks2 is at most this (c2 >= 16)
  }
  act_sizes(T, H, xbf, xq, sizes + 6);
  act_sizes(P, I, hbf, hq, sizes + 13);
  constexpr int kParts = sizeof sizes / sizeof sizes[0];
  uint8_t* part[kParts];
  j.scratch.carve(sizes, kParts, part);
  j.count = (int32_t*)part[0];
  j.active = (int32_t*)part[1];
  j.ready = (int32_t*)part[2];
  j.start = (int32_t*)part[3];
  j.ptok = (int32_t*)part[4];
  j.pw = (float*)part[5];
  j.xa = act_view(H, x, part + 6);
  j.hf = (float*)part[12];
  j.hbf = (uint16_t*)part[13];
  j.hq = (int8_t*)part[14];
  j.hd = (float*)part[15];
  j.hdl = (float*)part[16];
  j.hgs = (int32_t*)part[17];
  j.hgb = (int32_t*)part[18];
  j.ha = act_view(I, j.hf, part + 13);
  j.y = (float*)part[19];
  j.rows_done = (int32_t*)part[20];
  j.P = P;
  j.await_ns = 0;

  // Group the (token, expert) pairs by expert: a counting sort, stable in token order.
  for (int64_t e = 0; e < E; ++e) j.count[e] = 0;
  for (int64_t i = 0; i < (int64_t)T * A; ++i)
    if (ids[i] >= 0) ++j.count[ids[i]];
  j.n_active = 0;
  int32_t pos = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (!j.count[e]) continue;
    j.active[j.n_active] = (int32_t)e;
    j.start[j.n_active++] = pos;
    int32_t c = j.count[e];
    j.count[e] = pos;
    pos += c;
  }
  if (j.n_active) j.start[j.n_active] = pos;
  for (int i = 0; i < j.n_active; ++i) j.ready[i] = 0;
  j.sleepers = 0;
  for (int64_t i = 0; i < (int64_t)T * A; ++i) {
    if (ids[i] < 0) continue;
    int32_t p = j.count[ids[i]]++;
    j.ptok[p] = (int32_t)(i / A);
    j.pw[p] = w[i];
  }
  j.weight_bytes =
      j.n_active * (L->gate.expert_bytes + L->up.expert_bytes + L->down.expert_bytes);
  bytes_[slot] = j.weight_bytes;

  // Enough items that every worker takes several (the last round is then short); chunks
  // stay whole q8 blocks.
  const int64_t target = 8 * (int64_t)j.nthreads;
  // Gate/up items of up to 128 rows (long contiguous reads), halved while there are fewer than
  // about three per worker.
  j.c1 = gate_up_rows_.load(std::memory_order_relaxed);
  if (!j.c1)
    for (j.c1 = kMaxGateUpRows; j.c1 > 32 && j.n_active * cdiv(I, j.c1) < 3 * j.nthreads;)
      j.c1 /= 2;
  j.chunks1 = cdiv(I, j.c1);
  int64_t counts[4] = {xbf || xq ? T : 0, (int64_t)j.n_active * j.chunks1, 0, 0};
  if (j.down == DOWN_ROWS) {
    j.c2 = cdiv(H, 64) >= target ? 64 : cdiv(H, 32) >= target ? 32 : 16;
    counts[2] = cdiv(H, j.c2);
  } else {
    j.c2 = 256;
    while (j.c2 > 16 && j.n_active * cdiv(H, j.c2) < target) j.c2 /= 2;
    j.chunks2 = cdiv(H, j.c2);
    counts[2] = j.n_active * j.chunks2;
    for (int64_t c = 0; c < j.chunks2; ++c) j.rows_done[c] = 0;
  }
  // Down items start as soon as the first experts' h is ready (no barrier).
  pool_.publish(slot, counts, 3, run_expert_item, &j, /*overlap=*/1u << 1, signal);
  return slot;
}

int64_t Executor::wait(int64_t handle, int64_t* ns, int64_t* timing) {
  int slot = (int)handle;
  pool_.wait(slot, join_.load(std::memory_order_relaxed));
  int64_t bytes = bytes_[slot];
  if (ns) *ns = pool_.elapsed_ns(slot);
  if (timing) {
    Pool::Timing t = pool_.timing(slot);
    timing[TM_START] = t.start;
    for (int p = 0; p < kMaxPhases; ++p) {
      timing[TM_END + p] = t.end[p];
      timing[TM_BUSY + p] = t.busy[p];
    }
    timing[TM_AWAIT] = __atomic_load_n(&jobs_[slot].await_ns, __ATOMIC_RELAXED);
  }
  pool_.release(slot);
  return bytes;
}

namespace {

struct ReadJob {
  ReadFn fn;
  const uint8_t* buf;
  int64_t bytes, chunk, chunks;
  std::atomic<uint64_t> sink{0};
};

void run_read(void* ctx, int, int64_t item, int) {
  ReadJob& r = *(ReadJob*)ctx;
  int64_t c = item % r.chunks;
  int64_t n = min64(r.chunk, r.bytes - c * r.chunk);
  r.sink.fetch_xor(r.fn(r.buf + c * r.chunk, n), std::memory_order_relaxed);
}

}  // namespace

double Executor::stream_read(const uint8_t* buf, int64_t bytes, int reps) {
  ReadJob r;
  r.fn = pick_reader(isa_);
  r.buf = buf;
  r.bytes = bytes & ~(int64_t)63;
  r.chunk = 1 << 20;
  r.chunks = cdiv(r.bytes, r.chunk);
  int64_t counts[1] = {r.chunks * reps};
  int slot = pool_.acquire();
  auto t0 = std::chrono::steady_clock::now();
  pool_.publish(slot, counts, 1, run_read, &r);
  pool_.wait(slot, join_.load(std::memory_order_relaxed));
  auto t1 = std::chrono::steady_clock::now();
  pool_.release(slot);
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace ft
