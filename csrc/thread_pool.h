// A pool of pinned workers that run phased jobs. A job is a few phases of independent items;
// workers take items with an atomic counter and meet at a barrier between phases. Jobs live in
// kSlots preallocated slots, so submitting allocates nothing; workers run them in the order they
// were published. Every wait spins for a bounded time and then blocks on a futex.
//
// Threads: any thread may acquire a slot, publish it, wait for it and release it; every
// acquired slot must be published, waited and released, in that order. Slots come back in any
// order, so one caller holding a slot never blocks another.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace ft {

// A futex word and the number of threads sleeping on it.
struct Word {
  std::atomic<uint32_t> v{0};
  std::atomic<uint32_t> sleepers{0};
};

using ItemFn = void (*)(void* ctx, int phase, int64_t item, int worker);

// Sleep while *addr == expected (returns at once if it differs); wake every sleeper on addr.
void futex_wait_at(uint32_t* addr, uint32_t expected);
void futex_wake_all_at(uint32_t* addr);

constexpr int kMaxPhases = 4;

class Pool {
 public:
  static constexpr int kSlots = 16;
  static constexpr int64_t kBarrierSpinNs = 2000000;
  static constexpr int64_t kWaitSpinNs = 1000000;

  // One worker per entry of `cores` (pinned there; -1 leaves a worker unpinned).
  Pool(const std::vector<int>& cores, int spin_us);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return (int)workers_.size(); }

  // A free slot (blocks while all kSlots are taken); the caller then fills its context.
  int acquire();
  // Queue the slot's job: counts[p] items in phase p, each run as fn(ctx, p, item, worker).
  // Bit p of `overlap` lets workers start phase p + 1 once phase p's items are all taken
  // rather than all done; its items must then wait for what they need themselves.
  // `signal`, when given, is set to 1 (a release store) as the job is done, by the worker that
  // ends it: a flag another device may poll (a decode graph waits on it), with no thread of
  // ours in between.
  void publish(int slot, const int64_t* counts, int phases, ItemFn fn, void* ctx,
               unsigned overlap = 0, uint32_t* signal = nullptr);
  // Run items of the slot's job on the calling thread, then block until the job is done.
  // With join false the caller only blocks (its caches stay its own).
  void wait(int slot, bool join = true);
  // Nanoseconds from the slot's publish to its last item's end (valid after wait).
  int64_t elapsed_ns(int slot) const;
  // Where a job's time went, in nanoseconds from its publish (after wait; it first waits for
  // every worker to leave the job, whose last writes may come after the job is done): when
  // its first item started, when each phase's last item ended, and (with set_timing(true))
  // the time workers spent inside each phase's items, summed over workers.
  struct Timing {
    int64_t start = 0, end[kMaxPhases] = {}, busy[kMaxPhases] = {};
  };
  Timing timing(int slot);
  // Time every item (two clock reads per item); off by default.
  void set_timing(bool on) { timing_.store(on, std::memory_order_relaxed); }
  // Hand the slot back (after wait).
  void release(int slot);
  void debug();

  // What each worker is doing, for a stack dump of a stuck engine: kWorkerFields int64s per
  // worker (WorkerField order). Read with relaxed loads while the workers run: each field is
  // exact, a worker's fields together are a snapshot only to within one item.
  enum WorkerState : int64_t {
    kWaitingSpin = 0,   // no job: spinning for the next one
    kWaitingSleep = 1,  // no job: asleep on the futex
    kRunning = 2,       // running items of a job
    kBarrierSpin = 3,   // between phases of a job: spinning for the others
    kBarrierSleep = 4,  // between phases: asleep
    kStopped = 5,
  };
  enum WorkerField : int { kWfState = 0, kWfPhase, kWfForNs, kWfJobs, kWfItems, kWorkerFields };
  void worker_states(int64_t* out) const;
  // Job slots free now (kSlots when every job has been waited for).
  int free_slots() const { return (int)free_count_.v.load(std::memory_order_relaxed); }

 private:
  struct alignas(64) Slot {
    Word state;  // kFree, kReady, kDone
    Word exited;  // workers that have left this slot's job
    std::atomic<int64_t> next[kMaxPhases];
    Word done[kMaxPhases];  // items finished, per phase (low 32 bits)
    int64_t count[kMaxPhases];
    int phases = 0;
    unsigned overlap = 0;
    ItemFn fn = nullptr;
    void* ctx = nullptr;
    uint32_t* signal = nullptr;  // set to 1 as the job is done (publish's)
    int last = -1;  // the last phase with items
    int64_t published_ns = 0, start_ns = 0;
    std::atomic<int64_t> end_ns[kMaxPhases], busy_ns[kMaxPhases];
  };
  enum : uint32_t { kFree = 0, kReady = 1, kDone = 2 };
  // Published jobs in order: ticket t runs slot queue_[t % kQueue]. An entry is rewritten only
  // after every worker has left its job, since at most kSlots jobs are unfinished at a time.
  static constexpr int kQueue = 2 * kSlots;

  struct alignas(64) WorkerInfo {  // one cache line per worker: no false sharing
    std::atomic<int64_t> state{kWaitingSpin}, phase{-1}, since_ns{0}, jobs{0}, items{0};
    void set(WorkerState st, int64_t now) {
      state.store(st, std::memory_order_relaxed);
      since_ns.store(now, std::memory_order_relaxed);
    }
  };

  void worker_main(int index, int core);
  void run(Slot& s, int worker);

  std::vector<Slot> slots_;
  std::vector<WorkerInfo> info_;  // one per worker, made before the workers start
  std::vector<std::thread> workers_;
  std::mutex mu_;             // guards the free ring, queue_ writes and next_ticket_
  int free_[kSlots] = {};     // free slots, a ring: free_head_ is the one free the longest
  int free_head_ = 0;
  int free_size_ = 0;
  Word free_count_;           // free_size_, to wait on
  int queue_[kQueue] = {};
  uint32_t next_ticket_ = 0;
  Word submitted_;            // tickets published so far (mod 2^32)
  std::atomic<bool> stop_{false};
  std::atomic<bool> timing_{false};
  int64_t spin_ns_;          // before sleeping while idle or waiting for a result
  int64_t barrier_spin_ns_;  // before sleeping between phases: the others are at work, and a
                             // futex wake-up can cost tens of microseconds in a VM
  int64_t wait_spin_ns_;     // before the caller of wait() sleeps: about one layer's work
};

}  // namespace ft
