#include "thread_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_PAUSE() _mm_pause()
#else
#define FT_PAUSE() ((void)0)
#endif

namespace ft {
namespace {

void futex_wait(std::atomic<uint32_t>* w, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* w) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace

void futex_wait_at(uint32_t* addr, uint32_t expected) {
  syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all_at(uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Wait until pred(w.v) holds: spin for at most spin_ns, then sleep on the futex. A worker's
// `asleep` callback (when given) is called once, as it goes to sleep.
struct NoNote {
  void operator()() const {}
};
template <class Pred, class Note = NoNote>
void await(Word& w, Pred pred, int64_t spin_ns, Note asleep = Note()) {
  if (pred(w.v.load(std::memory_order_acquire))) return;
  if (spin_ns > 0) {
    int64_t deadline = now_ns() + spin_ns;
    for (int i = 1;; ++i) {
      FT_PAUSE();
      if (pred(w.v.load(std::memory_order_acquire))) return;
      if ((i & 63) == 0 && now_ns() > deadline) break;
    }
  }
  bool noted = false;
  for (;;) {
    uint32_t v = w.v.load();
    if (pred(v)) return;
    if (!noted) asleep(), noted = true;
    w.sleepers.fetch_add(1);
    v = w.v.load();
    if (!pred(v)) futex_wait(&w.v, v);
    w.sleepers.fetch_sub(1);
  }
}

void wake(Word& w) {
  if (w.sleepers.load() > 0) futex_wake_all(&w.v);
}

}  // namespace

Pool::Pool(const std::vector<int>& cores, int spin_us)
    : slots_(kSlots),
      spin_ns_((int64_t)spin_us * 1000),
      barrier_spin_ns_(spin_ns_ > kBarrierSpinNs ? spin_ns_ : kBarrierSpinNs),
      wait_spin_ns_(spin_ns_ > kWaitSpinNs || spin_ns_ == 0 ? spin_ns_ : kWaitSpinNs) {
  for (Slot& s : slots_) s.exited.v.store((uint32_t)cores.size());
  info_ = std::vector<WorkerInfo>(cores.size());
  for (int i = 0; i < kSlots; ++i) free_[i] = i;
  free_size_ = kSlots;
  free_count_.v.store(kSlots);
  workers_.reserve(cores.size());
  for (size_t i = 0; i < cores.size(); ++i)
    workers_.emplace_back(&Pool::worker_main, this, (int)i, cores[i]);
}

Pool::~Pool() {
  stop_.store(true);
  submitted_.v.fetch_add(1);
  futex_wake_all(&submitted_.v);
  for (std::thread& t : workers_) t.join();
}

int Pool::acquire() {
  int slot;
  for (;;) {
    await(free_count_, [](uint32_t v) { return v > 0; }, spin_ns_);
    std::lock_guard<std::mutex> lock(mu_);
    if (free_size_ == 0) continue;
    // The slot free the longest: workers that woke late may still be leaving the last job's
    // slot, and taking that one would wait for them.
    slot = free_[free_head_];
    free_head_ = (free_head_ + 1) % kSlots;
    free_count_.v.store((uint32_t)--free_size_);
    break;
  }
  // Workers may still be leaving the slot's previous job (they finish it without us).
  uint32_t n = (uint32_t)workers_.size();
  await(slots_[slot].exited, [n](uint32_t v) { return v == n; }, spin_ns_);
  return slot;
}

void Pool::publish(int slot, const int64_t* counts, int phases, ItemFn fn, void* ctx,
                   unsigned overlap, uint32_t* signal) {
  Slot& s = slots_[slot];
  s.phases = phases;
  s.signal = signal;
  s.overlap = overlap;
  s.last = -1;
  s.fn = fn;
  s.ctx = ctx;
  for (int p = 0; p < kMaxPhases; ++p) {
    s.count[p] = p < phases ? counts[p] : 0;
    s.next[p].store(0, std::memory_order_relaxed);
    s.done[p].v.store(0, std::memory_order_relaxed);
    s.end_ns[p].store(0, std::memory_order_relaxed);
    s.busy_ns[p].store(0, std::memory_order_relaxed);
    if (s.count[p] > 0) s.last = p;
  }
  s.start_ns = 0;
  s.exited.v.store(0, std::memory_order_relaxed);
  s.published_ns = now_ns();
  s.state.v.store(kReady, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  queue_[next_ticket_ % kQueue] = slot;
  ++next_ticket_;
  submitted_.v.store(next_ticket_, std::memory_order_seq_cst);
  wake(submitted_);
}

void Pool::wait(int slot, bool join) {
  // The waiting thread has a core of its own and nothing else to do: it takes items of the
  // job too (items do not depend on who runs them), then blocks for the rest.
  if (join) run(slots_[slot], -1);
  await(slots_[slot].state, [](uint32_t v) { return v == kDone; }, wait_spin_ns_);
}

int64_t Pool::elapsed_ns(int slot) const {
  // The last phase's end is written before the job is marked done, so wait() has seen it.
  const Slot& s = slots_[slot];
  return s.last < 0 ? 0 : s.end_ns[s.last].load(std::memory_order_relaxed) - s.published_ns;
}

Pool::Timing Pool::timing(int slot) {
  Slot& s = slots_[slot];
  uint32_t n = (uint32_t)workers_.size();
  await(s.exited, [n](uint32_t v) { return v == n; }, spin_ns_);
  Timing t;
  auto since = [&s](int64_t ns) { return ns ? ns - s.published_ns : 0; };
  t.start = since(s.start_ns);
  for (int p = 0; p < kMaxPhases; ++p) {
    t.end[p] = since(s.end_ns[p].load(std::memory_order_relaxed));
    t.busy[p] = s.busy_ns[p].load(std::memory_order_relaxed);
  }
  return t;
}

void Pool::release(int slot) {
  slots_[slot].state.v.store(kFree);
  std::lock_guard<std::mutex> lock(mu_);
  free_[(free_head_ + free_size_) % kSlots] = slot;
  free_count_.v.store((uint32_t)++free_size_);
  wake(free_count_);
}

void Pool::worker_states(int64_t* out) const {
  int64_t now = now_ns();
  for (size_t i = 0; i < info_.size(); ++i) {
    const WorkerInfo& w = info_[i];
    int64_t* o = out + i * kWorkerFields;
    o[kWfState] = w.state.load(std::memory_order_relaxed);
    o[kWfPhase] = w.phase.load(std::memory_order_relaxed);
    o[kWfForNs] = now - w.since_ns.load(std::memory_order_relaxed);
    o[kWfJobs] = w.jobs.load(std::memory_order_relaxed);
    o[kWfItems] = w.items.load(std::memory_order_relaxed);
  }
}

void Pool::run(Slot& s, int worker) {
  WorkerInfo* me = worker >= 0 ? &info_[worker] : nullptr;  // callers of wait() are not tracked
  int first = -1, last = -1;
  for (int p = 0; p < s.phases; ++p)
    if (s.count[p] > 0) last = p, first = first < 0 ? p : first;
  const bool timed = timing_.load(std::memory_order_relaxed);
  for (int p = 0; p <= last; ++p) {
    int64_t count = s.count[p];
    if (count == 0) continue;
    if (me) me->phase.store(p, std::memory_order_relaxed);
    for (;;) {
      int64_t item = s.next[p].fetch_add(1, std::memory_order_relaxed);
      if (item >= count) break;
      int64_t t0 = timed || (item == 0 && p == first) ? now_ns() : 0;
      if (item == 0 && p == first) s.start_ns = t0;
      s.fn(s.ctx, p, item, worker);
      if (timed) s.busy_ns[p].fetch_add(now_ns() - t0, std::memory_order_relaxed);
      if (me) me->items.fetch_add(1, std::memory_order_relaxed);
      if ((int64_t)s.done[p].v.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
        s.end_ns[p].store(now_ns(), std::memory_order_relaxed);
        if (p == last) {
          // every item's writes come before this (the counter's acq_rel chain)
          if (s.signal) __atomic_store_n(s.signal, 1u, __ATOMIC_RELEASE);
          s.state.v.store(kDone);
          wake(s.state);
        } else {
          wake(s.done[p]);
        }
      }
    }
    if (p != last && !(s.overlap >> p & 1)) {
      if (me) me->set(kBarrierSpin, now_ns());
      await(s.done[p], [count](uint32_t v) { return (int64_t)v == count; }, barrier_spin_ns_,
            [me] { if (me) me->set(kBarrierSleep, now_ns()); });
      if (me) me->state.store(kRunning, std::memory_order_relaxed);
    }
  }
}

void Pool::worker_main(int index, int core) {
  if (core >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
  char name[16];
  std::snprintf(name, sizeof name, "ft-moe-%d", index);
  pthread_setname_np(pthread_self(), name);
  uint32_t mine = 0;  // the ticket this worker runs next (mod 2^32)
  WorkerInfo& me = info_[index];
  for (;;) {
    me.set(kWaitingSpin, now_ns());
    await(submitted_, [this, mine](uint32_t v) { return v != mine || stop_.load(); }, spin_ns_,
          [&me] { me.set(kWaitingSleep, now_ns()); });
    if (stop_.load()) {
      me.set(kStopped, now_ns());
      return;
    }
    Slot& s = slots_[queue_[mine % kQueue]];
    me.set(kRunning, now_ns());
    me.jobs.fetch_add(1, std::memory_order_relaxed);
    run(s, index);
    s.exited.v.fetch_add(1);
    wake(s.exited);
    ++mine;
  }
}

}  // namespace ft
